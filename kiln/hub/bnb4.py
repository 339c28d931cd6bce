"""bitsandbytes 4-bit (NF4 / FP4) weights on disk: the format, quantize and dequantize, in plain torch.

A weight W (any shape, n elements) is cut, flattened, into blocks of `blocksize` (64) values; the last
block may be partial. Each block keeps its absmax; each value becomes the 4-bit index of the nearest
entry of a 16-value code (NF4: normal quantiles; FP4: a tiny float) applied to value / absmax. Two
indices share a byte, the first in the high nibble. With double quantization (bitsandbytes'
`bnb_4bit_use_double_quant`, on by default here) the float32 absmax vector itself is stored as
bytes: its mean (`nested_offset`) is subtracted and the rest quantized blockwise (256 per block) to
the nearest entry of bitsandbytes' 8-bit dynamic code.

One quantized HF weight `<m>.weight` is six tensors on disk, as transformers saves them:
`<m>.weight` (packed uint8, (ceil(n/2), 1)), `.absmax` (float32, or uint8 when nested),
`.quant_map` (the 16-entry code), `.nested_absmax`, `.nested_quant_map` (when nested) and
`.quant_state.bitsandbytes__<type>` (the JSON of shape, dtype, blocksize and offset, as bytes);
config.json says `quantization_config.quant_method = "bitsandbytes"`.

The arithmetic follows bitsandbytes 0.50's CPU path exactly, so bytes and dequantized values are
equal to its own: 4-bit: full blocks scaled by value * (1 / absmax), a partial block by value / absmax,
clamped to [-1, 1], index = bucket among the code's sorted midpoints (a value on a midpoint takes the
lower entry); 8-bit nested: value / absmax, the nearest code entry with ties to the lower one.
Dequantization is code[index] * absmax in float32 (nested absmax: code[byte] * nested_absmax + offset,
two roundings), rounded once to the output dtype.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.errors import ConfigError, WeightsError
from kiln.kernels import dequant4 as native4

QUANT_TYPES = ("nf4", "fp4")
BLOCKSIZE = 64
NESTED_BLOCKSIZE = 256
# the tensors one quantized weight adds beside `<m>.weight` (the quant-state one ends in its type)
PARTS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
STATE_PREFIX = "quant_state.bitsandbytes__"

# NF4: the 16 quantiles of N(0, 1) of the QLoRA paper, scaled to [-1, 1] (bitsandbytes' table)
_NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
        -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
        0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
        0.7229568362236023, 1.0]
# FP4 (1 sign, 2 exponent, 1 mantissa bit, bias 2) in index order: index 8..15 are the negatives; index 8
# (negative zero) is +0.0 in bitsandbytes' table (an integer 0 there), so its quant_map and values have +0
_FP4 = [0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, 0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0]
# FP4 indices in ascending value order. index 0 and index 8 (both 0) tie: bitsandbytes' sort puts +0
# first, so an exact zero takes index 0 and a tiny positive value the midpoint above, i.e. index 8
_FP4_ORDER = [11, 10, 13, 12, 15, 14, 9, 0, 8, 1, 6, 7, 4, 5, 2, 3]


def code4(quant_type: str) -> torch.Tensor:
    """The 16-entry float32 code of `quant_type` ("nf4" or "fp4"), in index order, max |entry| = 1."""
    check_quant_type(quant_type)
    data = torch.tensor(_NF4 if quant_type == "nf4" else _FP4, dtype=torch.float32)
    return data / data.abs().max()


def check_quant_type(quant_type: Any, source: str = "quant type") -> str:
    if quant_type not in QUANT_TYPES:
        raise ConfigError(f"{source}: unknown 4-bit quant type {quant_type!r}; choose one of: {', '.join(QUANT_TYPES)}")
    return quant_type


def dynamic_code() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic code (256 float32 values, sorted), used for nested absmax.

    For exponent level i = 0..6, 2**i fraction steps: the midpoints of linspace(0.1, 1, 2**i + 1)
    times 10**(i - 6), with both signs; then 0 and 1.
    """
    values: list[float] = []
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        scale = 10 ** (i - 6)
        values += (scale * mids).tolist() + (-scale * mids).tolist()
    values += [0.0, 1.0]
    return torch.tensor(sorted(values), dtype=torch.float32)


@dataclass
class Quant4:
    """One 4-bit weight: packed bytes + its quant state (all plain tensors, so they can be moved as bytes)."""
    packed: torch.Tensor              # uint8 (ceil(n / 2), 1)
    absmax: torch.Tensor              # float32 (blocks,), or uint8 (blocks,) when nested
    code: torch.Tensor                # float32 (16,)
    shape: tuple[int, ...]
    dtype: torch.dtype                # the dtype it was quantized from (dequantize's default)
    quant_type: str = "nf4"
    blocksize: int = BLOCKSIZE
    nested_absmax: torch.Tensor | None = None   # float32 (ceil(blocks / 256),)
    nested_code: torch.Tensor | None = None     # float32 (256,)
    offset: float | None = None                 # nested_offset: the mean subtracted from absmax
    nested_blocksize: int = NESTED_BLOCKSIZE
    extra: dict[str, Any] = field(default_factory=dict)  # unknown quant-state keys, kept for the way back

    @property
    def nested(self) -> bool:
        return self.nested_absmax is not None

    def state_json(self) -> dict[str, Any]:
        """The quant-state dict packed into `quant_state.bitsandbytes__<type>`, in bitsandbytes' key order."""
        out: dict[str, Any] = {"quant_type": self.quant_type, "blocksize": self.blocksize,
                               "dtype": str(self.dtype).removeprefix("torch."), "shape": list(self.shape)}
        if self.nested:
            out.update(nested_blocksize=self.nested_blocksize, nested_dtype="float32", nested_offset=self.offset)
        out.update(self.extra)
        return out

    def tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The HF tensors of weight `name` (e.g. `model.layers.0.mlp.up_proj.weight`)."""
        out = {name: self.packed, f"{name}.absmax": self.absmax, f"{name}.quant_map": self.code}
        if self.nested:
            out[f"{name}.nested_absmax"] = self.nested_absmax
            out[f"{name}.nested_quant_map"] = self.nested_code
        raw = json.dumps(self.state_json()).encode("utf-8")
        out[f"{name}.{STATE_PREFIX}{self.quant_type}"] = torch.tensor(list(raw), dtype=torch.uint8)
        return out


# ---- quantize ------------------------------------------------------------------------------------------
def _blocks_absmax(flat: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, int]:
    n = flat.numel()
    full = n - n % blocksize
    return flat[:full].reshape(-1, blocksize).abs().amax(dim=1), full


_LUT_SIZE = 65536
_LUTS: dict[tuple, torch.Tensor] = {}  # (code's values, device) -> its table: one per code, not one per weight


def _lut8(code: torch.Tensor) -> torch.Tensor:
    """bitsandbytes' CPU 8-bit lookup: [-1, 1] cut into 65536 points, each mapped to the first code entry
    whose upper midpoint is not below it (so the nearest entry, to within one step of 2 / 65535). Built once
    per code (~70 ms) and kept, keyed on its values and device."""
    key = (tuple(code.tolist()), str(code.device))
    lut = _LUTS.get(key)
    if lut is None:
        mids = 0.5 * (code[:-1] + code[1:])
        points = -1.0 + (2.0 * torch.arange(_LUT_SIZE, dtype=torch.float32, device=code.device)) / (_LUT_SIZE - 1)
        with torch.inference_mode(False):
            lut = _LUTS[key] = torch.searchsorted(mids, points, side="left").to(torch.uint8)
    return lut


def quantize_blockwise8(x: torch.Tensor, code: torch.Tensor, blocksize: int = NESTED_BLOCKSIZE
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 indices, float32 per-block absmax) of float32 `x` against the sorted 8-bit `code`.

    As bitsandbytes' CPU kernel: value * (1 / absmax), clamped, then the lookup-table bin
    trunc(((v + 1) * 0.5) * 65535 + 0.5), each step rounded in float32; an all-zero block gives zeros.
    """
    flat = x.reshape(-1).float()
    n = flat.numel()
    blocks = -(-n // blocksize)
    absmax = torch.empty(blocks, dtype=torch.float32)
    head, full = _blocks_absmax(flat, blocksize)
    absmax[:head.numel()] = head
    if full < n:
        absmax[-1] = flat[full:].abs().amax()
    inv = (1.0 / absmax).repeat_interleave(blocksize)[:n]
    v = torch.clamp(flat * inv, -1.0, 1.0)
    bins = ((((v + 1.0) * 0.5) * (_LUT_SIZE - 1)) + 0.5).to(torch.int64)  # .to truncates toward zero
    out = _lut8(code)[bins.clamp(0, _LUT_SIZE - 1)]
    zero = (absmax == 0).repeat_interleave(blocksize)[:n]
    return torch.where(zero, torch.zeros_like(out), out), absmax


def quantize(weight: torch.Tensor, quant_type: str = "nf4", blocksize: int = BLOCKSIZE,
             double_quant: bool = True) -> Quant4:
    """Quantize `weight` (bf16, fp16 or fp32) to 4 bits as bitsandbytes' `quantize_4bit` does (CPU)."""
    check_quant_type(quant_type)
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise WeightsError(f"4-bit quantization takes bf16, fp16 or fp32 weights, got {weight.dtype}")
    code = code4(quant_type)
    order = torch.arange(16) if quant_type == "nf4" else torch.tensor(_FP4_ORDER)
    ordered = code[order]
    bounds = (ordered[:-1] + ordered[1:]) / 2
    flat = weight.detach().reshape(-1).float()
    n = flat.numel()
    absmax, full = _blocks_absmax(flat, blocksize)
    scaled = torch.clamp(flat[:full].reshape(-1, blocksize) * (1.0 / absmax.clamp(min=1e-38)).view(-1, 1),
                         -1, 1).reshape(-1)
    if full < n:  # the partial last block divides (bitsandbytes' order); its absmax is kept clamped
        last = flat[full:].abs().amax().clamp(min=1e-38)
        absmax = torch.cat([absmax, last.unsqueeze(0)])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / last, -1, 1)])
    if scaled.numel() % 2:
        scaled = torch.nn.functional.pad(scaled, (0, 1))
    idx = order[torch.bucketize(scaled, bounds)].to(torch.uint8)
    packed = ((idx[0::2] << 4) | idx[1::2]).unsqueeze(1)
    q = Quant4(packed, absmax, code, tuple(weight.shape), weight.dtype, quant_type, blocksize)
    if double_quant:
        offset = absmax.mean()
        nested_code = dynamic_code()
        q.absmax, q.nested_absmax = quantize_blockwise8(absmax - offset, nested_code)
        q.nested_code, q.offset = nested_code, offset.item()
    return q


# ---- dequantize ------------------------------------------------------------------------------------------
def block_absmax(q: Quant4) -> torch.Tensor:
    """The float32 absmax of every 4-bit block (undoing the nested quantization when there is one)."""
    if not q.nested:
        return q.absmax.float()
    scale = q.nested_absmax.repeat_interleave(q.nested_blocksize)[:q.absmax.numel()]
    return q.nested_code[q.absmax.long()] * scale + torch.tensor(q.offset, dtype=torch.float32)


def _code_pairs(code: torch.Tensor) -> torch.Tensor:
    """byte -> its two float32 code values (high nibble first) read as one 8-byte word: one gather per byte
    instead of two shifts and two gathers."""
    return torch.stack([code.repeat_interleave(16), code.repeat(16)], dim=1).contiguous().view(torch.int64).reshape(-1)


class _Scratch(threading.local):
    """Per thread: the temporaries of a chunked `dequantize` (byte indices, value pairs, block absmax),
    grown to the largest chunk asked for and kept, so a weight dequantized at every matmul allocates nothing."""

    def __init__(self):
        self.index = torch.empty(0, dtype=torch.int32)
        self.pairs = torch.empty(0, dtype=torch.int64)
        self.absmax = torch.empty(0, dtype=torch.float32)


_SCRATCH = _Scratch()


def _temporaries(blocks: int, half: int, device: torch.device, keep: bool):
    if not keep:
        return (torch.empty(blocks * half, dtype=torch.int32, device=device),
                torch.empty(blocks * half, dtype=torch.int64, device=device),
                torch.empty(blocks, dtype=torch.float32, device=device))
    s = _SCRATCH
    if s.index.numel() < blocks * half or s.absmax.numel() < blocks:
        with torch.inference_mode(False):  # plain tensors, usable in and out of inference mode
            s.index = torch.empty(blocks * half, dtype=torch.int32)
            s.pairs = torch.empty(blocks * half, dtype=torch.int64)
            s.absmax = torch.empty(blocks, dtype=torch.float32)
    return s.index, s.pairs, s.absmax


def dequantize(q: Quant4, dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
               chunk_bytes: int | None = None) -> torch.Tensor:
    """The weight back in `dtype` (default: the dtype it was quantized from), as `dequantize_4bit` gives it:
    float32 code value * float32 block absmax, rounded once to `dtype`.

    Written into `out` when given (a tensor of the weight's shape and `dtype`), else into a new tensor.
    On CPU the C kernel of kiln.hub.native4 writes it in one pass (no temporaries); without it (KILN_NATIVE=0,
    no C compiler, another device) these torch ops do, and `chunk_bytes` (CPU) has them take that many packed
    bytes (whole nested-absmax groups) at a time, through temporaries kept per thread (about 14 x chunk_bytes),
    so neither their size nor any allocation grows with the weight; without it the whole weight is one chunk
    and its temporaries are fresh. The values are the same every way.
    """
    n = 1
    for s in q.shape:
        n *= s
    dtype = dtype or q.dtype
    device = q.packed.device
    if out is None:
        out = torch.empty(q.shape, dtype=dtype, device=device)
    assert out.dtype == dtype and out.numel() == n and out.is_contiguous(), "dequantize: out must fit the weight"
    if native4.dequantize4(q.packed, n, q.blocksize, q.code, q.absmax, q.nested_absmax, q.nested_code,
                           q.nested_blocksize, q.offset, out):
        return out  # the fused C kernel (kiln.hub.native4): same values, one pass, no temporaries
    table, packed, flat = _code_pairs(q.code.to(device)), q.packed.reshape(-1), out.view(-1)
    bs = q.blocksize
    if bs % 2:  # blocks that split a byte: the whole weight at once, absmax repeated per value
        values = torch.index_select(table, 0, packed.to(torch.int32)).view(torch.float32)[:n]
        torch.mul(values, block_absmax(q).to(device).repeat_interleave(bs)[:n], out=flat)
        return out
    half, blocks = bs // 2, -(-n // bs)  # packed bytes per block; blocks, the last maybe partial
    group = q.nested_blocksize if q.nested else 1  # blocks sharing one nested absmax
    keep = chunk_bytes is not None and device.type == "cpu"
    step = blocks if chunk_bytes is None else max(group, chunk_bytes // half // group * group)  # blocks per chunk
    index, pairs, absmax = _temporaries(min(step, blocks), half, device, keep)
    offset = torch.tensor(q.offset, dtype=torch.float32, device=device) if q.nested else None
    code8 = q.nested_code.to(device) if q.nested else None
    for b0 in range(0, blocks, step):
        b1 = min(b0 + step, blocks)
        k, nbytes, nvals = b1 - b0, min(b1 * half, packed.numel()) - b0 * half, min(b1 * bs, n) - b0 * bs
        a = absmax[:k]
        if q.nested:  # block_absmax for these blocks: code8[byte] * nested absmax of its group, + offset
            whole = k // group * group
            index[:k].copy_(q.absmax[b0:b1])
            torch.index_select(code8, 0, index[:k], out=a)
            g0 = b0 // group
            a[:whole].view(-1, group).mul_(q.nested_absmax[g0:g0 + whole // group].view(-1, 1))
            if whole < k:
                a[whole:].mul_(q.nested_absmax[g0 + whole // group])
            a.add_(offset)
        else:
            a.copy_(q.absmax[b0:b1])
        index[:nbytes].copy_(packed[b0 * half:b0 * half + nbytes])
        values = torch.index_select(table, 0, index[:nbytes], out=pairs[:nbytes]).view(torch.float32)
        dst = flat[b0 * bs:b0 * bs + nvals]
        full = nvals // bs * bs  # values of whole blocks here; the weight's last block may be partial
        if full:
            v, a_full = values[:full].view(-1, bs), a[:full // bs].view(-1, 1)
            if dtype == torch.float32:
                torch.mul(v, a_full, out=dst[:full].view(-1, bs))
            else:  # the float32 product in place, then rounded once as it is copied: no third buffer
                dst[:full].view(-1, bs).copy_(v.mul_(a_full))
        if full < nvals:
            torch.mul(values[full:nvals], a[-1], out=dst[full:])
    return out


# ---- state dicts -----------------------------------------------------------------------------------------
def state_key(name: str, tensors) -> str | None:
    """The `<name>.quant_state.bitsandbytes__<type>` key present in `tensors`, if any."""
    return next((f"{name}.{STATE_PREFIX}{t}" for t in QUANT_TYPES if f"{name}.{STATE_PREFIX}{t}" in tensors), None)


def quantized_names(state: dict[str, torch.Tensor]) -> list[str]:
    """Names of the 4-bit weights of an HF state dict: uint8 tensors with a `.absmax` or a quant state."""
    names = set()
    for k in state:
        for suffix in (".absmax", ".quant_map"):
            if k.endswith(suffix):
                names.add(k[:-len(suffix)])
        if f".{STATE_PREFIX}" in k:
            names.add(k.split(f".{STATE_PREFIX}")[0])
    return sorted(names)


def read_quant4(state: dict[str, torch.Tensor], name: str, source: str = "checkpoint") -> Quant4:
    """The Quant4 of weight `name` from an HF state dict; a missing or malformed part is named."""
    where = f"{source}: 4-bit weight {name!r}"
    if name not in state:
        raise WeightsError(f"{where} has quant-state tensors but no packed tensor {name!r}")
    key = state_key(name, state)
    if key is None:
        raise WeightsError(f"{where} has no quant-state tensor '{name}.{STATE_PREFIX}nf4' (or ...fp4); "
                           "bitsandbytes writes one beside every 4-bit weight")
    try:
        raw = json.loads(bytes(state[key].to(torch.uint8).tolist()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{source}: tensor {key!r} is not bitsandbytes' packed quant-state JSON ({e})") from None
    nested = "nested_offset" in raw or "nested_blocksize" in raw
    needed = ["absmax", "quant_map"] + (["nested_absmax", "nested_quant_map"] if nested else [])
    missing = [f"{name}.{p}" for p in needed if f"{name}.{p}" not in state]
    if missing:
        raise WeightsError(f"{where}: missing quant-state tensor(s) {', '.join(repr(m) for m in missing)}")
    try:
        quant_type = check_quant_type(raw["quant_type"], key)
        shape = tuple(int(s) for s in raw["shape"])
        dtype = getattr(torch, raw.get("dtype", "float32"))
        blocksize = int(raw["blocksize"])
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise WeightsError(f"{source}: quant state {key!r} is incomplete or malformed ({e!r}): {raw}") from None
    known = {"quant_type", "shape", "dtype", "blocksize", "nested_blocksize", "nested_dtype", "nested_offset"}
    q = Quant4(state[name].to(torch.uint8).reshape(-1, 1) if state[name].dtype != torch.uint8 else state[name],
               state[f"{name}.absmax"], state[f"{name}.quant_map"], shape, dtype, quant_type, blocksize,
               extra={k: v for k, v in raw.items() if k not in known})
    if nested:
        q.nested_absmax, q.nested_code = state[f"{name}.nested_absmax"], state[f"{name}.nested_quant_map"]
        q.offset, q.nested_blocksize = float(raw["nested_offset"]), int(raw.get("nested_blocksize", NESTED_BLOCKSIZE))
    _check_finite(q, name, source)
    n = 1
    for s in shape:
        n *= s
    blocks = -(-n // blocksize)
    if q.packed.numel() != -(-n // 2) or q.absmax.numel() != blocks:
        raise WeightsError(f"{where}: packed {tuple(q.packed.shape)} and absmax {tuple(q.absmax.shape)} do not fit "
                           f"shape {list(shape)} in blocks of {blocksize} (want {-(-n // 2)} bytes, {blocks} blocks)")
    return q


def refuse_non_finite(t: torch.Tensor, key: str, source: str) -> None:
    """A WeightsError naming quant-state tensor `key` when it holds a non-finite value (a read piece of one too:
    the sharded and planned loads read the parts straight into their buffers)."""
    if not t.is_floating_point() or t.device.type == "meta":
        return
    bad = ~torch.isfinite(t.reshape(-1))
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise WeightsError(f"{source}: quant-state tensor '{key}' holds {int(bad.sum())} non-finite "
                           f"value(s) (the first at index {i}: {t.reshape(-1)[i].item()}); every weight of its "
                           "blocks would be non-finite. The file is damaged: quantize the model again")


def _check_finite(q: Quant4, name: str, source: str) -> None:
    """The float parts of a quant state are finite: one NaN in a (nested) absmax makes every weight of its
    blocks NaN, so every step would be skipped as non-finite without saying why."""
    parts = {"absmax": q.absmax, "quant_map": q.code, "nested_absmax": q.nested_absmax,
             "nested_quant_map": q.nested_code}
    for part, t in parts.items():
        if t is not None:
            refuse_non_finite(t, f"{name}.{part}", source)
    if q.offset is not None and not math.isfinite(q.offset):
        raise WeightsError(f"{source}: 4-bit weight {name!r}: nested_offset is {q.offset}, not a finite number")


def split_state(state: dict[str, torch.Tensor], source: str = "checkpoint"
                ) -> tuple[dict[str, Quant4], dict[str, torch.Tensor]]:
    """({weight name: Quant4}, the other tensors) of a bitsandbytes-4bit HF state dict."""
    quants = {name: read_quant4(state, name, source) for name in quantized_names(state)}
    taken = set()
    for name, q in quants.items():
        taken.update(q.tensors(name))
    return quants, {k: v for k, v in state.items() if k not in taken}


# ---- config ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bnb4Scheme:
    """What `quantization_config` says about a bitsandbytes 4-bit checkpoint."""
    quant_type: str = "nf4"
    double_quant: bool = True
    compute_dtype: torch.dtype = torch.float32
    skip_modules: tuple[str, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False)  # as read, written back verbatim

    def to_config(self) -> dict[str, Any]:
        if self.raw:
            return dict(self.raw)
        return {"quant_method": "bitsandbytes", "_load_in_4bit": True, "_load_in_8bit": False,
                "load_in_4bit": True, "load_in_8bit": False, "bnb_4bit_quant_type": self.quant_type,
                "bnb_4bit_use_double_quant": self.double_quant,
                "bnb_4bit_compute_dtype": str(self.compute_dtype).removeprefix("torch."),
                "bnb_4bit_quant_storage": "uint8", "llm_int8_enable_fp32_cpu_offload": False,
                "llm_int8_has_fp16_weight": False, "llm_int8_skip_modules": list(self.skip_modules) or None,
                "llm_int8_threshold": 6.0}


def is_bnb4_config(raw: dict[str, Any]) -> bool:
    q = raw.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "bitsandbytes"


def bnb4_scheme_from_config(raw: dict[str, Any], source: str = "config.json") -> Bnb4Scheme | None:
    """The scheme of a config.json dict with a bitsandbytes quantization_config, else None."""
    if not is_bnb4_config(raw):
        return None
    q = raw["quantization_config"]
    where = f"{source}: quantization_config"
    if not (q.get("load_in_4bit") or q.get("_load_in_4bit")):
        raise ConfigError(f"{where} is bitsandbytes 8-bit (load_in_8bit); kiln reads 4-bit (load_in_4bit) "
                          "checkpoints only")
    storage = q.get("bnb_4bit_quant_storage", "uint8")
    if storage != "uint8":
        raise ConfigError(f"{where}.bnb_4bit_quant_storage {storage!r} is not supported; only 'uint8' is")
    quant_type = check_quant_type(q.get("bnb_4bit_quant_type", "fp4"), f"{where}.bnb_4bit_quant_type")
    cdt = q.get("bnb_4bit_compute_dtype") or "float32"
    compute = getattr(torch, str(cdt).removeprefix("torch."), None)
    if compute not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"{where}.bnb_4bit_compute_dtype {cdt!r} is not one of float32, bfloat16, float16")
    skip = q.get("llm_int8_skip_modules") or []
    if not isinstance(skip, list) or not all(isinstance(m, str) for m in skip):
        raise ConfigError(f"{where}.llm_int8_skip_modules must be a list of module names, got {skip!r}")
    return Bnb4Scheme(quant_type, bool(q.get("bnb_4bit_use_double_quant", False)), compute, tuple(skip), dict(q))
