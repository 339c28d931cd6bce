"""Tiny qwen3 SFT runs written as run TOMLs, for the launch and resharding tests (a helper, not a test module).

Packed chat rows of one length: every token counts and no row is padding, so the loss of a global batch
is the same sum over the same tokens however many processes share it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from kiln_cli import REPO

CHATS = [[{"role": "user", "content": f"what is {a} plus {b}?"}, {"role": "assistant", "content": f"{a + b}."}]
         for a in range(6) for b in range(4)]
DENSE = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, eos_token_id=2,
             tie_word_embeddings=False)


def make_data(d: Path) -> Path:
    """The chat JSONL and a BPE tokenizer trained on it, under `d`."""
    from kiln.data.bpe import train_bpe

    data = d / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    train_bpe([data], d / "tok", vocab_size=300, min_frequency=1)
    return d


def write_toml(d: Path, name: str, batch_size: int, parallel: dict, steps: int = 4, save_every: int = 2) -> Path:
    body = (f'[model]\nfamily = "qwen3"\ntask = "causal-lm"\ntokenizer = "{d / "tok"}"\n[model.config]\n'
            + "".join(f"{k} = {json.dumps(v)}\n" for k, v in DENSE.items())
            + f'[data]\ntrain = "{d / "chat.jsonl"}"\nmax_length = 48\npack = true\n'
            + f'[train]\nout_dir = "{d / name}"\nsteps = {steps}\nbatch_size = {batch_size}\nlr = 1e-2\n'
            + f"weight_decay = 0.0\nwarmup_steps = 1\nclip_grad_norm = 1.0\nsave_every = {save_every}\n"
            + "keep_last = 10\nprogress = false\nlog_every = 1\nseed = 5\n"
            + "[parallel]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in parallel.items()))
    path = d / f"{name}.toml"
    path.write_text(body)
    return path


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def popen_kiln(*args: str, env: dict | None = None) -> subprocess.Popen:
    """`kiln ARGS` started in the background (the caller waits), output captured as text."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "kiln.cli.main", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=full_env, cwd=REPO)
