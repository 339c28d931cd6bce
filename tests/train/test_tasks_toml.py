"""Encoder fine-tuning from a TOML for token classification and extractive QA (JSONL), end to end."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from kiln.hub import Tokenizer
from kiln.models.auto import from_config, load_pretrained
from kiln.train.config import load_run_config
from kiln.train.metrics import read_metrics
from kiln.train.run import build_trainer
from tests.train.train_helpers import WORDS, tiny_config, write_jsonl


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory, tiny_dir):
    """The tiny BERT as a bare encoder (no head), as a pre-trained checkpoint usually is."""
    out = tmp_path_factory.mktemp("base") / "bert"
    model = from_config(tiny_config(), task="base", seed=0)
    model.tokenizer = Tokenizer.from_dir(tiny_dir)
    model.save_pretrained(out)
    return out


def _toml(tmp_path, model_dir, task, train, extra=""):
    path = tmp_path / "run.toml"
    path.write_text(f'[model]\npath = "{model_dir}"\ntask = "{task}"\n\n[data]\ntrain = "{train}"\n'
                    f'eval = "{train}"\nmax_length = 32\n{extra}\n[train]\nout_dir = "{tmp_path / "run"}"\n'
                    'steps = 3\nbatch_size = 4\nlr = 1e-3\nprogress = false\n')
    return load_run_config(path)


def test_token_classification_from_jsonl(tmp_path, base_dir):
    rng = random.Random(0)
    rows = []
    for _ in range(12):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 8))]
        rows.append({"tokens": words, "tags": ["ANIMAL" if w in ("cat", "dog", "bird", "fish") else "O" for w in words]})
    train = write_jsonl(tmp_path / "ner.jsonl", rows)
    t = build_trainer(_toml(tmp_path, base_dir, "token-classification", train, 'label_field = "tags"\n')).fit()
    recs = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in recs if "loss" in r] == [1, 2, 3] and all(math.isfinite(r.get("loss", 0)) for r in recs)
    # eval_accuracy is the share of labelled tokens whose argmax tag is right: recount it one row at a time
    model, right, judged = t.unwrapped().eval(), 0, 0
    with torch.no_grad():
        for ex in t.eval_data:
            keep = ex["labels"] != -100
            pred = model(input_ids=ex["input_ids"][None], token_type_ids=ex["token_type_ids"][None]).logits[0].argmax(-1)
            right, judged = right + int((pred[keep] == ex["labels"][keep]).sum()), judged + int(keep.sum())
    assert judged > 0 and recs[-1]["eval_accuracy"] == pytest.approx(right / judged)
    saved = load_pretrained(t.last_checkpoint / "model")
    assert saved.task == "token-classification" and saved.config.labels == ["ANIMAL", "O"]


def test_question_answering_from_jsonl(tmp_path, base_dir):
    rows = []
    for i in range(8):
        context = f"the {WORDS[i]} sits on the {WORDS[i + 10]} ."
        answer = WORDS[i + 10]
        rows.append({"question": f"where {WORDS[i]}", "context": context,
                     "answers": {"text": [answer], "answer_start": [context.index(" " + answer) + 1]}})
    train = write_jsonl(tmp_path / "qa.jsonl", rows)
    build_trainer(_toml(tmp_path, base_dir, "question-answering", train)).fit()
    recs = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert len([r for r in recs if "loss" in r]) == 3 and "eval_accuracy" in recs[-1]
    manifest = json.loads((tmp_path / "run" / "ckpt-000003" / "manifest.json").read_text())
    assert "model/model.safetensors" in manifest["files"] and "optimizer.safetensors" in manifest["files"]
