"""LoRA SFT of a Qwen3.5-MoE-shaped model through `kiln train` vs transformers + peft, same chat rows, CPU.

The model (qwen3_5_moe_text, random weights built by transformers and saved once): hidden 512, 4 layers
(3 Gated DeltaNet + 1 gated full attention, Qwen3.5's 3:1 schedule), DeltaNet 4 q/k heads x 8 v heads of
128 (key width = hidden, value width = 2 x hidden, as in the released models), attention 4 heads of 256
over 2 KV heads, 16 routed experts (top 4, width 256) plus a sigmoid-gated shared expert (width 512),
vocabulary 32,768. The data: benchmarks/bench_lora_sft.py's BBC chat rows (loss on the reply), batch 2.
LoRA r=16, alpha=32 on attention (q/k/v/o_proj) and every DeltaNet projection (in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a, out_proj): the targets both sides read alike (peft on transformers 5 maps the MLP
names gate/up/down_proj of this MoE family onto the routed experts' stacked weights). AdamW lr 1e-4.

kiln runs what `kiln train` runs (its fast path: chunked delta rule with the analytic backward, packed
rows, fused loss); the peer pads each batch and steps torch AdamW over transformers' PyTorch fallbacks
(no flash-linear-attention / causal-conv1d on CPU). Each side in its own process; rounds interleave;
tokens/s counts real tokens, forward + backward + optimizer step. Ratios last.

    python benchmarks/bench_qwen35_sft.py [--steps 2] [--warmup 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_lora_sft as sft
from common import interleaved, report

SIZE = dict(vocab_size=32768, hidden_size=512, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            head_dim=256, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
            linear_value_head_dim=128, moe_intermediate_size=256, shared_expert_intermediate_size=512,
            num_experts=16, num_experts_per_tok=4, max_position_embeddings=1024, tie_word_embeddings=False,
            layer_types=["linear_attention"] * 3 + ["full_attention"], pad_token_id=0, eos_token_id=2)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]


def prepare(tmp: Path) -> None:
    import torch
    import transformers

    sft.prepare_data(tmp)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**SIZE))
    model.save_pretrained(tmp / "model")


def run_kiln(tmp: Path, steps: int, warmup: int) -> dict:
    return sft.run_kiln(tmp, False, steps, warmup, targets=TARGETS)


def run_peer(tmp: Path, steps: int, warmup: int) -> dict:
    return sft.run_peer(tmp, False, steps, warmup, targets=TARGETS, pad_id=SIZE["pad_token_id"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-qwen35-") as tmp:
        prepare(Path(tmp))
        res = interleaved(__file__, a.rounds, tmp, str(a.steps), str(a.warmup))
    k, p = res["kiln"], res["peer"]
    print(f"Qwen3.5-MoE shape (3 DeltaNet + 1 attention layers, 16 experts top 4 + shared), hidden 512, vocab 32,768; "
          f"LoRA SFT on BBC chat rows (<= {sft.MAX_LENGTH} tokens), batch {sft.BATCH}; "
          f"kiln rows packed: {k[0]['rows_packed']}")
    report("LoRA SFT (kiln train, Qwen3.5-MoE shape)", "transformers+peft", "tokens/s",
           [x["tokens_per_s"] for x in k], [x["tokens_per_s"] for x in p],
           kiln_mem=min(x["peak_mb"] for x in k), peer_mem=min(x["peak_mb"] for x in p))


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        side, tmp, steps, warmup = sys.argv[2:]
        print(json.dumps({"kiln": run_kiln, "peer": run_peer}[side](Path(tmp), int(steps), int(warmup))))
    else:
        main()
