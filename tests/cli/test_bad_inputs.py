"""Bad inputs to every command, as a table: each case runs the CLI in this process and asserts the
exit code, the message (`kiln: ...`, no traceback) and that nothing under the world's root changed
(every file's sha256 and mtime, every folder). Cases that succeed on purpose (markup in a prompt,
a note instead of a refusal) write nothing there either. `kiln launch` runs as a subprocess.
"""

from __future__ import annotations

import errno
import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kiln.cli.main import app
from tests.cli.bad_inputs_world import World, build_world, snapshot, write_toml
from tests.kiln_cli import kiln_cli


@pytest.fixture(scope="module")
def w(tmp_path_factory, tiny_factory) -> World:
    return build_world(tmp_path_factory.mktemp("world"), tmp_path_factory.mktemp("elsewhere"), tiny_factory)


def put(w: World, name: str, content: str | bytes) -> Path:
    """A data file in the world (written before the case's snapshot)."""
    path = w.data / name
    if isinstance(content, str):
        content = content.encode()
    if not path.exists():
        path.write_bytes(content)
    return path


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def run_config(w: World, name: str, model: dict | None = None, data: dict | None = None, train: dict | None = None,
               **sections: dict) -> Path:
    """A fine-tune run config on the tiny classifier, with the given keys changed."""
    return write_toml(w.data / f"{name}.toml", {
        "model": {"path": w.cls, "task": "sequence-classification", **(model or {})},
        "data": {"train": w.data / "train.jsonl", "max_length": 16, **(data or {})},
        "train": {"out_dir": w.root / "runs" / name, "steps": 2, "batch_size": 4, "progress": False,
                  "device": "cpu", **(train or {})}, **sections})


def sft_config(w: World, name: str, rows: list[dict], **data: object) -> Path:
    return write_toml(w.data / f"{name}.toml", {
        "model": {"path": w.chat_lm, "task": "causal-lm"},
        "data": {"train": put(w, f"{name}.jsonl", jsonl(rows)), "max_length": 32, **data},
        "train": {"out_dir": w.root / "runs" / name, "steps": 2, "batch_size": 2, "progress": False,
                  "device": "cpu"}})


def pretrain_config(w: World, name: str, shards: Path, **data: object) -> Path:
    return write_toml(w.data / f"{name}.toml", {
        "model": {"family": "qwen3", "task": "causal-lm", "tokenizer": w.tok,
                  "config": {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 1,
                             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}},
        "data": {"train": shards, "max_length": 8, **data},
        "train": {"out_dir": w.root / "runs" / name, "steps": 3, "batch_size": 2, "progress": False,
                  "device": "cpu"}})


def full_disk(monkeypatch, w: World) -> None:
    """Writing weights fails as safetensors fails on a full disk (its own exception, not an OSError)."""
    from safetensors import SafetensorError

    def fail(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("kiln.hub.weights.save_file", fail)


def read_only(monkeypatch, w: World) -> None:
    """Creating anything under elsewhere/ro fails as it does on a read-only file system."""
    original = Path.mkdir

    def mkdir(self, *args, **kwargs):
        if str(self).startswith(str(w.elsewhere / "ro")):
            raise OSError(errno.EROFS, "Read-only file system", str(self))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir)


@dataclass
class Case:
    id: str
    args: Callable[[World], list]
    code: int
    says: str                        # must appear in the output
    patch: Callable | None = None    # (monkeypatch, world) -> None
    subprocess: bool = False


C = Case
MASKED = "paris is the [MASK] of france"
LONG = " ".join(["the"] * 80)  # 80 words: more than the tiny models' 64 positions
CHAT = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]}] * 4

CASES = [
    # ---- inspect --------------------------------------------------------------------------------
    C("inspect-missing", lambda w: ["inspect", w.root / "nope"], 1, "nope: no such"),
    C("inspect-markup-path", lambda w: ["inspect", _dir(w, "[red]m[/red] [/b]", {})], 1,
      "[red]m[/red] [/b]: no config.json"),
    C("inspect-markup-path-ok", lambda w: ["inspect", _model_copy(w, "[b]model[/b] [/i]")], 0,
      "[b]model[/b] [/i]"),
    C("inspect-bracket-dir", lambda w: ["inspect", w.data / "[/x]"], 1, "[/x]"),
    C("inspect-config-not-json", lambda w: ["inspect", _dir(w, "badjson", {"config.json": "{oops"})], 1,
      "config.json:1"),
    C("inspect-no-model-type", lambda w: ["inspect", _dir(w, "notype", {"config.json": "{}"})], 1, "model_type"),
    C("inspect-unknown-type", lambda w: ["inspect", _dir(w, "unktype", {"config.json": '{"model_type": "zzz"}'})],
      1, "zzz"),
    C("inspect-no-weights", lambda w: ["inspect", _dir(w, "noweights", {"config.json": (w.mlm / "config.json")
                                                                          .read_text()})], 1, "safetensors"),
    C("inspect-torn-weights", lambda w: ["inspect", _torn(w)], 1, "kiln: "),
    # ---- export ---------------------------------------------------------------------------------
    C("export-no-source", lambda w: ["export", "--out", w.elsewhere / "x1"], 1, "give exactly one of SRC"),
    C("export-two-sources", lambda w: ["export", w.mlm, "--checkpoint", w.run / "ckpt-000002", "--out",
                                       w.elsewhere / "x2"], 1, "give exactly one of SRC"),
    C("export-over-a-model", lambda w: ["export", w.mlm, "--out", w.cls], 1, "already holds a model"),
    C("export-over-a-tokenizer", lambda w: ["export", w.mlm, "--out", w.tok], 1, "already holds a tokenizer"),
    C("export-over-a-run", lambda w: ["export", w.mlm, "--out", w.run], 1, "already holds a training run"),
    C("export-over-a-file", lambda w: ["export", w.mlm, "--out", w.data / "text.txt"], 1, "is a file"),
    C("export-onto-itself", lambda w: ["export", w.mlm, "--out", w.mlm], 1, "is the source directory"),
    C("export-fewer-layers", lambda w: ["export", w.layers, "--out", w.elsewhere / "x3"], 1,
      "16 tensor(s) in the weights have no place"),
    C("export-extra-tensor", lambda w: ["export", w.extra, "--out", w.elsewhere / "x4"], 1,
      "bert.encoder.extra.weight"),
    C("export-unknown-head", lambda w: ["export", w.mlm, "--head", "tagger", "--out", w.elsewhere / "x5"], 1,
      "unknown head 'tagger'"),
    C("export-tampered-checkpoint", lambda w: ["export", "--checkpoint", w.run_tampered / "ckpt-000002", "--out",
                                               w.elsewhere / "x6"], 1, "does not match its checksum"),
    C("export-partial-checkpoint", lambda w: ["export", "--checkpoint", w.run_partial / "ckpt-000002", "--out",
                                              w.elsewhere / "x7"], 1, "no manifest.json"),
    C("export-run-dir-as-checkpoint", lambda w: ["export", "--checkpoint", w.run, "--out", w.elsewhere / "x8"], 1,
      "is a run directory"),
    C("export-model-dir-as-checkpoint", lambda w: ["export", "--checkpoint", w.mlm, "--out", w.elsewhere / "x9"],
      1, "not a kiln checkpoint"),
    C("export-shard-mb-zero", lambda w: ["export", w.mlm, "--max-shard-mb", "0", "--out", w.elsewhere / "x10"], 1,
      "--max-shard-mb must be >= 1"),
    C("export-full-disk", lambda w: ["export", w.mlm, "--out", w.root / "full"], 1, "No space left on device",
      patch=full_disk),
    C("export-read-only", lambda w: ["export", w.mlm, "--out", w.elsewhere / "ro" / "x"], 1,
      "Read-only file system", patch=read_only),
    # ---- verify-export, verify-matrix -----------------------------------------------------------
    C("verify-export-missing", lambda w: ["verify-export", w.root / "nope"], 1, "no such"),
    C("verify-export-not-a-model", lambda w: ["verify-export", w.data], 1, "no config.json"),
    C("verify-matrix-cells-missing", lambda w: ["verify-matrix", "--cells", w.data / "nocells.json"], 1, "kiln: "),
    C("verify-matrix-cells-not-json", lambda w: ["verify-matrix", "--cells", put(w, "cells.json", "[{")], 1,
      "cells.json"),
    C("verify-matrix-cells-not-objects", lambda w: ["verify-matrix", "--cells", put(w, "cells2.json", "[1]")], 1,
      "item 0 must be an object"),
    C("verify-matrix-device-unknown", lambda w: ["verify-matrix", "--device", "tpu9"], 1, "--device 'tpu9'"),
    C("verify-export-device-unknown", lambda w: ["verify-export", w.mlm, "--device", "gpu"], 1, "--device 'gpu'"),
    # ---- fill-mask, classify ---------------------------------------------------------------------
    C("fill-mask-no-mask", lambda w: ["fill-mask", w.mlm, "no mask here"], 1, "no [MASK] token in the text"),
    C("fill-mask-k-zero", lambda w: ["fill-mask", w.mlm, MASKED, "-k", "0"], 1, "-k must be >= 1, got 0"),
    C("fill-mask-k-past-vocab", lambda w: ["fill-mask", w.mlm, MASKED, "-k", "1000"], 1, "<= 99, got 1000"),
    C("fill-mask-untrained-head", lambda w: ["fill-mask", w.cls, MASKED], 1, "--allow-missing"),
    C("fill-mask-fewer-layers", lambda w: ["fill-mask", w.layers, MASKED], 1, "--allow-unused"),
    C("fill-mask-extra-allowed", lambda w: ["fill-mask", w.extra, MASKED, "-k", "1", "--allow-unused"], 0,
      "dropped 1 unused tensor(s): bert.encoder.extra.weight"),
    C("fill-mask-too-long", lambda w: ["fill-mask", w.mlm, LONG + " [MASK]"], 1, "more than the model's 64 positions"),
    C("classify-masked-lm", lambda w: ["classify", w.mlm, "a text"], 1,
      "is a masked-lm checkpoint; the sequence-classification head needs"),
    C("classify-top-zero", lambda w: ["classify", w.cls, "a text", "--top", "0"], 1, "--top must be >= 1"),
    C("classify-long-text-is-cut", lambda w: ["classify", w.cls, LONG], 0, "the rest is cut off"),
    C("classify-missing-dir", lambda w: ["classify", w.root / "nope", "a text"], 1, "no such"),
    C("classify-untrained-allowed", lambda w: ["classify", w.mlm, "a text", "--allow-missing"], 0,
      "initialised fresh"),
    # ---- generate, chat ---------------------------------------------------------------------------
    C("generate-markup-prompt", lambda w: ["generate", w.lm, "See [note] and [red]x[/red] here", "-n", "0"], 0,
      "See [note] and [red]x[/red] here"),
    C("generate-closing-tag-prompt", lambda w: ["generate", w.lm, "a [/b] b", "-n", "0"], 0, "a [/b] b"),
    C("generate-negative-tokens", lambda w: ["generate", w.lm, "hi", "--max-new-tokens", "-3"], 1,
      "--max-new-tokens must be >= 0, got -3"),
    C("generate-negative-temperature", lambda w: ["generate", w.lm, "hi", "--temperature", "-1"], 1,
      "--temperature must be >= 0, got -1"),
    C("generate-top-p-zero", lambda w: ["generate", w.lm, "hi", "--top-p", "0"], 1, "--top-p must be > 0"),
    C("generate-top-p-above-one", lambda w: ["generate", w.lm, "hi", "--top-p", "1.5"], 1, "<= 1, got 1.5"),
    C("generate-negative-top-k", lambda w: ["generate", w.lm, "hi", "--top-k", "-1"], 1, "--top-k must be >= 0"),
    C("generate-nan-temperature", lambda w: ["generate", w.lm, "hi", "--temperature", "nan"], 1, "--temperature"),
    C("generate-encoder", lambda w: ["generate", w.mlm, "hi"], 1, "has no 'causal-lm' head"),
    C("generate-tokenizer-past-vocab", lambda w: ["generate", w.bigtok_lm, "hi"], 1,
      "the tokenizer has 300 tokens but the model's vocab_size is 99"),
    C("generate-empty-prompt", lambda w: ["generate", w.lm, ""], 1, "the prompt is empty"),
    C("chat-no-template", lambda w: ["chat", w.lm], 1, "no chat template"),
    C("chat-negative-temperature", lambda w: ["chat", w.chat_lm, "--temperature", "-1"], 1, "--temperature"),
    # ---- tokenizer train ------------------------------------------------------------------------
    C("tokenizer-over-a-model", lambda w: ["tokenizer", "train", w.data / "text.txt", "--out", w.mlm], 1,
      "already holds a model"),
    C("tokenizer-over-a-tokenizer", lambda w: ["tokenizer", "train", w.data / "text.txt", "--out", w.tok], 1,
      "pass --overwrite"),
    C("tokenizer-empty-input", lambda w: ["tokenizer", "train", put(w, "empty.txt", ""), "--out",
                                          w.elsewhere / "t1"], 1, "no text to learn from"),
    C("tokenizer-blank-input", lambda w: ["tokenizer", "train", put(w, "blank.txt", "\n \n\n"), "--out",
                                          w.elsewhere / "t2"], 1, "no text to learn from"),
    C("tokenizer-missing-input", lambda w: ["tokenizer", "train", w.data / "nope.txt", "--out", w.elsewhere / "t3"],
      1, "nope.txt: no such file"),
    C("tokenizer-not-utf8", lambda w: ["tokenizer", "train", put(w, "latin1.txt", b"ok\ncaf\xe9\n"), "--out",
                                       w.elsewhere / "t4"], 1, "latin1.txt:2: not valid UTF-8"),
    C("tokenizer-bad-jsonl", lambda w: ["tokenizer", "train", put(w, "bad.jsonl", '{"text": "a"}\n{oops\n'),
                                        "--out", w.elsewhere / "t5"], 1, "bad.jsonl:2: not valid JSON"),
    C("tokenizer-vocab-too-small", lambda w: ["tokenizer", "train", w.data / "text.txt", "--vocab-size", "10",
                                              "--out", w.elsewhere / "t6"], 1, "too small"),
    C("tokenizer-no-merges", lambda w: ["tokenizer", "train", put(w, "short.txt", "ab\n"), "--min-frequency", "50",
                                        "--out", w.elsewhere / "t7"], 1, "no merges learned"),
    C("tokenizer-read-only", lambda w: ["tokenizer", "train", w.data / "text.txt", "--out", w.elsewhere / "ro" / "t"],
      1, "Read-only file system", patch=read_only),
    # ---- tokenize -------------------------------------------------------------------------------
    C("tokenize-out-is-a-file", lambda w: ["tokenize", w.data / "docs.jsonl", "-t", w.tok, "-o", w.data / "text.txt"],
      1, "is a file, not a directory"),
    C("tokenize-over-shards", lambda w: ["tokenize", w.data / "docs.jsonl", "-t", w.tok, "-o", w.shards], 1,
      "already holds token shards"),
    C("tokenize-over-a-model", lambda w: ["tokenize", w.data / "docs.jsonl", "-t", w.tok, "-o", w.mlm], 1,
      "already holds a model"),
    C("tokenize-not-utf8", lambda w: ["tokenize", put(w, "latin1.jsonl", b'{"text": "caf\xe9"}\n'), "-t", w.tok,
                                      "-o", w.elsewhere / "s1", "--no-progress"], 1, "not valid UTF-8"),
    C("tokenize-val-fraction", lambda w: ["tokenize", w.data / "docs.jsonl", "-t", w.tok, "-o", w.elsewhere / "s2",
                                          "--val-fraction", "1.5"], 1, "--val-fraction must be within [0, 1)"),
    C("tokenize-no-tokenizer", lambda w: ["tokenize", w.data / "docs.jsonl", "-t", w.root / "notok", "-o",
                                          w.elsewhere / "s3"], 1, "notok"),
    C("tokenize-encoding-errors", lambda w: ["tokenize", w.data / "docs.jsonl", "-t", w.tok, "-o", w.elsewhere / "s4",
                                             "--encoding-errors", "ignore"], 1, "strict or replace"),
    C("tokenize-dtype", lambda w: ["tokenize", w.data / "docs.jsonl", "-t", w.tok, "-o", w.elsewhere / "s5",
                                   "--dtype", "int8"], 1, "int8"),
    C("tokenize-no-documents", lambda w: ["tokenize", put(w, "empty.jsonl", ""), "-t", w.tok, "-o",
                                          w.elsewhere / "s6", "--no-progress"], 1, "no documents"),
    C("tokenize-missing-field", lambda w: ["tokenize", w.data / "docs.jsonl", "-t", w.tok, "-o", w.elsewhere / "s7",
                                           "--text-field", "body", "--no-progress"], 1, "no field 'body'"),
    # ---- train ----------------------------------------------------------------------------------
    C("train-missing-config", lambda w: ["train", "--config", w.data / "nope.toml"], 1, "no such run config file"),
    C("train-toml-syntax", lambda w: ["train", "--config", put(w, "syntax.toml", "[model\npath = 1\n")], 1,
      "not valid TOML"),
    C("train-unknown-key", lambda w: ["train", "--config", run_config(w, "unknown", train={"learning_rate": 1.0})],
      1, "unknown key 'train.learning_rate'"),
    C("train-lr-nan", lambda w: ["train", "--config", run_config(w, "lrnan"), "--set", "train.lr=nan"], 1,
      "train.lr must be a finite number >= 0, got nan"),
    C("train-lr-negative", lambda w: ["train", "--config", run_config(w, "lrneg", train={"lr": -0.1})], 1,
      "train.lr must be a finite number >= 0, got -0.1"),
    C("train-betas", lambda w: ["train", "--config", run_config(w, "betas", train={"betas": [0.9, 1.5]})], 1,
      "betas.toml:15: train.betas.1 must be a finite number >= 0 and < 1, got 1.5"),
    C("train-warmup-past-steps", lambda w: ["train", "--config", run_config(w, "warm", train={"warmup_steps": 9})], 1,
      "train.warmup_steps must be at most train.steps"),
    C("train-epochs-zero", lambda w: ["train", "--config", run_config(w, "ep0", train={"steps": None}), "--set",
                                      "train.epochs=0.0"], 1, "train.epochs must be a finite number > 0"),
    C("train-data-missing", lambda w: ["train", "--config", run_config(w, "nodata",
                                                                       data={"train": w.data / "x.jsonl"})],
      1, "x.jsonl: data file not found"),
    C("train-data-empty", lambda w: ["train", "--config", run_config(w, "empty",
                                                                     data={"train": put(w, "e.jsonl", "")})],
      1, "e.jsonl: no rows"),
    C("train-data-not-utf8-csv", lambda w: ["train", "--config", run_config(
        w, "latin1csv", data={"train": put(w, "latin1.csv", b"text,label\nok,LABEL_0\ncaf\xe9,LABEL_1\n")})], 1,
      "latin1.csv:3 (byte 4 of the line): not valid UTF-8"),
    C("train-data-not-utf8-jsonl", lambda w: ["train", "--config", run_config(
        w, "latin1jsonl", data={"train": put(w, "latin1-rows.jsonl", b'{"text": "caf\xe9", "label": "LABEL_0"}\n')})],
      1, "latin1-rows.jsonl:1: not valid UTF-8"),
    C("train-unknown-label", lambda w: ["train", "--config", run_config(
        w, "labels", data={"train": put(w, "labels.jsonl", jsonl([{"text": "a", "label": "nope"}] * 8))})], 1,
      "nope"),
    C("train-max-length-past-positions", lambda w: ["train", "--config", run_config(w, "maxlen",
                                                                                  data={"max_length": 100})],
      1, "data.max_length 100 is more than the 64 positions"),
    C("train-tokenizer-past-vocab", lambda w: ["train", "--config", run_config(
        w, "bigtok", model={"path": w.bigtok_lm, "task": "causal-lm"},
        data={"train": put(w, "chat-big.jsonl", jsonl(CHAT))})], 1,
      "the tokenizer has 300 tokens but the model's vocab_size is 99"),
    C("train-sft-nothing-to-learn", lambda w: ["train", "--config", sft_config(
        w, "sftuser", [{"messages": [{"role": "user", "content": "hi there"}]}] * 4)], 1,
      "nothing to learn"),
    C("train-sft-replies-cut-off", lambda w: ["train", "--config", sft_config(
        w, "sftcut", [{"messages": [{"role": "user", "content": "hi " * 40}, {"role": "assistant",
                                                                             "content": "hello"}]}] * 4)], 1,
      "nothing to learn"),
    C("train-sft-eval-nothing-to-learn", lambda w: ["train", "--config", sft_config(
        w, "sfteval", CHAT, eval=put(w, "sfteval-eval.jsonl", jsonl([{"messages": [{"role": "user",
                                                                                   "content": "hi"}]}] * 2)))],
      1, "sfteval-eval.jsonl: nothing to learn"),
    C("train-fp16-weights-fp16-precision", lambda w: ["train", "--config", run_config(
        w, "half", model={"path": w.half}, train={"precision": "fp16"})], 1, "needs fp32 weights"),
    C("train-out-dir-holds-a-run", lambda w: ["train", "--config", run_config(w, "again",
                                                                            train={"out_dir": w.run})], 1,
      "already holds a run"),
    C("train-out-dir-holds-a-model", lambda w: ["train", "--config", run_config(w, "intomodel",
                                                                              train={"out_dir": w.mlm})], 1,
      "train.out_dir"),
    C("train-resume-changed-seed", lambda w: ["train", "--config", run_config(w, "seed", train={"seed": 7}),
                                              "--resume", w.run], 1, "train.seed 42 -> 7"),
    C("train-resume-changed-max-length", lambda w: ["train", "--config", run_config(
        w, "ml", data={"max_length": 12}), "--resume", w.run], 1, "data.max_length 16 -> 12"),
    C("train-resume-missing-run", lambda w: ["train", "--config", run_config(w, "norun"), "--resume",
                                             w.root / "nope"], 1, "no such run directory"),
    C("train-pretrain-tampered-shard", lambda w: ["train", "--config", pretrain_config(w, "sha", w.shards_sha)], 1,
      "train-00000.npy: contents do not match the sha256"),
    C("train-pretrain-id-past-vocab", lambda w: ["train", "--config", pretrain_config(w, "ids", w.shards_ids)], 1,
      "holds token id 65000, past the vocabulary"),
    C("train-pretrain-seq-len", lambda w: ["train", "--config", pretrain_config(w, "seq", w.shards, max_length=0)],
      1, "data.max_length"),
    C("train-full-disk", lambda w: ["train", "--config", run_config(w, "full", train={
        "out_dir": w.elsewhere / "full-run"})], 1, "No space left on device", patch=full_disk),
    # ---- plot -----------------------------------------------------------------------------------
    C("plot-no-metrics", lambda w: ["plot", w.mlm], 1, "no metrics.jsonl records to plot"),
    C("plot-bad-suffix", lambda w: ["plot", w.run, "--out", w.elsewhere / "curves.safetensors"], 1,
      "cannot tell an image format"),
    C("plot-out-is-a-dir", lambda w: ["plot", w.run, "--out", w.elsewhere], 1, "is a directory"),
    C("plot-not-a-number", lambda w: ["plot", _metrics(w, "nan-run", '{"step": 1, "loss": "high"}\n'), "--out",
                                      w.elsewhere / "c1.png"], 1, "'loss' is 'high', not a number"),
    C("plot-no-step", lambda w: ["plot", _metrics(w, "nostep-run", '{"loss": 1.0}\n'), "--out",
                                 w.elsewhere / "c2.png"], 1, "without a numeric 'step'"),
    C("plot-rows-without-lr", lambda w: ["plot", _metrics(w, "nolr-run", '{"step": 1, "loss": 2.0}\n'
                                                          '{"step": 2, "loss": 1.5}\n'), "--out",
                                         w.elsewhere / "c3.png"], 0, "c3.png"),
    # ---- launch (a subprocess: torchrun underneath) -------------------------------------------------
    C("launch-nothing", lambda w: ["launch"], 1, "nothing to launch"),
    C("launch-bad-nproc", lambda w: ["launch", "--nproc-per-node", "two", "--", "probe"], 1,
      "--nproc-per-node must be"),
    C("launch-rank-error-once", lambda w: ["launch", "--nproc-per-node", "2", "--", "train", "--config",
                                           run_config(w, "launched", train={"lr": -1.0})], 1,
      "train.lr must be a finite number >= 0", subprocess=True),
]


def _dir(w: World, name: str, files: dict[str, str]) -> Path:
    d = w.data / name
    if not d.exists():
        d.mkdir(parents=True)  # a name with "/" in its brackets is nested folders; the path reads the same
        for f, text in files.items():
            (d / f).write_text(text)
    return d


def _model_copy(w: World, name: str) -> Path:
    d = w.data / name
    if not d.exists():
        shutil.copytree(w.lm, d)
    return d


def _torn(w: World) -> Path:
    d = w.data / "torn"
    if not d.exists():
        d.mkdir()
        (d / "config.json").write_text((w.mlm / "config.json").read_text())
        (d / "model.safetensors").write_bytes((w.mlm / "model.safetensors").read_bytes()[:300])
    return d


def _metrics(w: World, name: str, text: str) -> Path:
    d = w.data / name
    if not d.exists():
        d.mkdir()
        (d / "metrics.jsonl").write_text(text)
    return d


def test_the_table_covers_every_command():
    commands = ("inspect", "export", "verify-export", "verify-matrix", "fill-mask", "classify", "generate", "chat",
                "tokenizer", "tokenize", "train", "plot", "launch")
    assert [c for c in commands if not any(case.id.startswith(c + "-") for case in CASES)] == []
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, w: World, monkeypatch):
    args = [str(a) for a in case.args(w)]
    before = snapshot(w.root)
    if case.patch is not None:
        case.patch(monkeypatch, w)
    if case.subprocess:
        p = kiln_cli(*args)
        code, output = p.returncode, p.stdout + p.stderr
    else:
        r = CliRunner().invoke(app, args)
        code, output = r.exit_code, r.output
        if r.exception is not None and not isinstance(r.exception, SystemExit):
            raise r.exception
    assert code == case.code, output
    assert case.says in " ".join(output.split()), output
    assert "Traceback" not in output, output
    if case.code == 1:
        assert "kiln: " in output, output
    if case.subprocess:  # launch: every rank failed alike; the message is shown once
        assert " ".join(output.split()).count(case.says) == 1, output
    assert snapshot(w.root) == before, "the case changed files under the world's root"
    assert not list(w.elsewhere.glob(".*kiln-tmp*")), "a staging folder was left behind"
