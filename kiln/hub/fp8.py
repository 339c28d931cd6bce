"""Block-scaled FP8 checkpoints on disk (DeepSeek-V3/V4 style): the scheme, quantize and dequantize.

A quantized weight W (rows, cols) is stored as float8_e4m3fn Q plus `<name>_scale_inv` S with one
entry per (bm, bn) block, ceil-divided so the last block of a row or column may be partial:
W ~ Q * S (block-broadcast). `quantization_config` in config.json names the scheme
(`quant_method = "fp8"`, `weight_block_size`, `scale_fmt` "float" or "ue8m0", `activation_scheme`,
`modules_to_not_convert`, `expert_dtype`). Leading dimensions (stacked experts) carry one scale grid each.

DeepSeek-V4's release differs in two ways, both read and written back in its own form:
- a weight `<module>.weight`'s scale is `<module>.scale` (transformers renames it to `weight_scale_inv`
  at load); `canonical_scales` does that rename and the scheme remembers it for the export;
- with `expert_dtype = "fp4"` (in quantization_config or, in V4's own config, top level) the routed
  experts are FP4 e2m1, two values per int8 byte (low nibble first), one UE8M0 scale per 32 inputs
  (a (1, 32) block), dequantized through e2m1's 16-value table as transformers' `Fp8Dequantize` does.

Dequantization multiplies in float32 and rounds once to the compute dtype (transformers' order).
Quantization takes each block's amax: scale = 448 / amax, S = 1 / scale (a power of two, rounded
up, for UE8M0, with the scale then taken as exactly 1 / S), Q = round-to-nearest(W * scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kiln.errors import ConfigError, WeightsError

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SCALE_SUFFIX = "_scale_inv"
FP4_BLOCK = (1, 32)  # one scale per 32 inputs of one output row
FP4_MAX = 6.0
# e2m1 codes 0..15: sign bit 3, then exponent and mantissa (transformers' _FP4_E2M1_LUT order)
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FP4_X2 = getattr(torch, "float4_e2m1fn_x2", None)


def is_fp4(t: torch.Tensor) -> bool:
    """Whether `t` holds packed FP4 (two e2m1 values a byte): int8 on disk, or torch's float4_e2m1fn_x2."""
    return t.dtype == torch.int8 or (_FP4_X2 is not None and t.dtype == _FP4_X2)


def is_quantized(t: torch.Tensor) -> bool:
    return t.dtype == FP8 or is_fp4(t)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """(..., n) packed bytes -> (..., 2n) float32 values, the low nibble first."""
    u8 = packed.contiguous().view(torch.uint8)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=packed.device)
    pair = torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], dim=-1)
    return pair.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def pack_fp4(x: torch.Tensor) -> torch.Tensor:
    """(..., 2n) float values already scaled into [-6, 6] -> (..., n) int8, each rounded to the nearest e2m1
    value, ties to the even code (as IEEE rounding does), the low nibble first."""
    if x.shape[-1] % 2:
        raise WeightsError(f"FP4 packing needs an even last dimension, got shape {tuple(x.shape)}")
    mag = x.abs().clamp(max=FP4_MAX)
    grid = torch.tensor(FP4_VALUES[:8], dtype=torch.float32, device=x.device)
    mids = (grid[1:] + grid[:-1]) / 2
    code = torch.bucketize(mag, mids)  # a value on a midpoint gets the lower code ...
    tie = (code < 7) & (mag == mids[code.clamp(max=6)]) & (code % 2 == 1)
    code = code + tie.long()  # ... and moves up when that code is odd
    code = code | ((x < 0) & (code > 0)).long() << 3  # -0 written as +0
    pairs = code.reshape(*x.shape[:-1], -1, 2)
    return (pairs[..., 0] | pairs[..., 1] << 4).to(torch.uint8).view(torch.int8)


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
    expert_dtype: str = "fp8"                    # "fp4": routed experts packed e2m1 (DeepSeek-V4)
    dtype: torch.dtype | None = None             # config.json's torch_dtype: what dequantized weights become
    scale_names: str = SCALE_SUFFIX              # on disk: "<name>_scale_inv", or ".scale" ("<module>.scale")

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

    def scale_key(self, weight_name: str) -> str:
        """The on-disk name of `weight_name`'s scale."""
        if self.scale_names == ".scale" and weight_name.endswith(".weight"):
            return weight_name[:-len(".weight")] + ".scale"
        return weight_name + SCALE_SUFFIX

    def describe(self) -> str:
        """One line for `kiln inspect`: the blocks, the experts' format, the scales' format and names."""
        blocks = f"fp8 e4m3 blocks {self.block[0]}x{self.block[1]}" if self.block else "fp8 e4m3 per tensor"
        experts = "; routed experts fp4 e2m1, blocks 1x32" if self.expert_dtype == "fp4" else ""
        where = "<module>.scale" if self.scale_names == ".scale" else "<weight>_scale_inv"
        return f"{blocks}{experts}; scales {self.scale_fmt} ({where}), activations {self.activation_scheme}"

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
    # DeepSeek-V4's config names the experts' format at its top level; V4.1 (and transformers) inside
    experts = q.get("expert_dtype", raw.get("expert_dtype", "fp8"))
    if experts not in ("fp8", "fp4"):
        raise ConfigError(f"{where}.expert_dtype {experts!r} is not supported; use 'fp8' or 'fp4'")
    # the dtype transformers' "auto" loads in; a checkpoint holding as many float32 tensors (hyper connections,
    # sinks) as bf16 ones would otherwise be dequantized to the wrong one
    named = raw.get("torch_dtype", raw.get("dtype"))
    dtype = getattr(torch, named, None) if isinstance(named, str) else None
    dtype = dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point and dtype.itemsize > 1 else None
    return Fp8Scheme(block, scale_fmt, scheme, tuple(skip), dict(q), experts, dtype)


# ---- one tensor ----------------------------------------------------------------------------------
def scale_grid(shape: tuple[int, ...], block: tuple[int, int] | None) -> tuple[int, ...]:
    """The scale tensor's shape for a weight of `shape`: leading dims, then ceil(rows/bm), ceil(cols/bn)."""
    if block is None:
        return tuple(shape[:-2])
    return (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))


def logical_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The weight's shape in values: packed FP4 holds two a byte along the last dimension."""
    return (*t.shape[:-1], 2 * t.shape[-1]) if is_fp4(t) else tuple(t.shape)


def block_of(t: torch.Tensor, block: tuple[int, int] | None) -> tuple[int, int] | None:
    """The scale block of a stored weight: (1, 32) for packed FP4, else the scheme's."""
    return FP4_BLOCK if is_fp4(t) else block


def check_pair(name: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               source: str = "checkpoint", scale_name: str | None = None) -> None:
    """A weight and its scale fit the block size, else a WeightsError naming both shapes."""
    scale_name = scale_name or name + SCALE_SUFFIX
    kind = "FP4" if is_fp4(weight) else "FP8"
    if weight.dim() < 2:
        raise WeightsError(f"{source}: {kind} tensor {name!r} has shape {tuple(weight.shape)}; "
                           f"block-scaled {kind} weights have at least two dimensions")
    shape, block = logical_shape(weight), block_of(weight, block)
    want = scale_grid(shape, block)
    if tuple(scale.shape) != want and not (block is None and scale.numel() == 1):
        packed = f" (packed: {tuple(weight.shape)})" if is_fp4(weight) else ""
        raise WeightsError(f"{source}: scale {scale_name!r} has shape {tuple(scale.shape)}, but {'FP4 ' if is_fp4(weight) else ''}weight "
                           f"{name!r} of shape {shape}{packed} in blocks of {list(block) if block else 'one'} "
                           f"needs {want}; does weight_block_size match the checkpoint?")
    if scale.device.type != "meta":  # a NaN or infinite scale would make every weight of its block NaN or inf
        bad = scale == 255 if scale.dtype == torch.uint8 else ~torch.isfinite(scale.to(torch.float32))  # E8M0 0xFF: NaN
        if bool(bad.any()):
            where = tuple(int(i) for i in bad.nonzero()[0])
            raise WeightsError(f"{source}: scale {scale_name!r} holds {int(bad.sum())} non-finite value(s) (first at "
                               f"index {where}: {scale[where].item()!r}{' = NaN in E8M0' if scale.dtype == torch.uint8 else ''}); "
                               f"weight {name!r} cannot be dequantized")


def _expand(scale: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int] | None,
            origin: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """The float32 scale broadcast to every element of a weight (or a box of one) of `shape`; `origin`: the box's
    (row, column) in the whole weight, `scale` then the whole blocks around the box."""
    s = scale.to(torch.float32) if scale.dtype != torch.uint8 else (scale.to(torch.float32) - 127.0).exp2()
    if block is None:
        return s.reshape(*shape[:-2], 1, 1) if s.numel() > 1 else s.reshape(())
    if min(origin) < 0:
        raise ValueError(f"origin {origin} of a block-scaled box must not be negative")
    (rows, cols), r0, c0 = shape[-2:], origin[0] % block[0], origin[1] % block[1]
    return s.repeat_interleave(block[0], dim=-2)[..., r0:r0 + rows, :] \
        .repeat_interleave(block[1], dim=-1)[..., c0:c0 + cols]


def dequantize(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               dtype: torch.dtype = torch.float32, origin: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """Q * S in float32 (UE8M0 bytes read as 2**(b - 127)), rounded once to `dtype`; packed FP4 is unpacked
    through the e2m1 table first and scaled in (1, 32) blocks whatever `block` says. A box of the weight at
    `origin` (its first row and column, in values) with the whole scale blocks around it dequantizes to the
    same box of the whole weight's dequantization, bit for bit."""
    if is_fp4(weight):
        values = unpack_fp4(weight)
        return (values * _expand(scale, tuple(values.shape), FP4_BLOCK, origin)).to(dtype)
    return (weight.to(torch.float32) * _expand(scale, tuple(weight.shape), block, origin)).to(dtype)


def quantize_fp4(weight: torch.Tensor, ue8m0: bool = True, scale_dtype: torch.dtype | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int8 Q, S) for `weight` (..., rows, cols), cols even: per 32-input block amax, S = amax / 6
    (rounded up to a power of two for UE8M0, so no value passes 6), Q = nearest e2m1 of W / S."""
    w = weight.detach().to(torch.float32)
    _rows, cols = w.shape[-2:]
    nb = math.ceil(cols / FP4_BLOCK[1])
    padded = torch.zeros(*w.shape[:-1], nb * FP4_BLOCK[1], dtype=torch.float32, device=w.device)
    padded[..., :cols] = w.abs()
    amax = padded.reshape(*w.shape[:-1], nb, FP4_BLOCK[1]).amax(dim=-1)
    inv = torch.where(amax > 0, amax / FP4_MAX, torch.ones_like(amax))  # an all-zero block keeps 1
    if ue8m0:
        inv = torch.exp2(torch.ceil(torch.log2(inv.clamp(min=torch.finfo(torch.float32).tiny))))
    q = pack_fp4(w * _expand(1.0 / inv, tuple(w.shape), FP4_BLOCK))
    if scale_dtype == torch.uint8:
        return q, (torch.log2(inv) + 127.0).round().clamp(0, 254).to(torch.uint8)
    return q, inv.to(scale_dtype or (ue8m0_dtype() if ue8m0 else torch.float32))


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
def scale_renames(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """`<module>.scale` -> `<module>.weight_scale_inv` for each scale stored under DeepSeek-V4's names. Only a
    `.scale` beside a quantized `.weight` is a scale (other tensors may end in `.scale`); meta tensors will do."""
    return {k: k[:-len(".scale")] + ".weight" + SCALE_SUFFIX for k in state
            if k.endswith(".scale") and (w := state.get(k[:-len(".scale")] + ".weight")) is not None
            and is_quantized(w)}


def canonical_scales(state: dict[str, torch.Tensor], scheme: Fp8Scheme) -> tuple[dict[str, torch.Tensor], Fp8Scheme]:
    """Scales stored as `<module>.scale` (DeepSeek-V4) renamed `<module>.weight_scale_inv`, as transformers does
    at load, and the scheme noting it so an export writes them back as read (`scale_renames`)."""
    renames = scale_renames(state)
    if not renames:
        return state, scheme
    clash = [new for new in renames.values() if new in state]
    if clash:
        raise WeightsError(f"checkpoint holds both {clash[0]!r} and its '.scale' form; keep one")
    return {renames.get(k, k): v for k, v in state.items()}, replace(scheme, scale_names=".scale")


def fp8_pairs(state: dict[str, torch.Tensor], scheme: Fp8Scheme, source: str = "checkpoint"
              ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """name -> (FP8 or packed FP4 weight, scale) for every quantized tensor of an HF state dict (scales under
    `_scale_inv` names: `canonical_scales` first), checked against the scheme."""
    pairs = {}
    for name, t in state.items():
        scale = state.get(name + SCALE_SUFFIX)
        if is_fp4(t):
            if scale is None and not (scheme.expert_dtype == "fp4" and name.endswith(".weight")):
                continue  # a plain int8 tensor
            if scheme.expert_dtype != "fp4":
                raise WeightsError(f"{source}: tensor {name!r} is packed FP4 ({t.dtype}), but quantization_config "
                                   "has no expert_dtype 'fp4'")
        elif t.dtype not in (FP8, getattr(torch, "float8_e5m2", FP8)):
            continue
        elif t.dtype != FP8:
            raise WeightsError(f"{source}: tensor {name!r} is {t.dtype}; FP8 checkpoints hold float8_e4m3fn weights")
        kind = "FP4" if is_fp4(t) else "FP8"
        if scheme.skips(name):
            raise WeightsError(f"{source}: tensor {name!r} is {kind}, but quantization_config.modules_to_not_convert "
                               "lists its module as left unquantized")
        if scale is None:
            raise WeightsError(f"{source}: {kind} tensor {name!r} (shape {tuple(t.shape)}) has no scale "
                               f"{scheme.scale_key(name)!r}; a block-scaled {kind} weight needs one")
        check_pair(name, t, scale, scheme.block, source, scheme.scale_key(name))
        pairs[name] = (t, scale)
    orphans = [k for k in state if k.endswith(SCALE_SUFFIX) and k[:-len(SCALE_SUFFIX)] not in pairs]
    if orphans:
        raise WeightsError(f"{source}: scale(s) without an FP8 (or FP4) weight: {', '.join(repr(k) for k in orphans[:4])}")
    return pairs


def dequantize_state(state: dict[str, torch.Tensor], scheme: Fp8Scheme, dtype: torch.dtype,
                     source: str = "checkpoint") -> tuple[dict[str, torch.Tensor], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """(state with every FP8/FP4 weight dequantized to `dtype` and scales dropped, the pairs as read)."""
    state, scheme = canonical_scales(state, scheme)
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
    """The inverse of `dequantize_state` for export: tensors that were FP8 (FP4) go back to FP8 (FP4) + scale,
    the scale under the name the checkpoint gave it (`scheme.scale_key`).

    A weight still equal to the dequantization of its source pair is written as that pair, byte
    for byte; a changed one is quantized afresh (scale in the source scale's dtype).
    """
    out = {}
    for name, t in state.items():
        if name not in originals:
            # a scale held by an FP8 module ("keep"), under the checkpoint's own scale name
            kept = name.endswith(SCALE_SUFFIX) and name[:-len(SCALE_SUFFIX)] in state
            out[scheme.scale_key(name[:-len(SCALE_SUFFIX)]) if kept else name] = t
            continue
        q, s = originals[name]
        key = scheme.scale_key(name)
        if (t.dtype.is_floating_point and tuple(t.shape) == logical_shape(q)
                and torch.equal(dequantize(q, s, scheme.block, t.dtype), t)):
            out[name], out[key] = q, s
        elif is_fp4(q):
            packed, scale = quantize_fp4(t, scheme.ue8m0 or s.dtype != torch.float32, s.dtype)
            out[name], out[key] = packed.view(q.dtype), scale
        else:
            out[name], out[key] = quantize(t, scheme.block, scheme.ue8m0, s.dtype)
    return out
