"""4-bit (NF4 / FP4, bitsandbytes layout) frozen Linears inside a kiln model: the base of QLoRA.

`Linear4` holds its weight as the packed uint8 tensor bitsandbytes writes, (ceil(n / 2), 1), plus its
quant state as plain tensors (`weight_absmax`, `weight_quant_map`, `weight_nested_absmax`,
`weight_nested_quant_map`, and `weight_quant_state`: the JSON bytes), so every piece is an ordinary
tensor a sharding plan can move as bytes. Each matmul dequantizes the weight into the compute dtype
(bitsandbytes' `bnb_4bit_compute_dtype`): x is cast to it, y = x W^T + b, y cast back to x's dtype,
as bitsandbytes' Linear4bit computes on CPU. Under autograd only the packed weight is kept; the
backward dequantizes again. On CPU each matmul dequantizes (with the C op of kiln.kernels.dequant4 where
it builds) into one buffer per weight shape, reused by every layer and step (`matmul_weight`), rather than
into a fresh tensor.

On disk the quant-state tensors are `<m>.weight.absmax` etc. (kiln.hub.bnb4); `prepare_bnb4` renames
a checkpoint's tensors to the module's names on load and `Bnb4State.export` renames them back, so an
untouched 4-bit base exports byte for byte. `quantize_model` quantizes a loaded bf16/fp32 model's
Linears in place (`[model] quantize = "nf4" | "fp4"`); `dequantize_bnb4_model` undoes it for export.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard, TypeVar

import torch
from torch import nn
from torch.nn import functional as F

from kiln.constants import BASE_TASK
from kiln.errors import ConfigError, WeightsError
from kiln.hub import bnb4
from kiln.hub.bnb4 import Bnb4Scheme, Quant4
from kiln.models.common.typed import is_kiln_model

if TYPE_CHECKING:  # (it imports this module)
    from kiln.models.common.pretrained import PreTrainedModel

M = TypeVar("M", bound=nn.Module)

# module buffer name -> the suffix after `<m>.weight.` on disk (the quant state's suffix ends in its type)
BUFFERS = {"weight_absmax": "absmax", "weight_quant_map": "quant_map", "weight_nested_absmax": "nested_absmax",
           "weight_nested_quant_map": "nested_quant_map", "weight_quant_state": "quant_state"}
_ON_DISK = re.compile(r"^(.*)\.weight\.(absmax|quant_map|nested_absmax|nested_quant_map|"
                      r"quant_state\.bitsandbytes__(?:nf4|fp4))$")
_IN_MODEL = re.compile(r"^(.*)\.weight_(absmax|quant_map|nested_absmax|nested_quant_map|quant_state)$")


@dataclass(frozen=True)
class Q4Meta:
    """The non-tensor quant state of one weight (from its JSON), fixed for the module's life."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    quant_type: str
    blocksize: int
    offset: float | None
    nested_blocksize: int
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def of(cls, q: Quant4) -> Q4Meta:
        return cls(q.shape, q.dtype, q.quant_type, q.blocksize, q.offset, q.nested_blocksize, dict(q.extra))


def quant4_of(module: KeepsQuantState) -> Quant4:
    """The Quant4 a 4-bit module (Linear4, or a LoRA layer over one) holds."""
    m = module.q4
    if m is None:
        raise WeightsError(f"{type(module).__name__} holds no 4-bit weight (its q4 is None)")
    nested = m.offset is not None
    return Quant4(module.weight.data, module.weight_absmax, module.weight_quant_map, m.shape, m.dtype, m.quant_type,
                  m.blocksize, module.weight_nested_absmax if nested else None,
                  module.weight_nested_quant_map if nested else None, m.offset, m.nested_blocksize, dict(m.extra))


def dequantized(module: KeepsQuantState, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The module's weight in `dtype` (default: its compute dtype)."""
    return bnb4.dequantize(quant4_of(module), dtype or module.compute_dtype)


# packed bytes dequantized at a time into a matmul buffer by the torch path (the C kernel needs no temporaries
# and takes the weight whole): its temporaries (int32 indices, 8-byte value pairs) stay 6 MB whatever the
# weight's size (128 KB to 512 KB chunks ran alike here; 2 MB ones slower)
_CHUNK_BYTES = 1 << 19


class _Buffers(threading.local):
    """Per thread: one dequantized-weight buffer per (shape, dtype, device), kept for the thread's life (at
    bench_qlora's 1.2B Qwen3 shape: four weight shapes, 62 MB in bf16); temporaries: kiln.kernels.scratch."""

    def __init__(self) -> None:
        self.weights: dict[tuple, torch.Tensor] = {}


_BUFFERS = _Buffers()


@torch.no_grad()
def matmul_weight(module: KeepsQuantState, dtype: torch.dtype) -> torch.Tensor:
    """The module's weight dequantized in `dtype` for one matmul, valid until the next call on this thread:
    equal bit for bit to `dequantized`. On CPU it is written into a buffer kept per (shape, dtype) and reused
    by every weight of that shape (bnb4.dequantize with out=; chunk_bytes= for its torch path):
    a fresh (out, in) tensor and its float32 temporaries (6 bytes per weight) at every matmul left glibc's heap
    with hundreds of MB of freed blocks between the activations at the step's peak (glibc raises its mmap
    threshold after a large free, so later blocks of up to 32 MB come from the heap, whose holes it does not
    give back). The caller must not keep the tensor (the autograd Function below saves only the packed
    weight). Elsewhere (cuda's caching allocator reuses blocks) and under torch.compile a fresh tensor."""
    q = quant4_of(module)
    device = q.packed.device
    if device.type != "cpu" or torch.compiler.is_compiling():
        return bnb4.dequantize(q, dtype)
    key = (tuple(q.shape), dtype, device)
    out = _BUFFERS.weights.get(key)
    if out is None:
        with torch.inference_mode(False):  # a normal tensor, writable in and out of inference mode
            out = _BUFFERS.weights[key] = torch.empty(q.shape, dtype=dtype, device=device)
    return bnb4.dequantize(q, dtype, out=out, chunk_bytes=_CHUNK_BYTES)


class _Linear4Fn(torch.autograd.Function):
    """y = x W^T + b with W dequantized from 4 bits; nothing but the packed weight is kept for backward."""

    @staticmethod
    def forward(ctx, x, bias, module):
        ctx.module, ctx.bias_grad = module, bias is not None and bias.requires_grad
        return F.linear(x, matmul_weight(module, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad):
        gx = grad @ matmul_weight(ctx.module, grad.dtype)
        gb = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.bias_grad else None
        return gx, gb, None


def linear4(x: torch.Tensor, module: KeepsQuantState) -> torch.Tensor:
    """bitsandbytes' Linear4bit on CPU: x to the compute dtype, x W^T + b there, back to x's dtype."""
    in_dtype = x.dtype
    x = x.to(module.compute_dtype)
    bias = module.bias.to(x.dtype) if module.bias is not None else None
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        y = _Linear4Fn.apply(x, bias, module)
    else:  # nothing is recorded for backward: the buffer is free again after the matmul
        y = F.linear(x, matmul_weight(module, x.dtype), bias)
    return y.to(in_dtype)


class KeepsQuantState(nn.Linear):
    """A cast of the model (`.to(bfloat16)`) only moves the quant-state tensors: rounding a float32 absmax or
    code table to bf16 would change the weight. Mixed into Linear4 and the LoRA layer over it, it declares what
    a Linear holding a 4-bit weight carries: the quant state's fixed part, the compute dtype, the state's tensors
    (buffers; the nested two only with double quantization)."""

    q4: Q4Meta | None  # None: a LoRA layer over a plain weight
    compute_dtype: torch.dtype
    weight_absmax: torch.Tensor
    weight_quant_map: torch.Tensor
    weight_nested_absmax: torch.Tensor
    weight_nested_quant_map: torch.Tensor
    weight_quant_state: torch.Tensor

    def _apply(self, fn, recurse=True):
        bufs = {n: self._buffers.pop(n) for n in list(self._buffers) if n in BUFFERS}
        super()._apply(fn, recurse)
        for n, b in bufs.items():
            if b is not None:  # where fn sends a tensor of this dtype; never what it would cast it to
                device = fn(torch.empty(0, dtype=b.dtype, device=b.device)).device
                b = torch.empty_like(b, device=device) if b.is_meta and device.type != "meta" else b.to(device)
            self._buffers[n] = b
        return self


class Linear4(KeepsQuantState, nn.Linear):
    """A frozen Linear stored in 4 bits (bitsandbytes layout), computed in `compute_dtype`."""

    q4: Q4Meta  # always 4-bit

    def __init__(self, in_features: int, out_features: int, bias: bool, meta: Q4Meta,
                 compute_dtype: torch.dtype = torch.float32, bias_dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, state_bytes: int = 0):
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.q4, self.compute_dtype = meta, compute_dtype
        n = in_features * out_features
        blocks = -(-n // meta.blocksize)
        nested = meta.offset is not None
        self.weight = nn.Parameter(torch.empty(-(-n // 2), 1, dtype=torch.uint8, device=device), requires_grad=False)
        self.register_buffer("weight_absmax", torch.empty(blocks, dtype=torch.uint8 if nested else torch.float32,
                                                          device=device))
        self.register_buffer("weight_quant_map", torch.empty(16, dtype=torch.float32, device=device))
        if nested:
            self.register_buffer("weight_nested_absmax", torch.empty(-(-blocks // meta.nested_blocksize),
                                                                     dtype=torch.float32, device=device))
            self.register_buffer("weight_nested_quant_map", torch.empty(256, dtype=torch.float32, device=device))
        self.register_buffer("weight_quant_state", torch.empty(state_bytes, dtype=torch.uint8, device=device))
        # (no bias: None, as nn.Linear holds it; torch types the attribute as a Parameter only)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=bias_dtype or compute_dtype,  # type: ignore[assignment]
                                             device=device), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear4(x, self)

    def load_quant4(self, q: Quant4) -> None:
        """Take `q`'s tensors as this module's (no copy)."""
        tensors = q.tensors("w")
        self.weight = nn.Parameter(q.packed, requires_grad=False)
        for buf, suffix in BUFFERS.items():
            key = f"w.{bnb4.STATE_PREFIX}{q.quant_type}" if suffix == "quant_state" else f"w.{suffix}"
            if key in tensors:
                self._buffers[buf] = tensors[key]

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, {self.q4.quant_type} blocks of {self.q4.blocksize}"
                f"{' (double quant)' if self.q4.offset is not None else ''}, compute {self.compute_dtype}")


def is_4bit(module: nn.Module) -> TypeGuard[KeepsQuantState]:
    return getattr(module, "q4", None) is not None


# ---- load ------------------------------------------------------------------------------------------------
def to_model_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names -> module names for the quant-state tensors (`<m>.weight.absmax` -> `<m>.weight_absmax`)."""
    out = {}
    for k, v in state.items():
        m = _ON_DISK.match(k)
        out[f"{m.group(1)}.weight_{m.group(2).split('.')[0]}" if m else k] = v
    return out


def _swap(model: nn.Module, module_name: str, new: nn.Module) -> None:
    parent_name, _, leaf = module_name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, leaf, new)


@dataclass
class Bnb4State:
    """What a model with a 4-bit base needs to write it back: the scheme, and the on-disk names."""
    scheme: Bnb4Scheme

    def export(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Module names -> bitsandbytes' names for the quant-state tensors, tensors as held (no copy)."""
        out = {}
        for k, v in hf.items():
            m = _IN_MODEL.match(k)
            if m is None:
                out[k] = v
            elif m.group(2) == "quant_state":
                quant_type = json.loads(bytes(v.tolist()).decode("utf-8"))["quant_type"]
                out[f"{m.group(1)}.weight.{bnb4.STATE_PREFIX}{quant_type}"] = v
            else:
                out[f"{m.group(1)}.weight.{m.group(2)}"] = v
        return out


def prepare_bnb4(model: PreTrainedModel, state: dict[str, torch.Tensor], scheme: Bnb4Scheme,
                 source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Ready a meta-device model for a bitsandbytes-4bit state dict: the Linears holding 4-bit weights
    become `Linear4`; returns the state dict under the module's tensor names."""
    quants, _ = bnb4.split_state(state, source)
    names = model.normalise_hf_names(state)
    keymap = model.family.keymap(model.task)
    for hf_name, q in quants.items():
        kiln = keymap.kiln_name(names[hf_name][0])
        module_name, _, attr = (kiln or "").rpartition(".")
        module = model.get_submodule(module_name) if module_name else None
        if not isinstance(module, nn.Linear) or attr != "weight":
            raise WeightsError(f"{source}: 4-bit tensor {hf_name!r} is not the weight of a Linear layer of this "
                               f"{model.family.model_type} model; kiln holds 4-bit weights in Linears only")
        if tuple(q.shape) != (module.out_features, module.in_features):
            raise WeightsError(f"{source}: 4-bit tensor {hf_name!r} has quant-state shape {list(q.shape)}, but this "
                               f"model's Linear expects {[module.out_features, module.in_features]}")
        bias = state.get(hf_name[:-len("weight")] + "bias")
        _swap(model, module_name, Linear4(module.in_features, module.out_features, module.bias is not None,
                                          Q4Meta.of(q), scheme.compute_dtype,
                                          bias.dtype if bias is not None else None, device="meta",
                                          state_bytes=state[_state_key(hf_name, state, source)].numel()))
    model.bnb4_state = Bnb4State(scheme)
    return to_model_names(state)


def _state_key(hf_name: str, state: dict[str, torch.Tensor], source: str) -> str:
    """The key of the quant state (JSON bytes) of 4-bit weight `hf_name` in `state`."""
    key = bnb4.state_key(hf_name, state)
    if key is None:
        raise WeightsError(f"{source}: 4-bit tensor {hf_name!r} has no quant state "
                           f"({hf_name}.{bnb4.STATE_PREFIX}<nf4|fp4>)")
    return key


def prepare_bnb4_modules(model: PreTrainedModel, state: dict[str, torch.Tensor], scheme: Bnb4Scheme,
                         source: str = "checkpoint") -> None:
    """Ready a meta-device model for a state dict under its own module names (a sharded checkpoint of a 4-bit
    base): each Linear whose quant state `state` holds (`<m>.weight_quant_state`, `<m>.weight_absmax`, ...;
    `<m>.weight` may be a meta tensor of the packed shape) becomes `Linear4` on meta."""
    quants, _ = bnb4.split_state(Bnb4State(scheme).export(state), source)
    for name, q in quants.items():
        module_name = name.rpartition(".")[0]
        module = model.get_submodule(module_name)
        if not isinstance(module, nn.Linear) or tuple(q.shape) != (module.out_features, module.in_features):
            raise WeightsError(f"{source}: 4-bit tensor {name!r} (shape {list(q.shape)}) is not the weight of a "
                               f"Linear layer of this {model.family.model_type} model")
        _swap(model, module_name, Linear4(module.in_features, module.out_features, module.bias is not None,
                                          Q4Meta.of(q), scheme.compute_dtype,
                                          module.bias.dtype if module.bias is not None else None, device="meta",
                                          state_bytes=state[f"{module_name}.weight_quant_state"].numel()))
    model.bnb4_state = Bnb4State(scheme)


# ---- quantize / dequantize a loaded model ---------------------------------------------------------------
def quantizable(model: nn.Module) -> list[str]:
    """The Linears `quantize_model` turns 4-bit: every Linear of the backbone (not task heads, not lm_head),
    as transformers' bitsandbytes quantizer converts them."""
    prefix = "" if getattr(model, "task", BASE_TASK) == BASE_TASK else "model."
    return [n for n, m in model.named_modules() if type(m) is nn.Linear and n.startswith(prefix)
            and n.rsplit(".", 1)[-1] != "lm_head"]


@torch.no_grad()
def quantize_model(model: PreTrainedModel, quant_type: str, double_quant: bool = True,
                   compute_dtype: torch.dtype | None = None, source: str = "model") -> list[str]:
    """Quantize the model's backbone Linears to 4 bits in place (bitsandbytes' bytes); returns their names."""
    bnb4.check_quant_type(quant_type, "quantize")
    if model.bnb4_state is not None or any(is_4bit(m) for m in model.modules()):
        raise ConfigError(f"{source} is already 4-bit quantized (bitsandbytes); drop `quantize`, it loads 4-bit "
                          "as it is")
    if model.fp8_state is not None:
        raise ConfigError(f"{source} is an FP8 checkpoint; 4-bit quantization takes bf16/fp16/fp32 weights")
    names = quantizable(model)
    if not names:
        raise ConfigError(f"{source}: no Linear layers to quantize")
    dtype = compute_dtype or _linear(model, names[0]).weight.dtype
    for name in names:
        module = _linear(model, name)
        q = bnb4.quantize(module.weight.detach(), quant_type, bnb4.BLOCKSIZE, double_quant)
        new = Linear4(module.in_features, module.out_features, module.bias is not None, Q4Meta.of(q), dtype,
                      module.bias.dtype if module.bias is not None else None, device="meta")
        new.load_quant4(q)
        if module.bias is not None:
            new.bias = nn.Parameter(module.bias.detach(), requires_grad=False)
        _swap(model, name, new)
    scheme = Bnb4Scheme(quant_type, double_quant, dtype)
    model.bnb4_state = Bnb4State(scheme)
    config = getattr(model, "config", None)
    if config is not None:
        config.extra["quantization_config"] = scheme.to_config()
    return names


def _linear(model: nn.Module, name: str) -> nn.Linear:
    """The Linear `quantizable` named."""
    module = model.get_submodule(name)
    if not isinstance(module, nn.Linear):
        raise ConfigError(f"{name}: a {type(module).__name__}, not the Linear layer 4-bit quantization takes")
    return module


@torch.no_grad()
def dequantize_bnb4_model(model: M, dtype: torch.dtype | None = None) -> M:
    """Drop 4 bits from a model: 4-bit Linears become plain ones in `dtype` (default: the dtype each weight
    was quantized from, its quant state's `dtype`),
    LoRA layers over them keep their adapters over the dequantized weight; `quantization_config` goes."""
    for name, module in list(model.named_modules()):
        if not is_4bit(module) or module.q4 is None:  # (is_4bit: q4 is not None)
            continue
        w = dequantized(module, dtype or module.q4.dtype)
        if isinstance(module, Linear4):
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                              device=w.device, dtype=w.dtype)
            plain.weight.copy_(w)
            if module.bias is not None:
                plain.bias.copy_(module.bias)
            plain.requires_grad_(False)
            _swap(model, name, plain)
        else:  # a LoRA layer over a 4-bit base: the base weight becomes the dequantized one
            for buf in BUFFERS:
                module._buffers.pop(buf, None)
            module.weight = nn.Parameter(w, requires_grad=False)
            module.q4 = None
    if is_kiln_model(model):  # (a plain module holds no bnb4_state nor config)
        model.bnb4_state = None
        if getattr(model, "config", None) is not None:
            model.config.dequantized(dtype)
    return model
