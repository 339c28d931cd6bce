"""Token-stream loader throughput (tokens/s): kiln's StreamLoader with 0 and 2 DataLoader workers,
against a nanoGPT-style `get_batch` (a fresh np.memmap per batch, random offsets, torch.stack) on
the same shards, and against the rate at which the pretrain_bbc example model consumes tokens
(forward + backward + AdamW step). Ratios are printed last; loader/model > 1 means the model,
not the data, sets the pace.

    .venv/bin/python benchmarks/bench_stream.py [--seq-len 64 --batch-size 8 --batches 1500]

The shards are synthetic (random ids of a 2,048-token vocabulary in documents of 50-800 tokens,
16 shards, 4M tokens), written once to a temp directory.

Run by hand (not in `make bench`): it measures the data loader alone against the model's consumption, not a
kiln-vs-peer workload of the results table.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kiln.data.shards import ShardSet, ShardWriter, write_manifest
from kiln.data.stream import StreamLoader, Windows

VOCAB, EOS = 2048, 0


def make_shards(root: Path, tokens: int = 4_000_000, shards: int = 16, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    w = ShardWriter(root, "train", "uint16", shard_tokens=tokens // shards)
    written = 0
    while written < tokens:
        doc = rng.integers(1, VOCAB, int(rng.integers(50, 800)), dtype=np.int64)
        w.add(np.append(doc, EOS))
        written += doc.size + 1
    write_manifest(root, {"dtype": "uint16", "vocab_size": VOCAB, "eos_id": EOS, "eos_token": "<eos>",
                          "tokenizer": {"source": "synthetic", "sha256": "0" * 64, "vocab_size": VOCAB},
                          "splits": {"train": w.summary()}, "documents": 0})
    return root


def kiln_rate(shards: ShardSet, T: int, B: int, n: int, workers: int, within_doc: bool = False) -> float:
    loader = StreamLoader(Windows(shards, T, within_doc=within_doc), B, rank=0, world_size=1, num_workers=workers,
                          prefetch=4)
    for _ in range(20):  # workers started and warm
        loader.next_batch()
    t0 = time.perf_counter()
    for _ in range(n):
        batch = loader.next_batch()
    dt = time.perf_counter() - t0
    assert batch["input_ids"].shape == (B, T)
    loader.close()
    return n * B * T / dt


def nanogpt_rate(shards: ShardSet, T: int, B: int, n: int) -> float:
    """nanoGPT's train.py get_batch, over our shards: a random shard, random offsets, x and y stacked."""
    rng = torch.Generator().manual_seed(0)
    offsets = [np.load(p, mmap_mode="r").offset for p in shards.paths]

    def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
        s = int(torch.randint(len(shards.paths), (1,), generator=rng))
        data = np.memmap(shards.paths[s], dtype=np.uint16, mode="r", offset=offsets[s])  # re-opened per batch, as nanoGPT does
        ix = torch.randint(len(data) - T, (B,), generator=rng)
        x = torch.stack([torch.from_numpy(data[i:i + T].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + T].astype(np.int64)) for i in ix])
        return x, y

    for _ in range(20):
        get_batch()
    t0 = time.perf_counter()
    for _ in range(n):
        x, _ = get_batch()
    dt = time.perf_counter() - t0
    assert x.shape == (B, T)
    return n * B * T / dt


def model_rate(T: int, B: int, steps: int = 12) -> float:
    """Tokens/s the examples/pretrain_bbc model trains at (its config, fp32, this machine's CPU threads)."""
    from kiln.models.auto import AutoConfig, from_config
    from kiln.train.recipes.pretrain import lm_step

    cfg = AutoConfig.for_model("qwen3", vocab_size=VOCAB, hidden_size=96, intermediate_size=256, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=256,
                               tie_word_embeddings=True)
    model = from_config(cfg, task="causal-lm", seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(1, VOCAB, (B, T + 1))
    batch = {"input_ids": x[:, :-1], "targets": x[:, 1:]}
    for i in range(steps + 3):
        if i == 3:
            t0 = time.perf_counter()
        loss_sum, count = lm_step(model, batch)
        (loss_sum / count).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return steps * B * T / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--batches", type=int, default=1500)
    a = ap.parse_args()
    T, B, n = a.seq_len, a.batch_size, a.batches
    with tempfile.TemporaryDirectory() as tmp:
        shards = ShardSet(make_shards(Path(tmp) / "shards"), "train")
        rates = {"nanogpt get_batch": nanogpt_rate(shards, T, B, n),
                 "kiln stream, 0 workers": kiln_rate(shards, T, B, n, 0),
                 "kiln stream, 2 workers": kiln_rate(shards, T, B, n, 2),
                 "kiln stream, 2 workers, doc positions": kiln_rate(shards, T, B, n, 2, within_doc=True),
                 "example model (fwd+bwd+AdamW)": model_rate(T, B)}
    print(f"seq_len {T}, batch {B}, {n} batches per loader, torch threads {torch.get_num_threads()}")
    for name, r in rates.items():
        print(f"  {name:40s} {r:>14,.0f} tokens/s")
    nano, model = rates["nanogpt get_batch"], rates["example model (fwd+bwd+AdamW)"]
    print("ratios:")
    print(f"  kiln 0 workers / nanogpt get_batch    {rates['kiln stream, 0 workers'] / nano:6.2f}")
    print(f"  kiln 2 workers / nanogpt get_batch    {rates['kiln stream, 2 workers'] / nano:6.2f}")
    print(f"  kiln 2 workers / example model        {rates['kiln stream, 2 workers'] / model:6.2f}")


if __name__ == "__main__":
    main()
