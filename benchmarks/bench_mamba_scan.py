"""Mamba forward+backward on CPU: kiln's fast scan vs transformers' PyTorch path (no CUDA kernels).

One random MambaForCausalLM (small d_model so the longest run stays within minutes on 2 cores) is
built by transformers, loaded by kiln with `scan="fast"`, and both run loss.backward() on the same
tokens at each sequence length, rep by rep interleaved so machine noise hits both. The gradients
are compared too (the fast scan must agree to ~1e-5). Prints kiln/transformers speed ratios last
(> 1.0 means kiln is faster). Both sides are warmed up at every length before timing; sequences
past 1024 (not run by default) get one rep: transformers' loop is slow there.

    python benchmarks/bench_mamba_scan.py [--seqs 256,1024,4096] [--hidden 32] [--layers 2] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import setup_torch

from kiln.models import load_pretrained


def fwd_bwd(model, ids: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    return time.perf_counter() - t0


def grad_rel_diff(kiln_model, hf_model) -> float:
    """Largest |g_kiln - g_hf| / max|g_hf| over the embedding and every layer's in_proj/A_log."""
    hf = dict(hf_model.named_parameters())
    worst = 0.0
    for name, p in kiln_model.named_parameters():
        q = hf["backbone." + name[len("model."):]]
        worst = max(worst, ((p.grad - q.grad).abs().max() / q.grad.abs().max().clamp(min=1e-30)).item())
    return worst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="256,1024")
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--state", type=int, default=16)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    setup_torch()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    cfg = transformers.MambaConfig(vocab_size=256, hidden_size=args.hidden, state_size=args.state,
                                   num_hidden_layers=args.layers)
    torch.manual_seed(0)
    hf = transformers.MambaForCausalLM(cfg).train()
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        kiln = load_pretrained(tmp, scan="fast").train()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, hidden {args.hidden}, "
          f"state {args.state}, layers {args.layers}, batch {args.batch}")
    ratios = {}
    for T in (int(s) for s in args.seqs.split(",")):
        ids = torch.randint(0, cfg.vocab_size, (args.batch, T), generator=torch.Generator().manual_seed(T))
        # Warm-up of both sides at this length, untimed: the first call at a new shape pays allocator growth and
        # kernel set-up (kiln's first T=256 row once carried it and printed 0.39x).
        fwd_bwd(kiln, ids), fwd_bwd(hf, ids)
        times = {"kiln": [], "hf": []}
        for _ in range(args.reps if T <= 1024 else 1):  # transformers takes minutes at 4096: one rep there
            times["hf"].append(fwd_bwd(hf, ids))
            times["kiln"].append(fwd_bwd(kiln, ids))
        diff = grad_rel_diff(kiln, hf)  # both hold the gradients of the last rep, same tokens
        k, h = min(times["kiln"]), min(times["hf"])
        ratios[T] = h / k
        print(f"T={T:5d}  kiln fast {k * 1e3:9.1f} ms (median {statistics.median(times['kiln']) * 1e3:.1f})   "
              f"transformers {h * 1e3:9.1f} ms (median {statistics.median(times['hf']) * 1e3:.1f})   "
              f"max grad rel diff {diff:.1e}")
    print("kiln/transformers speed (fwd+bwd, best rep): " + "  ".join(f"T={T}: {r:.2f}x" for T, r in ratios.items()))


if __name__ == "__main__":
    main()
