"""QLoRA SFT of a ~1B Qwen3-shaped model through `kiln train` vs transformers + peft + bitsandbytes, CPU.

The model: Qwen3 layout with the real Qwen3 vocabulary size (151,936), hidden 2048, 16 layers, MLP 6144,
16 heads over 8 KV heads of 128, tied embeddings (1.18B parameters), random weights built by
transformers in bf16 and saved once; then written as an NF4 bitsandbytes-4bit directory (double-quantized
absmax, compute dtype bf16) by `kiln export --quantize nf4`, which both sides load as it is (the bytes
are bitsandbytes' own, tests/interop/test_qlora_load.py). The data and its tokenizer are
bench_lora_sft.py's (BBC chat rows, <= 512 tokens, loss on the reply). LoRA r=16, alpha=32 on all seven
projections, float32 adapters on both sides, batch 2, AdamW lr 1e-4.

kiln runs what `kiln train --config run.toml` runs on the 4-bit directory; the peer loads it with
transformers (bitsandbytes' Linear4bit), wraps it with peft and steps the same padded batches
torch.optim.AdamW would (bench_lora_sft.run_peer). A third run, kiln's own bf16 LoRA on the bf16
directory, gives the memory the 4-bit base saves. Each run in its own process; rounds interleave;
tokens/s counts real (unpadded) tokens; peak memory is the RSS peak above the process's start. Ratios last.

    python benchmarks/bench_qlora.py [--small] [--steps 2] [--warmup 1] [--rounds 2]

`--small` (hidden 256, 2 layers) checks the script end to end in a minute.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_lora_sft as sft
from common import report, run_child

FULL = dict(sft.SIZE, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128)
SMALL = dict(sft.SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)


def prepare(tmp: Path, size: dict) -> None:
    """tmp/bf16 and tmp/nf4, each with bench_lora_sft's layout (chats.jsonl, model/ with the tokenizer):
    the bf16 model directory and its NF4 directory."""
    import shutil

    import torch
    import transformers

    from kiln.interop.export import export_model

    (tmp / "bf16").mkdir()
    sft.prepare_data(tmp / "bf16")
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**size)).to(torch.bfloat16)
    model.save_pretrained(tmp / "bf16" / "model")
    del model
    export_model(tmp / "bf16" / "model", tmp / "nf4" / "model", quantize="nf4")  # tokenizer files go along
    shutil.copy(tmp / "bf16" / "chats.jsonl", tmp / "nf4" / "chats.jsonl")


def run_kiln(tmp: Path, which: str, steps: int, warmup: int) -> dict:
    """kiln train (bench_lora_sft.run_kiln) on the 4-bit directory ("qlora") or on the bf16 one ("lora")."""
    return sft.run_kiln(tmp / ("nf4" if which == "qlora" else "bf16"), False, steps, warmup)


def run_peer(tmp: Path, steps: int, warmup: int) -> dict:
    """transformers + peft + bitsandbytes on the same 4-bit directory (bench_lora_sft.run_peer's loop)."""
    import transformers

    load = transformers.AutoModelForCausalLM.from_pretrained

    def from_4bit(*args, **kwargs):
        model = load(*args, **kwargs)
        for m in model.modules():  # its AVX-512-BF16 packing is for inference (no grad) only; keep one layout
            if hasattr(m, "support_avx512bf16_for_cpu"):
                m.support_avx512bf16_for_cpu = False
        return model

    transformers.AutoModelForCausalLM.from_pretrained = from_4bit
    return sft.run_peer(tmp / "nf4", False, steps, warmup)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="a small model, to check the script end to end")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    size = SMALL if a.small else FULL
    with tempfile.TemporaryDirectory(prefix="kiln-bench-qlora-") as tmp:
        prepare(Path(tmp), size)
        res: dict[str, list[dict]] = {"peer": [], "qlora": [], "lora": []}
        for r in range(a.rounds):
            for side in ("peer", "qlora", "lora")[:: 1 if r % 2 == 0 else -1]:  # who goes first alternates
                out = run_child(__file__, "--child", side, tmp, str(a.steps), str(a.warmup))
                res[side].append(out)
                print(f"round {r + 1} {side:>5}: {out['tokens_per_s']:8.1f} tokens/s, peak +{out['peak_mb']:.0f} MB",
                      flush=True)
        weights = {d: sum(f.stat().st_size for f in (Path(tmp) / d / "model").glob("*.safetensors")) / 2**20
                   for d in ("bf16", "nf4")}
    k, p, bf16 = res["qlora"], res["peer"], res["lora"]
    s = size
    print(f"Qwen3 shape, vocab 151,936, hidden {s['hidden_size']}, {s['num_hidden_layers']} layers, NF4 base "
          f"(double quant, bf16 compute); LoRA r=16 all projections; batch {sft.BATCH}, rows <= {sft.MAX_LENGTH} tokens")
    kiln_peak, bf16_peak = min(x["peak_mb"] for x in k), min(x["peak_mb"] for x in bf16)
    print(f"kiln QLoRA peak {kiln_peak:.0f} MB vs kiln bf16 LoRA peak {bf16_peak:.0f} MB: "
          f"ratio {kiln_peak / bf16_peak:.3f} (goal <= 0.45)")
    # the most a 4-bit base can save: the weights' bytes (the embedding / tied head stays bf16, as bitsandbytes
    # leaves it); activations, adapters, optimizer state and the runtime are the same in both runs
    floor = bf16_peak - (weights["bf16"] - weights["nf4"])
    print(f"weights: bf16 {weights['bf16']:.0f} MB, NF4 {weights['nf4']:.0f} MB; the QLoRA peak if it saved exactly "
          f"the weights' difference: {floor:.0f} MB, ratio {floor / bf16_peak:.3f} (weights-only ratio: the floor at this shape)")
    report(f"QLoRA SFT (kiln train, NF4 base, Qwen3 {'small' if a.small else '1.2B'}, vocab 151,936)",
           "transformers+peft+bitsandbytes", "tokens/s", [x["tokens_per_s"] for x in k], [x["tokens_per_s"] for x in p],
           kiln_mem=kiln_peak, peer_mem=min(x["peak_mb"] for x in p), goal=">= 1.5x, <= 0.7x memory",
           note=f"kiln QLoRA / kiln bf16 LoRA peak {kiln_peak / bf16_peak:.3f} (goal <= 0.45; floor at this shape "
                f"{floor / bf16_peak:.3f})")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        side, tmp, steps, warmup = sys.argv[2:]
        if side == "peer":
            out = run_peer(Path(tmp), int(steps), int(warmup))
        else:
            out = run_kiln(Path(tmp), side, int(steps), int(warmup))
        print(json.dumps(out))
    else:
        main()
