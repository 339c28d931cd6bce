"""Gated DeltaNet layer forward+backward on CPU: kiln's fast chunked rule vs transformers' PyTorch fallback.

transformers' Qwen3_5GatedDeltaNet (no flash-linear-attention / causal-conv1d installed, so it runs
`torch_chunk_gated_delta_rule` and `causal_conv1d_fn`) and kiln's GatedDeltaNet with the same weights and
`fast_delta_rule = True` run out.sum().backward() on the same input at each length. Both are warmed up
first, then timed in interleaved rounds (machine noise hits both); min and median per side are printed,
with the largest relative gradient difference (the fast rule must agree to ~1e-5). The delta rule alone
(after projections and conv), the causal conv + SiLU and the gated output norm are timed the same way.
kiln/transformers ratios (> 1 = kiln faster) come last.

The default heads are Qwen3.5's shape at a small width: heads of 128 (every released Qwen3-Next / Qwen3.5
model), twice as many value heads as q/k heads, q/k width = hidden, value width = 2 x hidden.

    python benchmarks/bench_gated_deltanet.py [--seqs 1024,4096] [--hidden 256] [--k-heads 2] [--v-heads 4]
                                              [--head-dim 128] [--batch 1] [--rounds 5] [--threads N]

Run by hand (not in `make bench`): one layer, not a workload; the table's Qwen3.5 row (bench_qwen35_sft.py)
times the same rule inside a training step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5

from kiln.models.common import delta_rule
from kiln.models.common.hybrid import GatedDeltaNet, tap_conv


def fwd_bwd(layer, x: torch.Tensor) -> float:
    layer.zero_grad(set_to_none=True)
    x.grad = None
    t0 = time.perf_counter()
    layer(x).sum().backward()
    return time.perf_counter() - t0


def rule_fwd_bwd(fn, inputs) -> float:
    for t in inputs:
        t.grad = None
    t0 = time.perf_counter()
    fn(*inputs)[0].sum().backward()
    return time.perf_counter() - t0


def grad_rel_diff(ours: torch.nn.Module, theirs: torch.nn.Module) -> float:
    other = dict(theirs.named_parameters())
    return max(((p.grad - other[n].grad).abs().max() / other[n].grad.abs().max().clamp(min=1e-30)).item()
               for n, p in ours.named_parameters())


def timed(name: str, runs: dict[str, callable], rounds: int) -> dict[str, list[float]]:
    for run in runs.values():  # warm-up: allocator, kernels, the first-call costs of both sides
        run()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for k, run in runs.items():
            times[k].append(run())
    for k, ts in times.items():
        print(f"  {name:5s} {k:12s} min {min(ts) * 1e3:9.1f} ms   median {statistics.median(ts) * 1e3:9.1f} ms")
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="1024,4096")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--k-heads", type=int, default=2)
    ap.add_argument("--v-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    cfg = transformers.Qwen3_5TextConfig(hidden_size=args.hidden, linear_num_key_heads=args.k_heads,
                                         linear_num_value_heads=args.v_heads, linear_key_head_dim=args.head_dim,
                                         linear_value_head_dim=args.head_dim, num_hidden_layers=1,
                                         layer_types=["linear_attention"])
    torch.manual_seed(0)
    theirs = hf_qwen3_5.Qwen3_5GatedDeltaNet(cfg, 0).train()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0.0, 0.2)
    ours = GatedDeltaNet(args.hidden, args.k_heads, args.v_heads, args.head_dim, args.head_dim,
                         cfg.linear_conv_kernel_dim, 0, cfg.hidden_act, cfg.rms_norm_eps)
    ours.load_state_dict(theirs.state_dict())
    delta_rule.set_fast(ours)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, hidden {args.hidden}, "
          f"heads {args.k_heads} q/k x {args.v_heads} v of dim {args.head_dim}, batch {args.batch}")
    layer_ratio, rule_ratio, part_ratio = {}, {}, {}
    for T in (int(s) for s in args.seqs.split(",")):
        g = torch.Generator().manual_seed(T)
        x = torch.randn(args.batch, T, args.hidden, generator=g).requires_grad_()
        print(f"T={T}")
        t = timed("layer", {"kiln fast": lambda: fwd_bwd(ours, x), "transformers": lambda: fwd_bwd(theirs, x)},
                  args.rounds)
        fwd_bwd(ours, x)
        fwd_bwd(theirs, x)
        print(f"  max grad rel diff {grad_rel_diff(ours, theirs):.1e}")
        layer_ratio[T] = (min(t["transformers"]) / min(t["kiln fast"]),
                          statistics.median(t["transformers"]) / statistics.median(t["kiln fast"]))
        H, D, Hk = args.v_heads, args.head_dim, args.k_heads
        q, k = (torch.randn(args.batch, T, Hk, D, generator=g).requires_grad_() for _ in range(2))
        v = torch.randn(args.batch, T, H, D, generator=g).requires_grad_()
        decay = (-torch.rand(args.batch, T, H, generator=g)).requires_grad_()
        beta = torch.rand(args.batch, T, H, generator=g).requires_grad_()
        rule_in = (q, k, v, decay, beta)

        def hf_rule(*a):
            return hf_qwen3_5.torch_chunk_gated_delta_rule(*a[:3], g=a[3], beta=a[4], use_qk_l2norm_in_kernel=True)

        t = timed("rule", {"kiln fast": lambda: rule_fwd_bwd(delta_rule.chunk_fast, rule_in),
                           "transformers": lambda: rule_fwd_bwd(hf_rule, rule_in)}, args.rounds)
        rule_ratio[T] = (min(t["transformers"]) / min(t["kiln fast"]),
                         statistics.median(t["transformers"]) / statistics.median(t["kiln fast"]))
        # the non-rule parts that differ (the projections are the same Linears on both sides)
        mixed = torch.randn(args.batch, T, ours.conv1d.weight.shape[0], generator=g).requires_grad_()
        w = ours.conv1d.weight

        def hf_conv(x, w=w):
            return hf_qwen3_5.causal_conv1d_fn(x.transpose(1, 2), w.squeeze(1), None, activation="silu").transpose(1, 2)

        t = timed("conv", {"kiln fast": lambda: rule_fwd_bwd(lambda x: (tap_conv(x, w, None, ours.act),), [mixed]),
                           "transformers": lambda: rule_fwd_bwd(lambda x: (hf_conv(x),), [mixed])}, args.rounds)
        part_ratio.setdefault("conv", {})[T] = min(t["transformers"]) / min(t["kiln fast"])
        o, z = (torch.randn(args.batch * T * H, D, generator=g).requires_grad_() for _ in range(2))
        t = timed("norm", {"kiln fast": lambda: rule_fwd_bwd(lambda *a: (ours.norm(*a),), [o, z]),
                           "transformers": lambda: rule_fwd_bwd(lambda *a: (theirs.norm(*a),), [o, z])}, args.rounds)
        part_ratio.setdefault("norm", {})[T] = min(t["transformers"]) / min(t["kiln fast"])
    print("kiln/transformers speed, Gated DeltaNet layer fwd+bwd (min, median): "
          + "  ".join(f"T={T}: {a:.2f}x, {b:.2f}x" for T, (a, b) in layer_ratio.items()))
    print("kiln/transformers speed (min), causal conv + SiLU: " + "  ".join(
        f"T={T}: {r:.2f}x" for T, r in part_ratio["conv"].items()) + ";  gated output norm: " + "  ".join(
        f"T={T}: {r:.2f}x" for T, r in part_ratio["norm"].items()))
    print("kiln/transformers speed, gated delta rule alone fwd+bwd (min, median): "
          + "  ".join(f"T={T}: {a:.2f}x, {b:.2f}x" for T, (a, b) in rule_ratio.items()))


if __name__ == "__main__":
    main()
