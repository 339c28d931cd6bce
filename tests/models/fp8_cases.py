"""Tiny block-scaled FP8 checkpoints and transformers' own dequantization, for the FP8 tests (not a test module).

`make_fp8` takes a tiny random checkpoint built by transformers and stores, as DeepSeek-V3/Qwen FP8
releases do, the weights transformers would hold in FP8 modules (its Linear layers and per-expert
tensors, minus `modules_to_not_convert`) as float8_e4m3fn + `weight_scale_inv` per block. The
quantization is written out here, from the formula (block amax, scale 448 / amax, UE8M0 scales
rounded up to a power of two), so kiln's own `quantize` is checked against it, not against itself.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

F8 = torch.float8_e4m3fn


def quantize_reference(w: torch.Tensor, block: tuple[int, int], ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block, in plain loops: (float8 weight, float32 or e8m0 scale)."""
    rows, cols = w.shape
    rb, cb = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    q = torch.empty(rows, cols, dtype=F8)
    inv = torch.empty(rb, cb, dtype=torch.float32)
    for i in range(rb):
        for j in range(cb):
            tile = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]].float()
            amax = tile.abs().max()
            # python-number / tensor, as transformers writes it: torch computes that as 448 * (1 / amax)
            scale = 448.0 / amax if amax > 0 else torch.tensor(1.0)
            s_inv = (1.0 / scale).float()
            if ue8m0:
                s_inv = torch.exp2(torch.ceil(torch.log2(s_inv)))
                scale = 1.0 / s_inv
            inv[i, j] = s_inv
            q[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = \
                torch.clamp(tile * scale, -448.0, 448.0).to(F8)
    return q, inv.to(torch.float8_e8m0fnu) if ue8m0 else inv


def fp8_module_names(model_dir: Path, arch: str) -> tuple[set[str], list[str]]:
    """(tensor names on disk transformers would hold in FP8: Linear and per-expert weights, the modules
    it keeps in float32 whatever the checkpoint says, e.g. the DSA indexer's weights_proj)."""
    import transformers

    model = getattr(transformers, arch).from_pretrained(str(model_dir))
    keep32 = list(getattr(model, "_keep_in_fp32_modules", None) or [])
    linears = {n + ".weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    # families that save under other names than their modules' (DeepSeek-V4: attn.wq_a for self_attn.q_a_proj)
    from kiln.models.auto import REGISTRY

    family = REGISTRY[model.config.model_type]
    keymap = family.keymap(family.task_of(arch))
    linears |= {keymap.hf_name(n) for n in linears if keymap.hf_name(n)}
    names = set(load_file(str(model_dir / "model.safetensors")))
    chosen = {k for k in names if k in linears or (".experts." in k and k.endswith(".weight"))}
    return {k for k in chosen if not any(m in k for m in keep32)}, keep32


def make_fp8(src: Path, out: Path, arch: str, block: tuple[int, int] = (16, 16), scale_fmt: str = "float",
             skip: tuple[str, ...] = ("lm_head",)) -> Path:
    """An FP8 copy of the checkpoint `src` in `out` (config, tokenizer files copied; weights quantized)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    state = load_file(str(src / "model.safetensors"))
    chosen, keep32 = fp8_module_names(src, arch)
    skip = tuple(skip) + tuple(keep32)
    result = {}
    for k, v in state.items():
        module = k.rsplit(".", 1)[0]
        if k in chosen and not any(module == m or module.endswith("." + m) for m in skip):
            result[k], result[k + "_scale_inv"] = quantize_reference(v, block, scale_fmt == "ue8m0")
        else:
            result[k] = v
    save_file(result, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": list(block), "scale_fmt": scale_fmt,
                                  "modules_to_not_convert": list(skip)}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def transformers_dequantized(fp8_dir: Path, out: Path) -> Path:
    """A plain float32 copy of an FP8 directory, each weight dequantized by transformers' finegrained_fp8
    `_dequantize_fp8_weight` (its block-true dequantization; its loader's `Fp8Dequantize` derives the block
    from the scale grid and refuses partial blocks)."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    out.mkdir(parents=True, exist_ok=True)
    for f in fp8_dir.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    cfg = json.loads((fp8_dir / "config.json").read_text())
    block = cfg.pop("quantization_config")["weight_block_size"]
    state = load_file(str(fp8_dir / "model.safetensors"))
    plain = {}
    for k, v in state.items():
        if k.endswith("_scale_inv"):
            continue
        plain[k] = _dequantize_fp8_weight(v, state[k + "_scale_inv"], block, torch.float32) if v.dtype == F8 else v
    save_file(plain, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
