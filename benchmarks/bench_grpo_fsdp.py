"""GRPO's rollout under FSDP2, two gloo processes on the CPU: the generation engine on the gathered weights (kiln's
rollouts, kiln.train.grpo_engine) against kiln's earlier loop on the sharded model (benchmarks/old_loop.py: every
forward all-gathers each layer, so every rank decodes all max_new_tokens in lockstep).

Run by hand (not in `make bench`): it needs two processes joined in a process group, and on a machine of a few
cores the two ranks share them, so its figure is the ratio of the two sides in the same run, not a throughput.

Each rank rolls out its own PROMPTS prompts x GENERATIONS completions of --new-tokens tokens (EOS off: every
completion runs to length), at temperature 1; the sides alternate for --rounds rounds and each keeps its best
(the slowest rank's time, a rollout ends when both ranks are done). The model: Qwen3 layout, hidden 256,
4 layers, vocabulary 8,192, random weights, fp32. The engine's time includes the whole model's all-gather and
its release.

    python benchmarks/bench_grpo_fsdp.py [--rounds 3] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import load_average

PROMPTS, GENERATIONS = 2, 4
SIZE = dict(vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, head_dim=32, max_position_embeddings=512, tie_word_embeddings=False,
            pad_token_id=0, eos_token_id=2)


def rank_main(rank: int, world: int, out: str, rounds: int, new_tokens: int) -> None:
    import torch
    import torch.distributed as dist
    from old_loop import generate
    from torch.distributed.device_mesh import init_device_mesh

    import kiln.engine  # noqa: F401
    from kiln.models.auto import AutoConfig, from_config
    from kiln.parallel.fsdp import apply_fsdp
    from kiln.train.grpo_engine import EngineRollouts

    model = from_config(AutoConfig.for_model("qwen3", **SIZE), task="causal-lm", seed=0)
    apply_fsdp(model, init_device_mesh("cpu", (world,)))
    g = type("G", (), dict(top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1.0, temperature=1.0))
    rng = torch.Generator().manual_seed(rank)
    prompts = [torch.randint(3, SIZE["vocab_size"], (24,), generator=rng).tolist() for _ in range(PROMPTS)]
    rollouts = EngineRollouts(g)

    def engine() -> None:
        rollouts.run(model, prompts, [new_tokens] * PROMPTS, GENERATIONS, torch.Generator().manual_seed(1), [])

    def loop() -> None:
        ids = torch.tensor(prompts).repeat_interleave(GENERATIONS, 0)
        generate(model, ids, max_new_tokens=new_tokens, do_sample=True, eos_token_id=[], pad_token_id=0,
                 draw=lambda logits: torch.multinomial(logits.softmax(-1), 1, generator=rng).squeeze(1))

    best = {"engine": float("inf"), "loop": float("inf")}
    with torch.no_grad():
        for r in range(rounds + 1):  # round 0 warms up
            for name, fn in (("engine", engine), ("loop", loop)):
                dist.barrier()
                t = time.perf_counter()
                fn()
                took = torch.tensor([time.perf_counter() - t])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the rollout ends with its slowest rank
                if r:
                    best[name] = min(best[name], float(took))
    if rank == 0:
        Path(out).write_text(json.dumps(best))


def main() -> None:
    from tests.spawn import spawn

    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "best.json")
        spawn(rank_main, 2, (out, a.rounds, a.new_tokens), preload=("torch", "kiln.parallel.apply"))
        best = json.loads(Path(out).read_text())
    print(f"GRPO rollout under FSDP2, 2 gloo ranks, {PROMPTS} prompts x {GENERATIONS} generations x "
          f"{a.new_tokens} tokens a rank; {load_average()}")
    print(f"earlier loop on the sharded model {best['loop']:.2f} s, engine on the gathered weights "
          f"{best['engine']:.2f} s; engine / loop speed {best['loop'] / best['engine']:.2f}x")


if __name__ == "__main__":
    main()
