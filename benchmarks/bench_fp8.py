"""FP8 against bf16: training throughput of one Linear and of one gated MLP block, and the memory of a
frozen FP8 base under LoRA.

Throughput: forward + backward of kiln's Fp8TrainLinear (1x128 activation tiles, 128x128 weight blocks)
through `torch._scaled_mm` and through the exact emulation, against nn.Linear under bf16 autocast, on the
same inputs, rounds interleaved. On a CPU there are no FP8 matrix units: `_scaled_mm` widens to float32
and the scaling and quantization are extra work, so FP8 is *slower* here; the ratio says how much. On an
H100 the same code runs FP8 tensor cores.

Memory: a Qwen3-shaped model stored as block-scaled FP8, loaded once kept FP8 (fp8="keep") and once
dequantized to bf16, LoRA on every Linear, one training step; each in its own process, peak RSS above
the process's baseline.

    .venv/bin/python benchmarks/bench_fp8.py [--tokens 1024 --dim 1024 --hidden 2816 --rounds 5]

Run by hand (not in `make bench`): it needs a GPU with FP8 matrix units (H100) to measure FP8 itself; on a
CPU `_scaled_mm` widens to float32, so the ratio only says how much slower the emulation is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import peak_mb_above, rss_kb, setup_torch

from kiln.models.common.fp8_train import scaled_mm_works, swap_fp8_linears
from kiln.models.common.mlp import GatedMLP


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step_time(module: nn.Module, x: torch.Tensor, bf16: bool) -> float:
    _sync(x.device)
    start = time.perf_counter()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=bf16):
        y = module(x)
    y.float().sum().backward()
    _sync(x.device)
    return time.perf_counter() - start


def _variants(build, device: torch.device) -> dict[str, tuple[nn.Module, bool]]:
    torch.manual_seed(0)
    base = build().to(device)
    out = {"bf16": (base, True)}
    for name, use in (("fp8 _scaled_mm", True), ("fp8 emulated", False)):
        m = build().to(device)
        m.load_state_dict(base.state_dict())
        swap_fp8_linears(nn.ModuleList([m]), use_scaled_mm=use)
        out[name] = (m, True)
    return out


def agreement(build, tokens: int, dim: int, device: torch.device) -> None:
    """How far the `_scaled_mm` path's output and input gradient sit from the exact emulation's (same
    quantized operands; only the product's accumulation order differs), relative to the output's scale."""
    x = torch.randn(tokens, dim, device=device, requires_grad=True)
    outs = {}
    for name, (module, _) in _variants(build, device).items():
        if name == "bf16":
            continue
        x.grad = None
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = module(x)
        y.float().sum().backward()
        outs[name] = (y.float().detach(), x.grad.detach().clone())
    (ya, ga), (yb, gb) = outs["fp8 _scaled_mm"], outs["fp8 emulated"]
    print(f"  _scaled_mm vs emulated: output max |diff| {float((ya - yb).abs().max()):.3e} "
          f"(max |y| {float(yb.abs().max()):.3e}), input grad max |diff| {float((ga - gb).abs().max()):.3e} "
          f"(max |g| {float(gb.abs().max()):.3e})")


_CPU = torch.device("cpu")


def throughput(title: str, build, tokens: int, dim: int, flops: float, rounds: int,
               device: torch.device = _CPU) -> dict[str, float]:
    x = torch.randn(tokens, dim, device=device, requires_grad=True)
    variants = _variants(build, device)
    times: dict[str, list[float]] = {k: [] for k in variants}
    for module, bf16 in variants.values():
        _step_time(module, x, bf16)  # warm-up
    for _ in range(rounds):
        for name, (module, bf16) in variants.items():
            times[name].append(_step_time(module, x, bf16))
    print(f"\n{title}: {tokens} tokens, forward + backward, {device.type}")
    rates = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        rates[name] = tokens / med
        print(f"  {name:16s} {med * 1e3:9.2f} ms  {tokens / med:12,.0f} tokens/s  {flops / med / 1e9:8.1f} GFLOP/s")
    return rates


def _lora_child(model_dir: str, mode: str, device_name: str = "cpu") -> None:
    """One LoRA training step on the FP8 directory, kept FP8 or dequantized to bf16; prints JSON. On cuda the
    figures are the device's allocated bytes (torch.cuda's peak), not the process's RSS."""
    setup_torch()
    device = torch.device(device_name)
    base = rss_kb()
    from kiln.models.auto import load_pretrained
    from kiln.models.common.lora import LoraConfig, apply_lora

    model = load_pretrained(model_dir, fp8="keep", dtype=torch.bfloat16) if mode == "fp8" else \
        load_pretrained(model_dir, dtype=torch.bfloat16)
    def peak() -> float:
        return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else peak_mb_above(base)

    model.to(device)
    loaded = peak()
    apply_lora(model, LoraConfig(r=16, alpha=32, targets="all-linear"))
    model.to(device)
    ids = torch.randint(0, 1000, (2, 128), device=device)
    model.train()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    weights = sum(t.numel() * t.element_size() for n, t in model.state_dict().items() if ".lora_" not in n)
    print(json.dumps({"loaded_mb": loaded, "peak_mb": peak(), "weights_mb": weights / 2**20}))


def lora_memory(layers: int, dim: int, hidden: int, device: str = "cpu") -> dict[str, dict]:
    from kiln.hub.fp8 import quantize
    from kiln.models.auto import AutoConfig, from_config

    cfg = AutoConfig.for_model("qwen3", vocab_size=1000, hidden_size=dim, intermediate_size=hidden,
                               num_hidden_layers=layers, num_attention_heads=dim // 64, num_key_value_heads=dim // 128,
                               head_dim=64)
    tmp = Path(tempfile.mkdtemp())
    model = from_config(cfg, task="causal-lm", seed=0)
    model.save_pretrained(tmp)
    from safetensors.torch import load_file, save_file

    state = load_file(str(tmp / "model.safetensors"))
    out = {}
    for k, v in state.items():
        if ".layers." in k and k.endswith("proj.weight"):
            out[k], out[k + "_scale_inv"] = quantize(v, (128, 128))
        else:
            out[k] = v.to(torch.bfloat16)
    save_file(out, str(tmp / "model.safetensors"))
    c = json.loads((tmp / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    (tmp / "config.json").write_text(json.dumps(c))
    result = {}
    for mode in ("bf16", "fp8"):
        p = subprocess.run([sys.executable, __file__, "--lora-child", str(tmp), mode, device], capture_output=True, text=True,
                           check=True)
        result[mode] = json.loads(p.stdout.strip().splitlines()[-1])
    print(f"\nLoRA (r=16, all Linears) on a {layers}-layer Qwen3-shaped model, hidden {dim}, one training step:")
    for mode, r in result.items():
        print(f"  base {mode:5s} weights {r['weights_mb']:8.1f} MB   loaded {r['loaded_mb']:8.1f} MB   "
              f"peak {r['peak_mb']:8.1f} MB")
    return result


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--lora-child":
        return _lora_child(sys.argv[2], sys.argv[3], sys.argv[4])
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=2816)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (an H100 has FP8 matrix units)")
    args = ap.parse_args()
    setup_torch()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {name}; "
          f"_scaled_mm on {device.type}: {'runs' if scaled_mm_works(device.type) else 'refused (emulation only)'}")
    t, d, h = args.tokens, args.dim, args.hidden
    agreement(lambda: nn.Linear(d, d, bias=False), t, d, device)
    lin = throughput("Linear", lambda: nn.Linear(d, d, bias=False), t, d, 3 * 2 * t * d * d, args.rounds, device)
    mlp = throughput("Gated MLP block", lambda: GatedMLP(d, h), t, d, 3 * 2 * t * 3 * d * h, args.rounds, device)
    mem = lora_memory(args.layers, d, h, args.device)
    print("\nratios (fp8 / bf16; > 1 means FP8 is ahead):")
    for title, r in (("Linear", lin), ("MLP block", mlp)):
        print(f"  {title:10s} throughput  _scaled_mm {r['fp8 _scaled_mm'] / r['bf16']:.2f}x   "
              f"emulated {r['fp8 emulated'] / r['bf16']:.2f}x")
    print(f"  LoRA base weights {mem['fp8']['weights_mb'] / mem['bf16']['weights_mb']:.2f}x   "
          f"peak memory {mem['fp8']['peak_mb'] / mem['bf16']['peak_mb']:.2f}x")


if __name__ == "__main__":
    main()
