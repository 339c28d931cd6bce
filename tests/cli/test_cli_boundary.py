"""The CLI's error boundary and output rules beyond single bad inputs: a bug keeps its traceback,
KILN_DEBUG shows every traceback, output into a pipe is never wrapped, --overwrite replaces a model
without leaving old weight files, and a resume with a changed lr is allowed and noted."""

from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.errors import KilnError
from tests.cli.bad_inputs_world import write_toml


def test_a_bug_keeps_its_traceback_and_a_user_error_does_not(monkeypatch, tmp_path):
    def broken(*args, **kwargs):
        raise RuntimeError("an internal bug")

    monkeypatch.setattr("kiln.train.plot.plot_run", broken)
    r = CliRunner().invoke(app, ["plot", str(tmp_path)])
    assert isinstance(r.exception, RuntimeError) and "kiln: " not in r.output  # not swallowed as a message

    def user_error(*args, **kwargs):
        raise KilnError("a [bracketed] message")

    monkeypatch.setattr("kiln.train.plot.plot_run", user_error)
    r = CliRunner().invoke(app, ["plot", str(tmp_path)])
    assert r.exit_code == 1 and r.output.strip() == "kiln: a [bracketed] message"
    monkeypatch.setenv("KILN_DEBUG", "1")
    r = CliRunner().invoke(app, ["plot", str(tmp_path)])
    assert isinstance(r.exception, KilnError)  # KILN_DEBUG: the traceback, not the one-liner


@pytest.mark.parametrize("argv, message", [
    (["train", "--bogus"], "kiln: No such option: --bogus (try 'kiln train --help')"),
    (["train"], "kiln: Missing option '--config' / '-c'."),
    (["nosuch"], "kiln: No such command 'nosuch'."),
])
def test_a_usage_error_is_one_plain_line_and_exit_status_2(argv, message):
    r = CliRunner().invoke(app, argv, prog_name="kiln")
    assert r.exit_code == 2
    assert r.output.startswith(message) and len(r.output.strip().splitlines()) == 1, r.output
    assert "╭" not in r.output and "Traceback" not in r.output


def test_output_into_a_pipe_is_not_wrapped(tiny_factory):
    prompt = "word " * 60 + "[end]"  # 305 characters: past any 80-column wrap
    r = CliRunner().invoke(app, ["generate", str(tiny_factory("qwen3", "causal-lm")), prompt, "-n", "0"])
    assert r.exit_code == 0, r.output
    assert r.output == prompt + "\n"


def test_overwrite_replaces_a_model_and_leaves_no_old_weight_files(tiny_factory, tmp_path):
    src = tiny_factory("bert", "masked-lm")
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["export", str(src), "--out", str(out), "--max-shard-mb", "1"])
    assert r.exit_code == 0, r.output
    (out / "notes.txt").write_text("mine")  # not a model file: kept
    shutil.copy(out / "model.safetensors", out / "model-00001-of-00002.safetensors")  # a stale shard
    r = CliRunner().invoke(app, ["export", str(src), "--out", str(out), "--head", "base"])
    assert r.exit_code == 1 and "--overwrite" in r.output
    r = CliRunner().invoke(app, ["export", str(src), "--out", str(out), "--head", "base", "--overwrite"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.txt",
                                                     "special_tokens_map.json", "tokenizer.json",
                                                     "tokenizer_config.json"]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertModel"]
    assert "initialised fresh (not in the weights): pooler.dense.weight" in " ".join(r.output.split())


@pytest.fixture()
def finished_run(tiny_factory, tmp_path):
    src = tiny_factory("bert", "sequence-classification")
    rows = [{"text": f"the cat {i}", "label": f"LABEL_{i % 3}"} for i in range(12)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def config(name: str, **train):
        return write_toml(tmp_path / f"{name}.toml", {
            "model": {"path": src}, "data": {"train": tmp_path / "train.jsonl", "max_length": 16},
            "train": {"out_dir": tmp_path / "run", "batch_size": 4, "progress": False, "device": "cpu",
                      "lr": 1e-3, "save_every": 1, **train}})

    r = CliRunner().invoke(app, ["train", "--config", str(config("first", steps=2))])
    assert r.exit_code == 0, r.output
    return tmp_path / "run", config


def test_resume_with_a_changed_lr_and_steps_is_allowed_and_noted(finished_run):
    run, config = finished_run
    r = CliRunner().invoke(app, ["train", "--config", str(config("second", steps=3, lr=2e-3, weight_decay=0.5)),
                                 "--resume", str(run)])
    assert r.exit_code == 0, r.output
    assert "resume: resumed with changed settings: train.lr 0.001 -> 0.002; train.steps 2 -> 3; " \
           "train.weight_decay 0.01 -> 0.5" in r.output
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    notes = [x for x in records if "note" in x]
    assert len(notes) == 1 and notes[0]["step"] == 2 and "train.lr 0.001 -> 0.002" in notes[0]["note"]
    assert [x["step"] for x in records if "loss" in x] == [1, 2, 3]
    # the new weight decay is the optimizer's, not the checkpoint's (lr is set each step by the schedule)
    groups = json.loads((run / "ckpt-000003" / "optimizer.json").read_text())["param_groups"]
    assert sorted({g["weight_decay"] for g in groups}) == [0.0, 0.5]


def test_resume_with_a_changed_seed_is_refused_naming_every_change(finished_run):
    run, config = finished_run
    before = sorted(p.name for p in run.rglob("*"))
    r = CliRunner().invoke(app, ["train", "--config", str(config("third", steps=2, seed=3, eval_every=5)),
                                 "--resume", str(run)])
    assert r.exit_code == 1
    text = " ".join(r.output.split())
    assert "train.seed 42 -> 3" in text and "(also changed, which would be fine: train.eval_every 0 -> 5)" in text
    assert sorted(p.name for p in run.rglob("*")) == before
