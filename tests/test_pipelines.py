"""pipelines: fill_mask, classify, embed, generate on directories and on loaded models, each against
what transformers itself answers for the same tiny checkpoint."""

from __future__ import annotations

import torch
import transformers
from typer.testing import CliRunner

from kiln import pipelines
from kiln.cli.main import app
from kiln.models import load_pretrained

transformers.logging.set_verbosity_error()
TEXTS = ["paris is the capital of france", "a dog"]


def test_classify_scores_equal_transformers_softmax(tiny_factory):
    src = tiny_factory("roberta", "sequence-classification")
    out = pipelines.classify(src, TEXTS)
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(src).eval()
    batch = transformers.AutoTokenizer.from_pretrained(src)(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = hf(**batch).logits
    probs = logits.softmax(-1)
    for row, p, want in zip(out, probs, logits.argmax(-1).tolist()):
        assert row[0]["label"] == hf.config.id2label[want]  # the top label is transformers' argmax
        assert len(row) == 3 and abs(sum(item["score"] for item in row) - 1) < 1e-5
        for item in row:
            j = int(item["label"].split("_")[1])
            assert item["score"] == float(p[j])
    r = CliRunner().invoke(app, ["classify", str(src), "a dog", "--top", "2"], terminal_width=200)
    assert r.exit_code == 0 and r.output.count("LABEL_") == 2, r.output


def test_fill_mask_equals_the_transformers_pipeline(tiny_factory):
    src = tiny_factory("bert", "masked-lm")
    mlm = load_pretrained(src)  # a loaded model, not a path
    text = "paris is the [MASK] of france"
    top = pipelines.fill_mask(mlm, text, k=4)
    theirs = transformers.pipeline("fill-mask", model=str(src), top_k=4)(text)
    assert [(t["token_id"], t["token"], t["sequence"]) for t in top] == \
        [(t["token"], t["token_str"], t["sequence"]) for t in theirs]
    assert [t["score"] for t in top] == [t["score"] for t in theirs]
    # over the whole vocabulary the scores are a distribution
    every = pipelines.fill_mask(mlm, text, k=mlm.config.vocab_size)
    assert len(every) == mlm.config.vocab_size and abs(sum(t["score"] for t in every) - 1) < 1e-5


def test_embed_is_transformers_mean_pooled_and_normalised(tiny_factory):
    src = tiny_factory("bert", "base")
    emb = pipelines.embed(src, TEXTS)
    hf = transformers.AutoModel.from_pretrained(src).eval()
    batch = transformers.AutoTokenizer.from_pretrained(src)(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = hf(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    want = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=1)
    assert emb.shape == (2, 32)
    torch.testing.assert_close(emb, want, rtol=1e-6, atol=1e-6)


def test_generate_greedy_equals_transformers_generate(tiny_factory):
    src = tiny_factory("qwen3", "causal-lm")
    tok = transformers.AutoTokenizer.from_pretrained(src)
    hf = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    ids = tok("the king", add_special_tokens=False, return_tensors="pt")["input_ids"]
    want = hf.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:]
    assert len(want) == 12 and len(set(want.tolist())) > 1  # no EOS in the tiny config: all 12 steps run
    got = pipelines.generate(src, "the king", max_new_tokens=12)
    assert got == tok.decode(want) and got == pipelines.generate(src, "the king", max_new_tokens=12)
    # an EOS ends both at the same place: the 4th greedy token made the EOS
    eos = int(want[3])
    stop = hf.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=eos)[0, ids.shape[1]:]
    assert stop.tolist() == want[:want.tolist().index(eos) + 1].tolist()
    assert pipelines.generate(src, "the king", max_new_tokens=12, eos_token_id=eos) == tok.decode(stop)


def test_continuer_runs_on_the_engine_and_reuses_a_chats_earlier_turns(tiny_factory):
    """A chat's next prompt starts with the last one: the engine finds those blocks in its cache (fewer tokens
    fed than the two prompts hold) and the replies equal the model's own generate loop, greedy."""
    from kiln.models import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_factory("qwen3", "causal-lm")).eval()
    run = pipelines.Continuer(model, 6, max_seqs=1)
    assert run.engine is not None
    first = list(range(5, 45))  # 40 tokens: two full blocks of 16 are remembered
    reply = run(first)
    second = first + reply + list(range(50, 60))
    again = run(second)
    for prompt, got in ((first, reply), (second, again)):
        want = model.generate(torch.tensor([prompt]), max_new_tokens=6)[0, len(prompt):].tolist()
        assert got == want
    fed = run.engine.tokens_fed
    assert fed < len(first) + len(second) + 2 * 6 - 32, fed  # the second prompt's first 32 tokens came from the cache
