"""SFT data: tokenizer training, chat template parity with transformers, loss masks, truncation, packing, errors."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from kiln.constants import IGNORE_INDEX as IGNORE
from kiln.data.bpe import train_bpe
from kiln.data.records import read_records
from kiln.data.sft import encode_conversation, encode_sft, pack_samples
from kiln.errors import KilnError
from kiln.hub import ChatTemplate

transformers.logging.set_verbosity_error()

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "Hi. How can I help?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another, in français?"},
     {"role": "assistant", "content": "Vert — green."}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Tell me a joke"}],
]
# A second template in another style: a bos variable, a namespace, loop controls and filters.
LLAMA_STYLE = (
    "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{% if m['role'] == 'system' %}<|im_start|>system: {{ m['content'] | trim }}<|im_end|>{% continue %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}{{ ns.n | tojson }}"
)


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("bpe")
    corpus = d / "corpus.jsonl"
    lines = [{"messages": c} for c in CONVERSATIONS] * 3 + [{"text": "the quick brown fox jumps over the lazy dog"}] * 5
    corpus.write_text("\n".join(json.dumps(x, ensure_ascii=False) for x in lines) + "\n")
    (d / "plain.txt").write_text("some plain text\nand more text here\n")
    train_bpe([corpus, d / "plain.txt"], d / "tok", vocab_size=300, min_frequency=1)
    return d / "tok"


def test_trained_tokenizer_is_byte_level_with_chat_specials(tok_dir):
    from kiln.hub import Tokenizer

    tok = Tokenizer.from_dir(tok_dir)
    assert [tok.backend.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [0, 1, 2]
    assert tok.vocab_size <= 300 and tok.specials["eos_token"] == "<|im_end|>"
    text = "naïve ✓ <|im_start|>x"
    assert tok.decode(tok.backend.encode(text).ids, skip_special_tokens=False) == text
    assert tok.backend.encode("<|im_end|>").ids == [2]
    hf = transformers.AutoTokenizer.from_pretrained(tok_dir)
    assert hf.eos_token == "<|im_end|>" and hf.pad_token_id == 0


@pytest.mark.parametrize("template", [None, LLAMA_STYLE], ids=["chatml", "llama-style"])
def test_chat_template_renders_as_transformers(tok_dir, tmp_path, template):
    from kiln.hub import Tokenizer

    d = tok_dir
    if template is not None:
        import shutil
        d = tmp_path / "tok"
        shutil.copytree(tok_dir, d)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg.update(chat_template=template, bos_token="<|endoftext|>")
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, hf = Tokenizer.from_dir(d), transformers.AutoTokenizer.from_pretrained(d)
    chat = ours.chat()
    for conv in CONVERSATIONS:
        for gen in (False, True):
            text = chat.render(conv, add_generation_prompt=gen)
            assert text == hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
            ids = hf.apply_chat_template(conv, tokenize=True, add_generation_prompt=gen)
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
            assert ours.backend.encode(text, add_special_tokens=False).ids == list(ids)


def test_loss_only_on_assistant_replies_and_their_end_of_turn(tok_dir):
    from kiln.hub import Tokenizer

    tok = Tokenizer.from_dir(tok_dir)
    conv = CONVERSATIONS[1]
    ids, labels = encode_conversation(tok, tok.chat(), conv)
    kept = [i for i, lab in zip(ids, labels) if lab != IGNORE]
    # exactly the two replies, each followed by <|im_end|>, and nothing else (no role headers, no newlines)
    want = []
    for reply in ("Blue.", "Vert — green."):
        want += tok.backend.encode(reply, add_special_tokens=False).ids + [tok.backend.token_to_id("<|im_end|>")]
    assert kept == want
    assert tok.decode(kept, skip_special_tokens=False) == "Blue.<|im_end|>Vert — green.<|im_end|>"
    assert all(lab == i for i, lab in zip(ids, labels) if lab != IGNORE)
    ids_all, labels_all = encode_conversation(tok, tok.chat(), conv, train_on="all")
    assert ids_all == ids and labels_all == ids


def test_truncation_counted_and_prompt_response_records(tok_dir, tmp_path):
    from kiln.hub import Tokenizer

    tok = Tokenizer.from_dir(tok_dir)
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "hi", "response": "hello " * 80}) + "\n"
                 + json.dumps({"prompt": "a", "response": "b", "system": "s"}) + "\n")
    examples, stats = encode_sft(read_records(f), tok, max_length=48)
    assert stats.samples == 2 and stats.truncated == 1 and max(len(e["input_ids"]) for e in examples) == 48
    assert "1 truncated" in stats.line()
    assert tok.decode(examples[1]["input_ids"].tolist(), skip_special_tokens=False).startswith("<|im_start|>system\ns")


def test_bad_lines_are_named(tok_dir, tmp_path):
    from kiln.hub import Tokenizer

    tok = Tokenizer.from_dir(tok_dir)
    cases = [('{"messages": [}', r"bad\.jsonl:2: not valid JSON"),
             ('{"text": "x"}', r"bad\.jsonl:2: needs 'messages' or 'prompt' and 'response' \(fields here: text\)"),
             ('{"messages": [{"role": "user"}]}', r"bad\.jsonl:2: messages\[0\] must be an object with string"),
             ('{"messages": [{"role": "tool", "content": "x"}]}', r"unknown role tool; this template knows system")]
    for line, msg in cases:
        f = tmp_path / "bad.jsonl"
        f.write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n" + line + "\n")
        with pytest.raises(KilnError, match=msg):
            encode_sft(read_records(f), tok, max_length=64)
    with pytest.raises(KilnError, match="chat template line 1"):
        ChatTemplate("{% for %}")


def test_packed_batch_gives_each_sample_its_own_loss(tiny_factory):
    from kiln.data.loader import pad_collate
    from kiln.models import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_factory("qwen3", "causal-lm"))
    g = torch.Generator().manual_seed(0)
    samples = []
    for n in (5, 9, 1, 7, 6):
        ids = torch.randint(4, 99, (n,), generator=g).tolist()
        labels = [i if k % 3 else IGNORE for k, i in enumerate(ids)]
        samples.append((ids, labels))
    rows = pack_samples(samples, max_length=16)
    assert [len(r["input_ids"]) for r in rows] == [15, 13]  # 5+9+1 | 7+6
    batch = pad_collate(rows)
    assert "attention_mask" not in batch and batch["position_ids"][1, 13:].tolist() == [0, 1]

    def token_losses(out_logits, labels):
        lab = torch.nn.functional.pad(labels, (0, 1), value=IGNORE)[..., 1:]
        return torch.nn.functional.cross_entropy(out_logits.transpose(1, 2), lab, ignore_index=IGNORE, reduction="none")

    with torch.no_grad():
        packed = token_losses(model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits,
                              batch["labels"])
        starts = [(0, 0), (0, 5), (0, 14), (1, 0), (1, 7)]
        for (ids, labels), (row, start) in zip(samples, starts):
            alone = token_losses(model(input_ids=torch.tensor([ids])).logits, torch.tensor([labels]))[0]
            torch.testing.assert_close(packed[row, start:start + len(ids)].sum(), alone.sum(), rtol=1e-6, atol=1e-6)


def test_tokenizer_training_names_a_line_that_is_not_utf8(tmp_path):
    bad = tmp_path / "corpus.txt"
    bad.write_bytes(b"first line\nsecond line\n" + b"caf\xe9 au lait\n")
    with pytest.raises(KilnError, match=r"corpus\.txt:3: not valid UTF-8"):
        train_bpe([bad], tmp_path / "tok", vocab_size=300)
