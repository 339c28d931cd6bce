"""LoRA SFT step: kiln vs transformers + peft on the same Qwen3-shaped model, data and batch, on CPU.

One random Qwen3 model (built by transformers, saved once) is loaded by both; LoRA r=16, alpha=32
on q/k/v/o/gate/up/down, dropout 0; AdamW on the adapters only; batches of chat-like token rows
with the loss on the second half of each row (-100 elsewhere), same rows for both. Each side
runs in its own process (peak RSS is its own), rounds interleave, the best round counts. Timing
starts after warm-up steps. Prints tokens/s by wall clock and by process CPU time (the second
stays fair when other work shares the cores), peak RSS above the loaded model, then the kiln/peer
ratios last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BATCH, LENGTH, STEPS, WARMUP, ROUNDS = 4, 256, 6, 2, 3
SIZE = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def _batches():
    import torch

    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(STEPS + WARMUP):
        ids = torch.randint(3, SIZE["vocab_size"], (BATCH, LENGTH), generator=g)
        labels = ids.clone()
        labels[:, : LENGTH // 2] = -100  # prompt half: no loss
        out.append({"input_ids": ids, "labels": labels})
    return out


def _loop(model, step) -> dict:
    import torch

    torch.manual_seed(0)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    base = _rss_kb("VmRSS")
    batches = _batches()
    losses = []
    for i, b in enumerate(batches):
        if i == WARMUP:
            t0, c0 = time.perf_counter(), time.process_time()
        loss = step(model, b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    tokens = STEPS * BATCH * LENGTH
    return {"tokens_per_s": tokens / dt, "tokens_per_cpu_s": tokens / dc, "peak_mb": (_rss_kb("VmHWM") - base) / 1024,
            "losses": losses}


def run_kiln(model_dir: str) -> dict:
    from kiln.models import AutoModelForCausalLM
    from kiln.models.common.lora import LoraConfig, apply_lora

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    apply_lora(model, LoraConfig(r=16, alpha=32, targets=TARGETS))
    torch_seed_adapters(model)
    return _loop(model.train(), lambda m, b: m(**b).loss)


def run_peer(model_dir: str) -> dict:
    import peft
    import transformers

    transformers.logging.set_verbosity_error()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS,
                                                       lora_dropout=0.0, task_type="CAUSAL_LM"))
    torch_seed_adapters(model)
    return _loop(model.train(), lambda m, b: m(**b, use_cache=False).loss)


def torch_seed_adapters(model) -> None:
    """The same adapter weights on both sides (A random by name order, B small), so the losses match."""
    import torch

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0].replace(".default", "").split("model.", 1)[-1]):
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.02 if "lora_A" in name else 0.01))


def main() -> None:
    if len(sys.argv) == 3:  # child: run one side, print its result
        print(json.dumps({"kiln": run_kiln, "peer": run_peer}[sys.argv[1]](sys.argv[2])))
        return
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZE)).save_pretrained(tmp)
        n_params = sum(p.numel() for p in transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZE)).parameters())
        best: dict[str, dict] = {}
        for _ in range(ROUNDS):
            for side in ("peer", "kiln"):
                r = subprocess.run([sys.executable, __file__, side, tmp], capture_output=True, text=True,
                                   env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
                if r.returncode:
                    sys.exit(f"{side} failed:\n{r.stderr[-3000:]}")
                res = json.loads(r.stdout.strip().splitlines()[-1])
                if side not in best:
                    best[side] = res
                for key in ("tokens_per_s", "tokens_per_cpu_s"):
                    best[side][key] = max(best[side][key], res[key])
    k, p = best["kiln"], best["peer"]
    print(f"Qwen3-shaped model, {n_params / 1e6:.1f}M params; LoRA r=16 on {len(TARGETS)} projections; "
          f"batch {BATCH} x {LENGTH} tokens; {STEPS} timed steps after {WARMUP}; torch threads {torch.get_num_threads()}")
    print(f"first losses  kiln {k['losses'][0]:.6f}  peer {p['losses'][0]:.6f}")
    for name, r in (("transformers+peft", p), ("kiln", k)):
        print(f"{name:>18}: {r['tokens_per_s']:8.1f} tokens/s (wall)  {r['tokens_per_cpu_s']:8.1f} tokens/CPU-s  "
              f"{r['tokens_per_s'] / (BATCH * LENGTH):.3f} steps/s  peak +{r['peak_mb']:.0f} MB")
    print(f"ratio kiln/peer: throughput {k['tokens_per_s'] / p['tokens_per_s']:.3f} (wall), "
          f"{k['tokens_per_cpu_s'] / p['tokens_per_cpu_s']:.3f} (CPU time); peak memory {k['peak_mb'] / p['peak_mb']:.3f}")


if __name__ == "__main__":
    main()
