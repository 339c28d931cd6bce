"""The small world the bad-input suite works in: tiny models, a tokenizer, token shards, a finished
run, data files and their broken twins, all under one root so a case can prove it changed nothing.

(A helper module, not a test module; tests/cli/test_bad_inputs.py builds it once per module.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.hub.files import file_sha256
from kiln.interop.tiny import make_tiny

LINES = ["the cat sat on the mat", "a dog runs in the park", "red and blue make purple", "the king and the queen",
         "paris is the capital of france", "london is a big city", "the river runs to the sea", "good day and night"]


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def ok(*args: str):
    r = invoke(*args)
    assert r.exit_code == 0, (args, r.output)
    return r


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (str, Path)):
        return json.dumps(str(v))
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(v)


def write_toml(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"[{name}]\n" + "".join(f"{k} = {toml_value(v)}\n" for k, v in body.items()
                                                      if v is not None) + "\n"
                            for name, body in sections.items()))
    return path


def flip_byte(path: Path, offset_from_end: int = 5) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def snapshot(root: Path) -> dict[str, tuple[str, int] | None]:
    """Every file under `root` (sha256, mtime in ns) and every folder (None): what a case must leave as it was."""
    out: dict[str, tuple[str, int] | None] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = None
        for f in filenames:
            p = os.path.join(dirpath, f)
            out[os.path.relpath(p, root)] = (hashlib.sha256(Path(p).read_bytes()).hexdigest(), os.stat(p).st_mtime_ns)
    return out


@dataclass
class World:
    root: Path        # everything a case may touch lives here
    elsewhere: Path   # where successful cases write their output (not watched)
    mlm: Path         # tiny BERT masked LM (+ WordPiece tokenizer)
    cls: Path         # tiny BERT sequence classifier, labels LABEL_0..2
    lm: Path          # tiny Qwen3 causal LM, vocab 99, no chat template
    layers: Path      # mlm with num_hidden_layers 1 over 2-layer weights
    extra: Path       # mlm plus a tensor no module has
    half: Path        # cls with its weights stored in float16
    tok: Path         # byte-level BPE tokenizer (vocab ~300, ChatML template), trained by kiln
    chat_lm: Path     # tiny Qwen3 with that tokenizer
    bigtok_lm: Path   # lm (vocab 99) with the 300-token tokenizer
    shards: Path      # `kiln tokenize` of docs.jsonl with tok
    shards_sha: Path  # shards with one byte of a shard flipped (size and header intact)
    shards_ids: Path  # shards with an id past the vocabulary, checksums updated to match
    run: Path         # a finished 2-step fine-tune run of cls (ckpt-000001, ckpt-000002)
    run_tampered: Path
    run_partial: Path
    data: Path        # data files


def build_world(root: Path, elsewhere: Path, tiny_factory) -> World:
    def copy(src: Path, name: str) -> Path:
        return Path(shutil.copytree(src, root / name))

    mlm = copy(tiny_factory("bert", "masked-lm"), "mlm")
    cls = copy(tiny_factory("bert", "sequence-classification"), "cls")
    lm = copy(tiny_factory("qwen3", "causal-lm"), "lm")
    layers = copy(mlm, "layers")
    cfg = json.loads((layers / "config.json").read_text())
    (layers / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    extra = copy(mlm, "extra")
    state = load_file(str(extra / "model.safetensors"))
    state["bert.encoder.extra.weight"] = torch.zeros(3)
    save_file(state, str(extra / "model.safetensors"), metadata={"format": "pt"})
    half = copy(cls, "half")
    state = load_file(str(half / "model.safetensors"))
    save_file({k: v.half() for k, v in state.items()}, str(half / "model.safetensors"), metadata={"format": "pt"})

    data = root / "data"
    data.mkdir()
    (data / "text.txt").write_text("\n".join(LINES * 4) + "\n")
    (data / "docs.jsonl").write_text("".join(json.dumps({"text": f"{line} {i}"}) + "\n"
                                             for i, line in enumerate(LINES * 5)))
    tok = root / "tok"
    ok("tokenizer", "train", data / "text.txt", "--out", tok, "--vocab-size", "300", "--min-frequency", "1")
    chat_lm = make_tiny("qwen3", "causal-lm", root / "chat_lm", tokenizer=False, vocab_size=300, eos_token_id=2,
                        pad_token_id=0)
    bigtok_lm = copy(lm, "bigtok_lm")
    for f in tok.iterdir():
        shutil.copy(f, chat_lm / f.name)
        shutil.copy(f, bigtok_lm / f.name)

    shards = root / "shards"
    ok("tokenize", data / "docs.jsonl", "--tokenizer", tok, "--out", shards, "--val-fraction", "0.25",
       "--eos", "<|endoftext|>", "--no-progress")
    shards_sha = copy(shards, "shards_sha")
    flip_byte(shards_sha / "train-00000.npy")
    shards_ids = copy(shards, "shards_ids")
    ids = np.load(shards_ids / "train-00000.npy")
    ids[3] = 65000
    np.save(shards_ids / "train-00000.npy", ids)
    manifest = json.loads((shards_ids / "manifest.json").read_text())
    for entry in manifest["splits"]["train"]["shards"]:
        if entry["file"] == "train-00000.npy":
            entry["sha256"] = file_sha256(shards_ids / "train-00000.npy")
    (shards_ids / "manifest.json").write_text(json.dumps(manifest))

    rows = [{"text": line, "label": f"LABEL_{i % 3}"} for i, line in enumerate(LINES * 2)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_cfg = write_toml(data / "run.toml", {
        "model": {"path": cls, "task": "sequence-classification"},
        "data": {"train": data / "train.jsonl", "max_length": 16},
        "train": {"out_dir": root / "run", "steps": 2, "batch_size": 4, "save_every": 1, "lr": 1e-3,
                  "progress": False, "device": "cpu"}})
    ok("train", "--config", run_cfg)
    run = root / "run"
    run_tampered = copy(run, "run_tampered")
    flip_byte(run_tampered / "ckpt-000002" / "model" / "model.safetensors")
    run_partial = copy(run, "run_partial")
    (run_partial / "ckpt-000002" / "manifest.json").unlink()
    return World(root, elsewhere, mlm, cls, lm, layers, extra, half, tok, chat_lm, bigtok_lm, shards, shards_sha,
                 shards_ids, run, run_tampered, run_partial, data)
