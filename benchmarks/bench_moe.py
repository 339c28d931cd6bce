"""MoE block forward + backward: kiln's qwen3_moe block vs transformers' Qwen3MoeSparseMoeBlock, CPU.

64 experts, top-8, hidden 512, expert width 256, 2 x 512 tokens; the same weights and inputs on both
sides. Both route the (token, slot) pairs sorted by expert through grouped matmuls: transformers 5's
default experts path is the same `grouped_mm` kernel kiln's exact path uses. kiln runs its fast path,
as `kiln train` does (`set_fast`: the routed experts as one autograd node, moe_fast.py; max abs diff
of its outputs printed); its exact path (bit-identical) is timed in the same rounds, for reference.
transformers' per-expert loop (its "eager" experts implementation, the 4.x default) is timed too (one
step on fewer tokens: it takes minutes at full size). Rounds interleave in one process, who goes
first rotating; the ratio against transformers' default path is last.

    python benchmarks/bench_moe.py [--tokens 1024] [--rounds 4]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, report, setup_torch

HIDDEN, EXPERT, EXPERTS, TOP_K = 512, 256, 64, 8


def blocks():
    import torch
    import transformers

    from kiln.models.common.fast import set_fast
    from kiln.models.common.moe import MoEBlock

    transformers.logging.set_verbosity_error()
    cfg = dict(hidden_size=HIDDEN, moe_intermediate_size=EXPERT, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
               norm_topk_prob=True, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=4,
               vocab_size=128, intermediate_size=1024)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg)).model.layers[0].mlp
    for p in hf.parameters():
        torch.nn.init.normal_(p, 0.0, 0.02)
    eager = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**cfg, experts_implementation="eager")
                                             ).model.layers[0].mlp
    eager.load_state_dict(hf.state_dict())
    ours, exact = MoEBlock(HIDDEN, EXPERT, EXPERTS, TOP_K, True), MoEBlock(HIDDEN, EXPERT, EXPERTS, TOP_K, True)
    for block in (ours, exact):
        with torch.no_grad():
            block.gate.weight.copy_(hf.gate.weight)
            block.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
            block.experts.down_proj.copy_(hf.experts.down_proj)
    return set_fast(ours), exact, hf, eager


def step(block, x, cpu: list[float] | None = None) -> float:
    """One forward + backward; returns the wall time and appends the process CPU time to `cpu`."""
    x = x.clone().requires_grad_()
    t, c = time.perf_counter(), time.process_time()
    y = block(x)
    y = y[0] if isinstance(y, tuple) else y
    y.square().mean().backward()
    block.zero_grad(set_to_none=True)
    if cpu is not None:
        cpu.append(time.process_time() - c)
    return time.perf_counter() - t


def main() -> None:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--eager-tokens", type=int, default=128)
    a = ap.parse_args()
    setup_torch()
    ours, exact, hf, eager = blocks()
    x = torch.randn(2, a.tokens // 2, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = (lambda y: y[0] if isinstance(y, tuple) else y)(hf(x))
        diff, exact_diff = float((ours(x) - want).abs().max()), float((exact(x) - want).abs().max())
    sides = [("hf", hf), ("kiln", ours), ("exact", exact)]
    for _, b in sides:  # warm-up: first calls pay allocation and dispatch set-up
        step(b, x)
    times: dict[str, list[float]] = {name: [] for name, _ in sides}
    cpu: dict[str, list[float]] = {name: [] for name, _ in sides}  # steadier than wall time on a shared machine
    for r in range(a.rounds):
        for name, b in sides[r % 3:] + sides[:r % 3]:  # who goes first rotates
            times[name].append(step(b, x, cpu[name]))
    rate = {k: [a.tokens / t for t in v] for k, v in times.items()}
    small = x[:, : a.eager_tokens // 2]  # the per-expert loop takes minutes at full size: one step on fewer tokens
    step(eager, small)
    rate["eager"] = [small.shape[0] * small.shape[1] / step(eager, small)]
    print(f"{EXPERTS} experts top-{TOP_K}, hidden {HIDDEN}, expert width {EXPERT}, {a.tokens} tokens; {machine()}; "
          f"max abs diff of outputs vs transformers: kiln fast {diff:.2e}, kiln exact {exact_diff:.2e}")
    exact_ratio = max(rate["exact"]) / max(rate["hf"])
    by_cpu = {k: min(cpu["hf"]) / min(v) for k, v in cpu.items()}
    print(f"kiln exact path (bit-identical): {max(rate['exact']):.0f} tokens/s; kiln exact/transformers {exact_ratio:.3f}")
    print("process CPU time per step (min): " + ", ".join(f"{k} {min(v) * 1e3:.1f} ms" for k, v in cpu.items())
          + f"; ratio by CPU time kiln fast/transformers {by_cpu['kiln']:.3f}, kiln exact/transformers "
          f"{by_cpu['exact']:.3f}")
    print(f"transformers eager experts (per-expert loop, {a.eager_tokens} tokens): {max(rate['eager']):.0f} tokens/s; "
          f"kiln/eager {max(rate['kiln']) / max(rate['eager']):.2f}x")
    flops = 3 * 2 * TOP_K * (HIDDEN * 2 * EXPERT + EXPERT * HIDDEN) + 3 * 2 * HIDDEN * EXPERTS  # experts + router
    report("MoE block fwd+bwd (64 experts, top-8)", "transformers qwen3_moe", "tokens/s", rate["kiln"], rate["hf"],
           flops_per_unit=flops, goal=">= 2x",
           note=f"kiln fast path (exact path {exact_ratio:.2f}x, bit-identical); by process CPU time "
                f"{by_cpu['kiln']:.2f}x (exact {by_cpu['exact']:.2f}x); kiln/transformers eager "
                f"(per-expert loop, {a.eager_tokens} tokens) {max(rate['kiln']) / max(rate['eager']):.0f}x")


if __name__ == "__main__":
    main()
