"""Block-scaled FP8 checkpoints on disk (DeepSeek-V3 style): the scheme, quantize and dequantize.

A quantized weight W (rows, cols) is stored as float8_e4m3fn Q plus `<name>_scale_inv` S with one
entry per (bm, bn) block, ceil-divided so the last block of a row or column may be partial:
W ~ Q * S (block-broadcast). `quantization_config` in config.json names the scheme
(`quant_method = "fp8"`, `weight_block_size`, `scale_fmt` "float" or "ue8m0", `activation_scheme`,
`modules_to_not_convert`). Leading dimensions (stacked experts) carry one scale grid each.

Dequantization multiplies in float32 and rounds once to the compute dtype (transformers' order).
Quantization takes each block's amax: scale = 448 / amax, S = 1 / scale (a power of two, rounded
up, for UE8M0, with the scale then taken as exactly 1 / S), Q = round-to-nearest(W * scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.errors import ConfigError, WeightsError

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SCALE_SUFFIX = "_scale_inv"


def ue8m0_dtype(source: str = "quantization_config") -> torch.dtype:
    """torch.float8_e8m0fnu, or an error saying this torch cannot hold UE8M0 scales."""
    dtype = getattr(torch, "float8_e8m0fnu", None)
    if dtype is None:
        raise ConfigError(f"{source}: scale_fmt 'ue8m0' needs torch.float8_e8m0fnu, which torch {torch.__version__} "
                          "lacks (it came in torch 2.7); upgrade torch to load or write UE8M0-scaled FP8 weights")
    return dtype


@dataclass(frozen=True)
class Fp8Scheme:
    """What `quantization_config` says about a block-scaled FP8 checkpoint."""
    block: tuple[int, int] | None = (128, 128)   # None: one scale per tensor
    scale_fmt: str = "float"                     # "float" (float32 scales) or "ue8m0" (powers of two)
    activation_scheme: str = "dynamic"
    modules_to_not_convert: tuple[str, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False)  # as read, written back verbatim

    @property
    def ue8m0(self) -> bool:
        return self.scale_fmt == "ue8m0"

    def scale_dtype(self) -> torch.dtype:
        return ue8m0_dtype() if self.ue8m0 else torch.float32

    def to_config(self) -> dict[str, Any]:
        if self.raw:
            return dict(self.raw)
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": self.activation_scheme,
                "weight_block_size": list(self.block) if self.block else None, "scale_fmt": self.scale_fmt,
                "modules_to_not_convert": list(self.modules_to_not_convert) or None}

    def skips(self, hf_name: str) -> bool:
        """Whether the module holding tensor `hf_name` is listed as left unquantized."""
        module = hf_name.rsplit(".", 1)[0]
        return any(module == m or module.endswith("." + m) or module.startswith(m + ".")
                   for m in self.modules_to_not_convert)


def scheme_from_config(raw: dict[str, Any], source: str = "config.json") -> Fp8Scheme | None:
    """The FP8 scheme of a config.json dict; None when it has no quantization_config."""
    q = raw.get("quantization_config")
    if q is None:
        return None
    where = f"{source}: quantization_config"
    if not isinstance(q, dict):
        raise ConfigError(f"{where} must be an object, got {type(q).__name__}")
    method = q.get("quant_method")
    if method != "fp8":
        raise ConfigError(f"{where}.quant_method {method!r} is not supported; kiln reads block-scaled 'fp8' "
                          "checkpoints (dequantize other formats with their own tools first)")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{where}.fmt {fmt!r} is not supported; only 'e4m3' (float8_e4m3fn) weights are")
    block = q.get("weight_block_size", [128, 128])
    if block is not None:
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ConfigError(f"{where}.weight_block_size must be two positive integers [rows, cols], got {block!r}")
        block = (int(block[0]), int(block[1]))
    scale_fmt = q.get("scale_fmt") or "float"
    if scale_fmt not in ("float", "ue8m0"):
        raise ConfigError(f"{where}.scale_fmt {scale_fmt!r} is not supported; use 'float' or 'ue8m0'")
    if scale_fmt == "ue8m0":
        ue8m0_dtype(where)
    scheme = q.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ConfigError(f"{where}.activation_scheme {scheme!r} is not supported; only 'dynamic' (activations "
                          "scaled per tile at run time, no stored activation_scale) is")
    skip = q.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise ConfigError(f"{where}.modules_to_not_convert must be a list of module names, got {skip!r}")
    return Fp8Scheme(block, scale_fmt, scheme, tuple(skip), dict(q))


# ---- one tensor ----------------------------------------------------------------------------------
def scale_grid(shape: tuple[int, ...], block: tuple[int, int] | None) -> tuple[int, ...]:
    """The scale tensor's shape for a weight of `shape`: leading dims, then ceil(rows/bm), ceil(cols/bn)."""
    if block is None:
        return tuple(shape[:-2])
    return (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def check_pair(name: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               source: str = "checkpoint") -> None:
    """A weight and its scale fit the block size, else a WeightsError naming both shapes."""
    if weight.dim() < 2:
        raise WeightsError(f"{source}: FP8 tensor {name!r} has shape {tuple(weight.shape)}; "
                           "block-scaled FP8 weights have at least two dimensions")
    want = scale_grid(tuple(weight.shape), block)
    if tuple(scale.shape) != want and not (block is None and scale.numel() == 1):
        raise WeightsError(f"{source}: scale {name + SCALE_SUFFIX!r} has shape {tuple(scale.shape)}, but weight "
                           f"{name!r} of shape {tuple(weight.shape)} in blocks of {list(block) if block else 'one'} "
                           f"needs {want}; does weight_block_size match the checkpoint?")


def _expand(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int] | None) -> torch.Tensor:
    """The float32 scale broadcast to every element of a weight of `shape`."""
    s = scale.to(torch.float32) if scale.dtype != torch.uint8 else (scale.to(torch.float32) - 127.0).exp2()
    if block is None:
        return s.reshape(*shape[:-2], 1, 1) if s.numel() > 1 else s.reshape(())
    rows, cols = shape[-2:]
    return s.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Q * S in float32 (UE8M0 bytes read as 2**(b - 127)), rounded once to `dtype`."""
    return (weight.to(torch.float32) * _expand(scale, tuple(weight.shape), block)).to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int] | None, ue8m0: bool = False,
             scale_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q float8_e4m3fn, S) for `weight` (..., rows, cols): per-block amax scales, round to nearest.

    S is float32, or `scale_dtype` (e.g. float8_e8m0fnu, exact for UE8M0's powers of two).
    """
    w = weight.detach().to(torch.float32)
    shape = tuple(w.shape)
    if block is None:
        amax = w.abs().amax(dim=(-2, -1))
    else:
        rows, cols = shape[-2:]
        rb, cb = math.ceil(rows / block[0]), math.ceil(cols / block[1])
        padded = torch.zeros(*shape[:-2], rb * block[0], cb * block[1], dtype=torch.float32, device=w.device)
        padded[..., :rows, :cols] = w.abs()  # zeros in the padding never raise a block's amax
        amax = padded.reshape(*shape[:-2], rb, block[0], cb, block[1]).amax(dim=(-3, -1))
    ones = torch.ones_like(amax)
    scale = torch.where(amax > 0, FP8_MAX / torch.where(amax > 0, amax, ones), ones)  # an all-zero block keeps 1
    inv = (1.0 / scale).to(torch.float32)
    if ue8m0:
        inv = torch.exp2(torch.ceil(torch.log2(inv.clamp(min=torch.finfo(torch.float32).tiny))))
        scale = 1.0 / inv  # quantize with exactly the reciprocal of the stored power of two
    full = _expand(scale, shape, block)
    q = torch.clamp(w * full, min=-FP8_MAX, max=FP8_MAX).to(FP8)
    if scale_dtype == torch.uint8:  # UE8M0 exponents stored as raw bytes (MXFP8 checkpoints)
        return q, (torch.log2(inv) + 127.0).round().clamp(0, 254).to(torch.uint8)
    return q, inv.to(scale_dtype or (ue8m0_dtype() if ue8m0 else torch.float32))


# ---- state dicts -----------------------------------------------------------------------------------
def fp8_pairs(state: dict[str, torch.Tensor], scheme: Fp8Scheme, source: str = "checkpoint"
              ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (FP8 weight, scale) for every FP8 tensor of an HF state dict, checked against the scheme."""
    pairs = {}
    for name, t in state.items():
        if t.dtype not in (FP8, getattr(torch, "float8_e5m2", FP8)):
            continue
        if t.dtype != FP8:
            raise WeightsError(f"{source}: tensor {name!r} is {t.dtype}; FP8 checkpoints hold float8_e4m3fn weights")
        if scheme.skips(name):
            raise WeightsError(f"{source}: tensor {name!r} is FP8, but quantization_config.modules_to_not_convert "
                               "lists its module as left unquantized")
        scale = state.get(name + SCALE_SUFFIX)
        if scale is None:
            raise WeightsError(f"{source}: FP8 tensor {name!r} (shape {tuple(t.shape)}) has no scale "
                               f"{name + SCALE_SUFFIX!r}; a block-scaled FP8 weight needs one")
        check_pair(name, t, scale, scheme.block, source)
        pairs[name] = (t, scale)
    orphans = [k for k in state if k.endswith(SCALE_SUFFIX) and k[:-len(SCALE_SUFFIX)] not in pairs]
    if orphans:
        raise WeightsError(f"{source}: scale(s) without an FP8 weight: {', '.join(repr(k) for k in orphans[:4])}")
    return pairs


def dequantize_state(state: dict[str, torch.Tensor], scheme: Fp8Scheme, dtype: torch.dtype,
                     source: str = "checkpoint") -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(state with every FP8 weight dequantized to `dtype` and scales dropped, the FP8 pairs as read)."""
    pairs = fp8_pairs(state, scheme, source)
    out = {}
    for name, t in state.items():
        if name in pairs:
            out[name] = dequantize(t, pairs[name][1], scheme.block, dtype)
        elif not (name.endswith(SCALE_SUFFIX) and name[:-len(SCALE_SUFFIX)] in pairs):
            out[name] = t
    return out, pairs


def requantize_state(state: dict[str, torch.Tensor], scheme: Fp8Scheme,
                     originals: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The inverse of `dequantize_state` for export: tensors that were FP8 go back to FP8 + scale.

    A weight still equal to the dequantization of its source pair is written as that pair, byte
    for byte; a changed one is quantized afresh (scale in the source scale's dtype).
    """
    out = {}
    for name, t in state.items():
        if name not in originals:
            out[name] = t
            continue
        q, s = originals[name]
        if t.dtype.is_floating_point and t.shape == q.shape and torch.equal(dequantize(q, s, scheme.block, t.dtype), t):
            out[name], out[name + SCALE_SUFFIX] = q, s
        else:
            out[name], out[name + SCALE_SUFFIX] = quantize(t, scheme.block, scheme.ue8m0, s.dtype)
    return out
