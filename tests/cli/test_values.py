"""Values stay what they are (issue 32), as tables in the bad-input suite's form: each case runs the CLI in
this process and asserts the exit code, the message, no traceback, and that nothing under the world's root
changed (sha256 + mtime of every file). Cases that succeed on purpose (1 and 1.0 one class, a regression
head on float labels, a CSV with a BOM) write only outside the root, and then assert what they wrote.

Classes: data values by kind (labels, text, chat turns, CSV BOM); config strictness; run state on resume;
tracebacks and permissions.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.hub.files import file_sha256
from tests.cli.bad_inputs_world import World, snapshot, write_toml


@pytest.fixture
def w(values_world: World) -> World:
    return values_world  # tests/cli/conftest.py: one world for this table and test_values_fallback's


def put(w: World, name: str, content: str | bytes) -> Path:
    """A data file in the world (written before the case's snapshot)."""
    path = w.data / name
    if not path.exists():
        path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def rows(labels: list, text: object = "a text") -> str:
    """Eight records of `text` cycling through `labels` (enough for two batches of four)."""
    return jsonl([{"text": text, "label": labels[i % len(labels)]} for i in range(8)])


def fine_tune(w: World, name: str, train: str | Path, model: dict | None = None, out: Path | None = None,
              **train_keys: object) -> Path:
    """A fine-tune run config: a new classification head on the tiny masked LM, so the label set comes from
    the data (as `kiln init --template classify` has it); `train` is a data file's text (written to
    <name>.jsonl) or a path; the run goes to elsewhere/ (cases that should fail never get that far)."""
    data = train if isinstance(train, Path) else put(w, f"{name}.jsonl", train)
    out = train_keys.pop("out_dir", out or w.elsewhere / name)
    return write_toml(w.data / f"{name}.toml", {
        "model": {"path": w.mlm, "task": "sequence-classification", **(model or {})},
        "data": {"train": data, "max_length": 16},
        "train": {"out_dir": out, "steps": 2, "batch_size": 4, "progress": False,
                  "device": "cpu", **train_keys}})


def sft(w: World, name: str, records: list[dict]) -> Path:
    return write_toml(w.data / f"{name}.toml", {
        "model": {"path": w.chat_lm, "task": "causal-lm"},
        "data": {"train": put(w, f"{name}.jsonl", jsonl(records)), "max_length": 32},
        "train": {"out_dir": w.elsewhere / name, "steps": 2, "batch_size": 2, "progress": False, "device": "cpu"}})


def written_config(w: World, name: str) -> dict:
    return json.loads((w.elsewhere / name / "ckpt-000002" / "model" / "config.json").read_text())


@dataclass
class Case:
    id: str
    args: Callable[[World], list]
    code: int
    says: str                                   # must appear in the output (whitespace folded)
    after: Callable[[World], None] | None = None  # more checks once it ran (what a success wrote)
    patch: Callable | None = None               # (monkeypatch, world) -> None


C = Case
LABEL = "must be a class label (a string or an integer), got"

DATA = [
    C("label-null", lambda w: ["train", "--config", fine_tune(w, "lnull", rows(["a", None]))], 1,
      f"lnull.jsonl:2: field 'label' {LABEL} null"),
    C("label-list", lambda w: ["train", "--config", fine_tune(w, "llist", rows(["pos", ["pos", "sport"]]))], 1,
      f"llist.jsonl:2: field 'label' {LABEL} a list (['pos', 'sport'])"),
    C("label-object", lambda w: ["train", "--config", fine_tune(w, "lobj", rows([{"name": "pos"}]))], 1,
      f"lobj.jsonl:1: field 'label' {LABEL} an object"),
    C("label-fraction", lambda w: ["train", "--config", fine_tune(w, "lhalf", rows([0, 0.5, 1.5]))], 1,
      f"lhalf.jsonl:2: field 'label' {LABEL} the number 0.5; a number to regress on needs a regression head: "
      "model.num_labels = 1"),
    C("label-nan", lambda w: ["train", "--config", fine_tune(w, "lnan", '{"text": "a", "label": NaN}\n' * 8)], 1,
      f"lnan.jsonl:1: field 'label' {LABEL} NaN"),
    C("label-infinity", lambda w: ["train", "--config", fine_tune(w, "linf", '{"text": "a", "label": 1}\n'
                                                                   '{"text": "a", "label": Infinity}\n' * 4)], 1,
      f"linf.jsonl:2: field 'label' {LABEL} Infinity"),
    C("label-boolean", lambda w: ["train", "--config", fine_tune(w, "lbool", rows([True, False]))], 1,
      f"lbool.jsonl:1: field 'label' {LABEL} the boolean true"),
    C("label-one-and-one-point-zero", lambda w: ["train", "--config", fine_tune(
        w, "lint", rows([1, 1.0, 2, 2.0]), model={"num_labels": 2})], 0, "",
      after=lambda w: _labels_are(w, "lint", ["1", "2"])),
    C("label-null-in-eval-set-labels", lambda w: ["train", "--config", fine_tune(
        w, "lset", rows([None]), model={"labels": ["LABEL_0", "LABEL_1"]})], 1, f"lset.jsonl:1: field 'label' {LABEL} null"),
    C("text-null", lambda w: ["train", "--config", fine_tune(w, "tnull", jsonl(
        [{"text": "a", "label": "LABEL_0"}, {"text": None, "label": "LABEL_1"}] * 4))], 1,
      "tnull.jsonl:2: field 'text' must be a string, got null"),
    C("text-number", lambda w: ["train", "--config", fine_tune(w, "tnum", rows(["LABEL_0"], text=42))], 1,
      "tnum.jsonl:1: field 'text' must be a string, got the number 42"),
    C("sft-response-null", lambda w: ["train", "--config", sft(w, "rnull", [{"prompt": "hi", "response": None}] * 4)],
      1, "rnull.jsonl:1: field 'response' must be a string, got null"),
    C("sft-prompt-number", lambda w: ["train", "--config", sft(w, "pnum", [{"prompt": 3, "response": "ok"}] * 4)],
      1, "pnum.jsonl:1: field 'prompt' must be a string, got int"),
    C("sft-content-null", lambda w: ["train", "--config", sft(w, "cnull", [{"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]}] * 4)], 1,
      "cnull.jsonl:1: messages[1] must be an object with string 'role' and 'content' (content null only in an "
      "assistant turn with tool_calls)"),
    C("regression-float-labels-train", lambda w: ["train", "--config", fine_tune(
        w, "reg", rows([0.5, 1.5, -2.25, 3]), model={"num_labels": 1})], 0, "",
      after=lambda w: _regression_trained(w, "reg")),
    C("regression-csv-numbers-train", lambda w: ["train", "--config", fine_tune(
        w, "regcsv", put(w, "regcsv.csv", "text,label\n" + "a text,0.5\nb text,1.25\n" * 4), model={"num_labels": 1})],
      0, "", after=lambda w: _regression_trained(w, "regcsv")),
    C("regression-label-not-a-number", lambda w: ["train", "--config", fine_tune(
        w, "regtxt", rows([0.5, "high"]), model={"num_labels": 1})], 1,
      "regtxt.jsonl:2: field 'label' must be a finite number for this regression head (num_labels = 1), got 'high'"),
    C("regression-label-nan", lambda w: ["train", "--config", fine_tune(
        w, "regnan", '{"text": "a", "label": NaN}\n' * 8, model={"num_labels": 1})], 1,
      "regnan.jsonl:1: field 'label' must be a finite number for this regression head (num_labels = 1), got NaN"),
    C("csv-bom", lambda w: ["train", "--config", fine_tune(
        w, "bom", put(w, "bom.csv", "\ufefftext,label\n" + "a text,LABEL_0\nb text,LABEL_1\n" * 4))], 0, "",
      after=lambda w: _labels_are(w, "bom", ["LABEL_0", "LABEL_1"])),
]


def _labels_are(w: World, name: str, labels: list[str]) -> None:
    id2label = written_config(w, name).get("id2label", {"0": "LABEL_0", "1": "LABEL_1"})  # absent: HF's default two
    assert [id2label[str(i)] for i in range(len(id2label))] == labels


def _regression_trained(w: World, name: str) -> None:
    """The head has one output (transformers reads num_labels = 1 as regression) and the loss it logged is
    the mean squared error of float targets: finite, and not the 0 a one-class cross entropy would give."""
    cfg = written_config(w, name)
    assert len(cfg["id2label"]) == 1 and cfg.get("problem_type") in (None, "regression")
    losses = [r["loss"] for r in map(json.loads, (w.elsewhere / name / "metrics.jsonl").read_text().splitlines())
              if "loss" in r]
    assert losses and all(0 < x < 1e3 for x in losses), losses


def _dropout_applied(w: World, name: str) -> None:
    """The override reached the model (the checkpoint's config.json), the untouched keys kept the stored values."""
    cfg = written_config(w, name)
    stored = json.loads((w.cls / "config.json").read_text())
    assert stored["hidden_dropout_prob"] == 0.1 and cfg["hidden_dropout_prob"] == 0.0
    assert cfg["attention_probs_dropout_prob"] == stored["attention_probs_dropout_prob"]
    assert cfg["num_hidden_layers"] == stored["num_hidden_layers"]


def classifier(w: World, name: str, model: dict | None = None, **train_keys: object) -> Path:
    """A fine-tune config continuing the tiny classifier's own head on the world's labelled data."""
    return fine_tune(w, name, w.data / "train.jsonl", model={"path": w.cls, **(model or {})}, **train_keys)


RESHAPE = "beside model.path: changes the shape of weights stored in"
CONFIG = [
    C("config-dropout-applied", lambda w: ["train", "--config", classifier(
        w, "drop", model={"config": {"hidden_dropout_prob": 0.0}})], 0, "",
      after=lambda w: _dropout_applied(w, "drop")),
    C("config-layers-beside-path", lambda w: ["train", "--config", classifier(
        w, "lay", model={"config": {"num_hidden_layers": 6}})], 1, f"model.config.num_hidden_layers = 6 {RESHAPE}"),
    C("config-layers-flag-beside-path", lambda w: ["train", "--config", classifier(w, "layflag"), "--layers", "6"], 1,
      f"model.config.num_hidden_layers = 6 {RESHAPE}"),
    C("config-hidden-size-beside-path", lambda w: ["train", "--config", classifier(
        w, "hid", model={"config": {"hidden_size": 64}})], 1, f"model.config.hidden_size = 64 {RESHAPE}"),
    C("config-heads-beside-path", lambda w: ["train", "--config", classifier(
        w, "heads", model={"config": {"num_attention_heads": 2}})], 1,
      "model.config.num_attention_heads = 2 beside model.path: keeps every stored weight's shape but changes how"),
    C("config-unknown-field-beside-path", lambda w: ["train", "--config", classifier(
        w, "unk", model={"config": {"drop_out": 0.0}})], 1, "'drop_out' is not a config field of model_type 'bert'"),
    C("config-wrong-kind-beside-path", lambda w: ["train", "--config", classifier(
        w, "kind", model={"config": {"hidden_dropout_prob": "none"}})], 1,
      "config.json has hidden_dropout_prob = 0.1; a str cannot replace it"),
    C("config-steps-true", lambda w: ["train", "--config", classifier(w, "stepstrue", steps=True)], 1,
      "stepstrue.toml:11: train.steps: a boolean (true) is not a number"),
    C("config-steps-true-set", lambda w: ["train", "--config", classifier(w, "stepsset"), "--set", "train.steps=true"],
      1, "command line: train.steps: a boolean (true) is not a number"),
    C("config-lr-text", lambda w: ["train", "--config", classifier(w, "lrtext", lr="1e-3")], 1,
      "train.lr: Input should be a valid number, not text: got '1e-3' (drop the quotes)"),
    C("config-betas-boolean", lambda w: ["train", "--config", classifier(w, "betasb", betas=[0.9, True])], 1,
      "train.betas: a boolean (true) is not a number"),
    C("config-out-dir-empty", lambda w: ["train", "--config", classifier(w, "outempty", out_dir="")], 1,
      "outempty.toml:10: train.out_dir: must be a folder path, got ''"),
]

def resume_config(w: World, name: str, model: Path | None = None, eval_file: Path | None = None, out: Path | None = None,
                  **train_keys: object) -> Path:
    """The world's finished run's own config (bad_inputs_world.build_world), with the given changes."""
    return write_toml(w.data / f"{name}.toml", {
        "model": {"path": model or w.cls, "task": "sequence-classification"},
        "data": {"train": w.data / "train.jsonl", "max_length": 16, "eval": eval_file},
        "train": {"out_dir": out or w.root / "run", "steps": 2, "batch_size": 4, "save_every": 1, "lr": 1e-3,
                  "progress": False, "device": "cpu", **train_keys}})


def run_copy(w: World, name: str) -> Path:
    """A copy of the world's finished run outside the root (a resume writes into its run)."""
    dst = w.elsewhere / name
    if not dst.exists():
        shutil.copytree(w.run, dst)
    return dst


def _bad_metrics_line(w: World) -> Path:
    run = run_copy(w, "badline")
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text(lines[0] + "{oops\n" + "".join(lines[1:]))
    return run


def _metrics_kept(w: World) -> None:
    run = w.elsewhere / "badline"
    steps = [r["step"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    assert steps == [1, 2, 3], steps  # step 2's record, after the bad line, survived the resume
    assert json.loads((run / "metrics.rejected.jsonl").read_text()) == {"line": 2, "text": "{oops"}


def _retokenized(w: World) -> Path:
    """The classifier with a tokenizer of the same size whose ids differ: two vocabulary entries swapped."""
    d = w.data / "retok"
    if not d.exists():
        shutil.copytree(w.cls, d)
        tok = json.loads((d / "tokenizer.json").read_text())
        vocab = tok["model"]["vocab"]
        a, b = sorted(vocab, key=vocab.get)[-2:]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (d / "tokenizer.json").write_text(json.dumps(tok))
    return d


def _eval_changed(w: World) -> list:
    """A run with an eval file, then the eval file's contents changed (same name) before its resume."""
    ev = w.data / "eval-a.jsonl"
    ev.write_text((w.data / "train.jsonl").read_text())
    out = w.elsewhere / "evalrun"
    r = CliRunner().invoke(app, ["train", "--config", str(resume_config(w, "evalrun", eval_file=ev, out=out))])
    assert r.exit_code == 0, r.output
    ev.write_text("".join(reversed((w.data / "train.jsonl").read_text().splitlines(keepends=True)))[:-1] + "\n")
    return ["train", "--config", resume_config(w, "evalrun2", eval_file=ev, out=out, steps=3), "--resume", out]


def _truncated_optimizer(w: World) -> Path:
    """ckpt-000002's optimizer file cut short and its manifest updated to match: checksums pass, loading fails."""
    run = run_copy(w, "truncopt")
    ck = run / "ckpt-000002"
    opt = ck / "optimizer.safetensors"
    opt.write_bytes(opt.read_bytes()[:-64])
    manifest = json.loads((ck / "manifest.json").read_text())
    manifest["files"]["optimizer.safetensors"] = {"sha256": file_sha256(opt), "bytes": opt.stat().st_size}
    (ck / "manifest.json").write_text(json.dumps(manifest))
    return run


STATE = [
    C("resume-metrics-bad-line-kept", lambda w: ["train", "--config", resume_config(w, "rbad", steps=3), "--resume",
                                                 _bad_metrics_line(w)], 0,
      "line(s) 2 hold no metrics record (not JSON, or no numeric step); kept aside in metrics.rejected.jsonl",
      after=_metrics_kept),
    C("resume-changed-tokenizer", lambda w: ["train", "--config", resume_config(w, "rtok", model=_retokenized(w)),
                                             "--resume", w.run], 1,
      "tokenizer changed: its vocabulary, merges, special tokens or chat template differ from the run's"),
    C("resume-changed-eval-data", _eval_changed, 1, "eval data changed: data.eval's contents differ from the run's"),
    C("resume-checkpoint-folder", lambda w: ["train", "--config", resume_config(w, "rck", steps=3), "--resume",
                                             run_copy(w, "ckfolder") / "ckpt-000002"], 0, "resume: from ckpt-000002 (step 2)",
      after=lambda w: (w.elsewhere / "ckfolder" / "ckpt-000003" / "manifest.json").is_file() or pytest.fail("no step 3")),
    C("resume-older-checkpoint-folder", lambda w: ["train", "--config", resume_config(w, "rold", steps=3), "--resume",
                                                   w.run / "ckpt-000001"], 1,
      "holds newer checkpoints (ckpt-000002); a resume continues from the newest"),
    C("resume-unreadable-checkpoint-falls-back", lambda w: ["train", "--config", resume_config(w, "rtrunc"), "--resume",
                                                            _truncated_optimizer(w)], 0,
      "ckpt-000002: optimizer.safetensors cannot be read"),
]

def _int32_weight(w: World) -> Path:
    """The classifier with one float weight (the head's) stored as int32 under its own name."""
    d = w.data / "int32"
    if not d.exists():
        shutil.copytree(w.cls, d)
        state = load_file(str(d / "model.safetensors"))
        state["classifier.weight"] = state["classifier.weight"].round().to(torch.int32)
        save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def unreadable(monkeypatch, w: World) -> None:
    """Opening the classifier's weights fails as it does for a file this user may not read (tests run as root,
    which reads anything, so the refusal is injected where kiln opens the file: its one header read,
    kiln.hub.headers)."""
    import builtins
    import errno

    def deny(file, *args, **kwargs):
        if str(file) == str(w.cls / "model.safetensors"):
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return builtins.open(file, *args, **kwargs)

    monkeypatch.setattr("kiln.hub.headers.open", deny, raising=False)


def _exported_modes(w: World, name: str, mode: int) -> None:
    files = [f for f in (w.elsewhere / name).iterdir() if f.is_file()]
    assert {f.name for f in files} >= {"model.safetensors", "config.json"}
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {f.name: oct(mode) for f in files}


_RESTORE: list[int] = []  # umasks to put back after a case


def umask(value: int) -> Callable:
    """The process umask set to `value` for the case (kiln reads it from /proc, as any run would)."""
    def patch(monkeypatch, w: World) -> None:
        _RESTORE.append(os.umask(value))
    return patch


DTYPE = "is stored as int32 (integer), but"
TRACEBACKS = [
    C("inspect-int32-weight", lambda w: ["inspect", _int32_weight(w)], 1, f"tensor 'classifier.weight' {DTYPE} a bert "
      "model holds it as floating-point (float32)"),
    C("classify-int32-weight", lambda w: ["classify", _int32_weight(w), "a text"], 1, f"'classifier.weight' {DTYPE}"),
    C("export-int32-weight", lambda w: ["export", _int32_weight(w), "--out", w.elsewhere / "i32"], 1,
      f"'classifier.weight' {DTYPE}"),
    C("train-int32-weight", lambda w: ["train", "--config", classifier(w, "i32run", model={"path": _int32_weight(w)})],
      1, f"'classifier.weight' {DTYPE}"),
    C("weights-permission-denied", lambda w: ["classify", w.cls, "a text"], 1,
      "model.safetensors: permission denied: this user may not read the file", patch=unreadable),
    C("export-mode-follows-umask-022", lambda w: ["export", w.cls, "--out", w.elsewhere / "m022"], 0, "",
      patch=umask(0o022), after=lambda w: _exported_modes(w, "m022", 0o644)),
    C("export-mode-follows-umask-027", lambda w: ["export", w.cls, "--out", w.elsewhere / "m027"], 0, "",
      patch=umask(0o027), after=lambda w: _exported_modes(w, "m027", 0o640)),
]

CASES = DATA + CONFIG + STATE + TRACEBACKS


def run_case(case: Case, w: World, monkeypatch) -> None:
    args = [str(a) for a in case.args(w)]
    before = snapshot(w.root)
    if case.patch is not None:
        case.patch(monkeypatch, w)
    r = CliRunner().invoke(app, args)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    assert r.exit_code == case.code, r.output
    assert case.says in " ".join(r.output.split()), r.output
    assert "Traceback" not in r.output, r.output
    if case.code == 1:
        assert "kiln: " in r.output, r.output
    assert snapshot(w.root) == before, "the case changed files under the world's root"
    assert not list(w.elsewhere.glob(".*kiln-tmp*")), "a staging folder was left behind"
    if case.after is not None:
        case.after(w)


@pytest.mark.parametrize("case", DATA, ids=[c.id for c in DATA])
def test_data_values(case: Case, w: World, monkeypatch):
    run_case(case, w, monkeypatch)


@pytest.mark.parametrize("case", CONFIG, ids=[c.id for c in CONFIG])
def test_config_values(case: Case, w: World, monkeypatch):
    run_case(case, w, monkeypatch)


@pytest.mark.parametrize("case", STATE, ids=[c.id for c in STATE])
def test_state_values(case: Case, w: World, monkeypatch):
    run_case(case, w, monkeypatch)


@pytest.mark.parametrize("case", TRACEBACKS, ids=[c.id for c in TRACEBACKS])
def test_no_traceback(case: Case, w: World, monkeypatch):
    try:
        run_case(case, w, monkeypatch)
    finally:
        while _RESTORE:
            os.umask(_RESTORE.pop())


def test_case_ids_are_unique():
    assert len({c.id for c in CASES}) == len(CASES)
