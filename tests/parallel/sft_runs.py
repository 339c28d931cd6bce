"""Tiny qwen3 SFT runs written as run TOMLs, for the launch and resharding tests (a helper, not a test module).

Packed chat rows of one length: every token counts and no row is padding, so the loss of a global batch
is the same sum over the same tokens however many processes share it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.kiln_cli import REPO, kiln_cli

CHATS = [[{"role": "user", "content": f"what is {a} plus {b}?"}, {"role": "assistant", "content": f"{a + b}."}]
         for a in range(6) for b in range(4)]
DENSE = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, eos_token_id=2,
             tie_word_embeddings=False)


def make_data(d: Path, chats: list = CHATS, held_out: list | None = None) -> Path:
    """The chat JSONL (and an eval JSONL of `held_out`) and a BPE tokenizer trained on it, under `d`."""
    from kiln.data.bpe import train_bpe

    data = d / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    if held_out is not None:
        (d / "eval.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in held_out))
    train_bpe([data], d / "tok", vocab_size=300, min_frequency=1)
    return d


def _value(v) -> str:
    """A TOML value: inline tables for dicts, JSON's spelling for the rest (the two agree there)."""
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + " }"
    return json.dumps(v)


def _table(name: str, keys: dict) -> str:
    return f"[{name}]\n" + "".join(f"{k} = {_value(v)}\n" for k, v in keys.items())


def run_toml(d: Path, name: str, parallel: dict, *, family: str = "qwen3", config: dict = DENSE,
             data: dict | None = None, train: dict | None = None) -> Path:
    """`d/name.toml`: a from-config SFT run on `make_data(d)`'s chats writing to `d/name`; `data` and `train`
    keys override the defaults here (4 steps of 4 rows, a checkpoint every 2)."""
    data = {"train": str(d / "chat.jsonl"), "max_length": 48, "pack": True, **(data or {})}
    train = {"out_dir": str(d / name), "steps": 4, "batch_size": 4, "lr": 1e-2, "weight_decay": 0.0,
             "warmup_steps": 1, "clip_grad_norm": 1.0, "save_every": 2, "keep_last": 10, "progress": False,
             "log_every": 1, "seed": 5, **(train or {})}
    body = (_table("model", {"family": family, "task": "causal-lm", "tokenizer": str(d / "tok")})
            + _table("model.config", config) + _table("data", data) + _table("train", train)
            + _table("parallel", parallel))
    path = d / f"{name}.toml"
    path.write_text(body)
    return path


def write_toml(d: Path, name: str, batch_size: int, parallel: dict, steps: int = 4, save_every: int = 2) -> Path:
    return run_toml(d, name, parallel, train={"batch_size": batch_size, "steps": steps, "save_every": save_every})


def launch(cfg: Path, *extra: str, env: dict | None = None, nproc: int = 2):
    """`kiln launch --nproc-per-node N -- train --config CFG EXTRA`, waited for."""
    return kiln_cli("launch", "--nproc-per-node", str(nproc), "--", "train", "--config", str(cfg), *extra, env=env)


def losses(run: Path) -> list[float]:
    """The loss of every step record so far ([] while the file is missing or a line is half written)."""
    try:
        return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    except (OSError, ValueError):
        return []


def weights(ckpt: Path, tmp: Path) -> dict:
    """HF-named weights of a checkpoint, gathered from DCP shards (into `tmp`) when it is sharded."""
    from kiln.hub import load_weights
    from kiln.parallel.checkpoint import export_sharded, is_sharded

    if is_sharded(ckpt):
        return load_weights(export_sharded(ckpt, tmp / f"gathered-{ckpt.parent.name}-{ckpt.name}"))
    return load_weights(ckpt / "model")


def popen_kiln(*args: str, env: dict | None = None) -> subprocess.Popen:
    """`kiln ARGS` started in the background (the caller waits), output captured as text."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "kiln.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=full_env, cwd=REPO)
