"""FP8 checkpoint weights inside a kiln model: dequantized at load, or kept FP8 and dequantized per matmul.

Two modes for a block-scaled FP8 directory (kiln.hub.fp8):
- "dequantize": every FP8 weight becomes a compute-dtype tensor at load; the FP8 pairs read are
  kept (`Fp8State.originals`, ~1 byte per weight) so an export writes unchanged weights back byte
  for byte and re-quantizes changed ones.
- "keep": Linear layers become `FP8Linear` (float8 weight + `weight_scale_inv`, ~1 byte per weight),
  stacked experts become `Fp8Experts`; both dequantize when they compute. The weights are frozen.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Set
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Shard
from torch.nn import functional as F

from kiln.constants import BASE_TASK
from kiln.errors import KilnError
from kiln.hub.fp8 import (
    FP4_BLOCK,
    FP8,
    SCALE_SUFFIX,
    Fp8Scheme,
    canonical_scales,
    dequantize,
    dequantize_state,
    fp8_pairs,
    is_fp4,
    logical_shape,
    quantize,
    requantize_state,
    scale_grid,
)
from kiln.models.common.keymap import KeyMap, Stack
from kiln.models.common.moe import Experts
from kiln.models.common.typed import is_kiln_model

if TYPE_CHECKING:  # (both import this module)
    from kiln.models.common.lora import LoraLinear
    from kiln.models.common.pretrained import PreTrainedModel

M = TypeVar("M", bound=nn.Module)
MODES = ("dequantize", "keep")


def with_scale_stacks(keymap: KeyMap) -> KeyMap:
    """`keymap` plus, for each stacked-experts rule, the same rule for the experts' scales."""
    if not keymap.stacks:
        return keymap
    return keymap + KeyMap([Stack(s.kiln + SCALE_SUFFIX, tuple(h + SCALE_SUFFIX for h in s.hf), s.dim)
                            for s in keymap.stacks])


def _autocast_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else x.dtype


class _KeepsFp8Storage:
    """A dtype cast of the model (`.to(bfloat16)`) leaves FP8 weights and their scales as stored."""

    def _apply(self, fn, recurse=True):
        # the tensors themselves: a cast may swap a Parameter's .data in place
        kept = {n: t.data for n, t in itertools.chain(self._parameters.items(), self._buffers.items())
                if t is not None and (t.dtype == FP8 or n.endswith(SCALE_SUFFIX))}
        super()._apply(fn, recurse)
        for n, old in kept.items():
            new = self._parameters[n] if n in self._parameters else self._buffers[n]
            if new.dtype != old.dtype:  # fp8 -> wider is exact, so the weight comes back unchanged
                restored = new.data.to(old.dtype) if old.dtype == FP8 else old.to(new.device)
                if n in self._parameters:
                    new.data = restored
                else:
                    self._buffers[n] = restored
        return self


class _Fp8LinearFn(torch.autograd.Function):
    """y = x W^T + b with W dequantized from FP8; saves only the FP8 weight, re-dequantized for dx."""

    @staticmethod
    def forward(ctx, x, q, s, block, bias):
        ctx.save_for_backward(q, s)
        ctx.block, ctx.x_dtype, ctx.bias_grad = block, x.dtype, bias is not None and bias.requires_grad
        return F.linear(x, dequantize(q, s, block, _autocast_dtype(x)), bias)

    @staticmethod
    def backward(ctx, grad):
        q, s = ctx.saved_tensors
        gx = (grad @ dequantize(q, s, ctx.block, grad.dtype)).to(ctx.x_dtype)
        gb = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.bias_grad else None
        return gx, None, None, None, gb


def fp8_linear(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, block, bias: torch.Tensor | None) -> torch.Tensor:
    if isinstance(q, DTensor):
        return _tp_fp8_linear(x, q, s, block, bias)
    if torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad)):
        return _Fp8LinearFn.apply(x, q, s, block, bias)
    return F.linear(x, dequantize(q, s, block, _autocast_dtype(x)), bias)


def _tp_fp8_linear(x: torch.Tensor, q: DTensor, s: torch.Tensor, block, bias: torch.Tensor | None) -> torch.Tensor:
    """An FP8 Linear a tensor-parallel plan split (kiln.parallel.tp_fp8): this rank's FP8 rows (Shard(0), column
    parallel) or columns (Shard(1), row parallel) and their scale blocks, dequantized here only.

    Column parallel: x is whole (Replicate); the output is this rank's output columns, and the gradient of x
    a partial sum (each rank's rows of W contribute). Row parallel: x is this rank's input columns; the output
    is a partial sum, reduced by the plan's output layout, and the (replicated) bias is added once to the sum."""
    (placement,) = q.placements
    local_x = x.to_local(grad_placements=[Partial()] if placement.is_shard(0) else None) \
        if isinstance(x, DTensor) else x
    local_s = s.to_local() if isinstance(s, DTensor) else s  # a per-tensor scale stays whole on every rank
    if placement.is_shard(0):
        local_b = bias.to_local() if isinstance(bias, DTensor) else bias
        y = fp8_linear(local_x, q.to_local(), local_s, block, local_b)
        return DTensor.from_local(y, q.device_mesh, [Shard(y.dim() - 1)], run_check=False)
    y = DTensor.from_local(fp8_linear(local_x, q.to_local(), local_s, block, None), q.device_mesh, [Partial()],
                           run_check=False)
    return y if bias is None else y + bias


class FP8Linear(_KeepsFp8Storage, nn.Linear):
    """A frozen Linear stored as float8_e4m3fn `weight` (out, in) + block `weight_scale_inv`."""

    weight_scale_inv: torch.Tensor  # (a buffer)

    def __init__(self, in_features: int, out_features: int, bias: bool, block: tuple[int, int] | None,
                 scale_dtype: torch.dtype = torch.float32, compute_dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.block, self.compute_dtype = block, compute_dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8, device=device),
                                   requires_grad=False)
        self.register_buffer("weight_scale_inv", torch.empty(scale_grid((out_features, in_features), block),
                                                             dtype=scale_dtype, device=device))
        # (no bias: None, as nn.Linear holds it; torch types the attribute as a Parameter only)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=compute_dtype,  # type: ignore[assignment]
                                             device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(self.weight, self.weight_scale_inv, self.block, dtype or self.compute_dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, fp8 blocks {list(self.block) if self.block else 'per-tensor'}"


def dequantize_parts(q: torch.Tensor, s: torch.Tensor, block, parts: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize a stacked (E, R, C) expert tensor whose `parts` (cat along `dim` of R, C) each have a scale grid."""
    if parts == 1:
        return dequantize(q, s, block, dtype)
    return torch.cat([dequantize(qp, sp, block, dtype) for qp, sp in
                      zip(q.chunk(parts, dim=1 + dim), s.chunk(parts, dim=1 + dim))], dim=1 + dim)


class Fp8Experts(_KeepsFp8Storage, Experts):
    """Stacked experts whose weights stay FP8 with per-expert (and per-part) scales.

    `stacked("gate_up_proj")` / `stacked("down_proj")` are the dequantized tensors, so the grouped matmuls of
    `Experts.forward` run unchanged; under autograd the dequantized copy lives until backward. The attributes
    are the stored FP8 parameters (FSDP2 re-finds its parameters by attribute).
    """
    fp8_layout: dict[str, tuple[int, int]]  # name -> (parts, cat dim within an expert)
    fp8_block: tuple[int, int] | None        # the scale blocks (None: one scale per tensor)
    compute_dtype: torch.dtype               # what the weights dequantize to

    def _weight(self, name: str) -> torch.Tensor:
        q, s = self._parameters[name], self._buffers.get(name + SCALE_SUFFIX)
        if q is None:
            raise KilnError(f"{type(self).__name__}.{name}: no stacked expert weight in this slot")
        if q.dtype != FP8 and not is_fp4(q):
            return q
        if s is None:
            raise KilnError(f"{type(self).__name__}.{name}: an FP8 weight without its scales ({name + SCALE_SUFFIX})")
        parts, dim = self.fp8_layout[name]
        return dequantize_parts(q, s, self.fp8_block, parts, dim, self.compute_dtype)

    def stacked(self, name: str) -> torch.Tensor:
        return self._weight(name)

    @classmethod
    def convert(cls, experts: Experts, name: str, parts: int, dim: int, block, scale_dtype: torch.dtype,
                compute_dtype: torch.dtype, fp4: bool = False) -> None:
        """Make `experts.<name>` an FP8 parameter (on the meta device) with its stacked scale buffer; with `fp4`
        packed FP4 (int8, two a byte, (1, 32) scale blocks: DeepSeek-V4's routed experts)."""
        if not isinstance(experts, cls):
            experts.__class__ = cls
            fp8 = cast(Fp8Experts, experts)  # its class, just set
            fp8.fp8_layout, fp8.fp8_block, fp8.compute_dtype = {}, block, compute_dtype
        fp8 = cast(Fp8Experts, experts)  # (an Fp8Experts now)
        param = experts._parameters[name]
        if param is None:
            raise KilnError(f"{type(experts).__name__}.{name}: no stacked expert weight to hold in FP8")
        shape = tuple(param.shape)
        stored = (*shape[:-1], shape[-1] // 2) if fp4 else shape
        experts._parameters[name] = nn.Parameter(torch.empty(stored, dtype=torch.int8 if fp4 else FP8, device="meta"),
                                                 requires_grad=False)
        part = list(shape)
        part[1 + dim] //= parts
        block = FP4_BLOCK if fp4 else block
        grid = list(scale_grid(tuple(part), block))
        if block is not None:
            grid[1 + dim] *= parts
        experts.register_buffer(name + SCALE_SUFFIX, torch.empty(grid, dtype=scale_dtype, device="meta"))
        fp8.fp8_layout[name] = (parts, dim)


@dataclass
class Fp8State:
    """What a model loaded from an FP8 directory needs to write one back."""
    scheme: Fp8Scheme
    originals: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)  # HF name -> pair read
    mode: str = "dequantize"

    def export(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Weights held dequantized go back to FP8 (byte-identical when unchanged); FP8 modules are as stored."""
        return requantize_state(hf, self.scheme, self.originals)


def compute_dtype_of(state: dict[str, torch.Tensor]) -> torch.dtype:
    """The checkpoint's own high-precision dtype: the commonest among its non-FP8 floating tensors."""
    counts = Counter(v.dtype for k, v in state.items()
                     if v.dtype.is_floating_point and v.dtype != FP8 and v.element_size() > 1
                     and not k.endswith(SCALE_SUFFIX))
    return counts.most_common(1)[0][0] if counts else torch.float32


def carried_as_loaded(held: dict[str, torch.Tensor], state: Fp8State | None) -> dict[str, torch.Tensor]:
    """Tensors a family carries beside its model, as a whole load holds them: each FP8 (packed FP4) weight a sharded
    read holds by reference as its stored pair (meta placeholders, kiln.parallel.sharded_carried) as a meta tensor of
    its values' shape in the dtype a whole load dequantizes to, its scale dropped (an MTP layer made live from them
    then reads its parameters dequantized, kiln.parallel.sharded_fp8); any other tensor as held."""
    if state is None or not any(v.is_meta for v in held.values()):
        return held
    canonical, scheme = canonical_scales(held, state.scheme)
    pairs = {k for k, (q, s) in fp8_pairs(canonical, scheme).items() if q.is_meta and s.is_meta}
    dtype = scheme.dtype or compute_dtype_of(canonical)
    return {k: torch.empty(logical_shape(v), dtype=dtype, device="meta") if k in pairs else v
            for k, v in canonical.items() if not (k.endswith(SCALE_SUFFIX) and k[:-len(SCALE_SUFFIX)] in pairs)}


def prepare_fp8(model: PreTrainedModel, state: dict[str, torch.Tensor], scheme: Fp8Scheme, mode: str = "dequantize",
                dtype: torch.dtype | None = None, source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """Ready a (meta-device) model and its HF state dict for loading an FP8 checkpoint; returns the state to load.

    "keep" swaps the Linears and experts that hold FP8 weights for FP8 modules (their scales then
    load with them); FP8 tensors no FP8 module can hold are dequantized, as in "dequantize".
    """
    if mode not in MODES:
        raise KilnError(f"fp8 mode {mode!r} is not one of: {', '.join(MODES)}")
    state, scheme = canonical_scales(state, scheme)  # DeepSeek-V4's `<module>.scale` names
    dtype = dtype or scheme.dtype or compute_dtype_of(state)
    pairs = fp8_pairs(state, scheme, source)
    names = model.normalise_hf_names(state)
    prefix = "" if model.task == BASE_TASK else model.family.hf_prefix + "."
    # checkpoint name -> the name hf_state_dict writes it under (extras: bare, under the head's prefix)
    out_name = {k: prefix + name if extra else name for k, (name, extra) in names.items()}
    kept: set[str] = set()
    if mode == "keep":
        kept = _swap_modules(model, {k: names[k][0] for k in pairs if not names[k][1]}, scheme, dtype,
                             {k: s for k, (_, s) in pairs.items()}, {k for k, (q, _) in pairs.items() if is_fp4(q)})
    rest = {k: v for k, v in state.items() if k not in kept and not (k.endswith(SCALE_SUFFIX)
                                                                  and k[:-len(SCALE_SUFFIX)] in kept)}
    loaded, read = dequantize_state(rest, scheme, dtype, source)
    loaded.update({k: v for k, v in state.items() if k not in rest})
    model.fp8_state = Fp8State(scheme, {out_name[k]: pair for k, pair in read.items()}, mode)
    return loaded


def _swap_modules(model: PreTrainedModel, names: dict[str, str], scheme: Fp8Scheme, dtype: torch.dtype,
                  scales: dict[str, torch.Tensor], fp4: Set[str] = frozenset()) -> set[str]:
    """Put FP8 modules where the checkpoint's FP8 weights land (`names`: checkpoint -> normalised HF name).

    Returns the checkpoint names they hold."""
    keymap = model.family.keymap(model.task)
    params = dict(model.named_parameters())
    by_kiln: dict[str, list[str]] = {}
    hf_of: dict[str, str] = {}
    for name, hf in names.items():
        kiln = keymap.kiln_name(hf)
        if kiln is not None and kiln in params:
            by_kiln.setdefault(kiln, []).append(name)
            hf_of[name] = hf
    held = set()
    for kiln, hf_names in by_kiln.items():
        module_name, _, attr = kiln.rpartition(".")
        module = model.get_submodule(module_name)
        scale_dtype = scales[hf_names[0]].dtype
        if isinstance(module, nn.Linear) and attr == "weight" and len(hf_names) == 1 and hf_names[0] not in fp4:
            parent_name, _, leaf = module_name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, leaf, FP8Linear(module.in_features, module.out_features, module.bias is not None,
                                            scheme.block, scale_dtype, dtype, device="meta"))
        elif isinstance(module, Experts) and attr in ("gate_up_proj", "down_proj"):
            stack = next(s for s in keymap.stacks if any(_fits(t, hf_of[hf_names[0]]) for t in s.hf))
            Fp8Experts.convert(module, attr, len(stack.hf), stack.dim, scheme.block, scale_dtype, dtype,
                               hf_names[0] in fp4)
        else:
            continue  # no FP8 module for it: dequantized at load
        held.update(hf_names)
    return held


def _fits(template: str, name: str) -> bool:
    """Whether HF tensor `name` is an instance of a key-map template (`{}` = an index)."""
    return re.fullmatch(r"(\d+)".join(re.escape(p) for p in template.split("{}")), name) is not None


@torch.no_grad()
def dequantize_model(model: M, dtype: torch.dtype | None = None) -> M:
    """Drop FP8 from a model: FP8 modules become plain ones, `quantization_config` leaves its config.

    Its weights then save in `dtype` (default: each module's compute dtype) with no scales.
    """
    for name, module in list(model.named_modules()):
        if isinstance(module, FP8Linear):
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                              device=module.weight.device, dtype=dtype or module.compute_dtype)
            plain.weight.copy_(module.dequantized(plain.weight.dtype))
            if module.bias is not None:
                plain.bias.copy_(module.bias)
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, leaf, plain)
        elif isinstance(module, Fp8Experts):
            weights = {n: module._weight(n).to(dtype or module.compute_dtype) for n in module.fp8_layout}
            for n, w in weights.items():
                del module._buffers[n + SCALE_SUFFIX]
                module._parameters[n] = nn.Parameter(w)
            module.__class__ = Experts  # type: ignore[assignment]  # the conversion back: a plain Experts again
        elif isinstance(module, nn.Linear) and module.weight.dtype == FP8:  # a LoRA layer over an FP8 base
            if not hasattr(module, "block") or not hasattr(module, "fp8"):  # LoraLinear's FP8 fields
                raise KilnError(f"{name}: an FP8 weight in a {type(module).__name__}, neither FP8Linear nor a LoRA "
                                "layer over one; kiln cannot dequantize it")
            module = cast("LoraLinear", module)  # (lora imports this module: named by its fields, not its class)
            scale = module._buffers.pop("weight_scale_inv")
            if scale is None:
                raise KilnError(f"{name}: an FP8 weight without its weight_scale_inv; kiln cannot dequantize it")
            w = dequantize(module.weight, scale, module.block, dtype or module.compute_dtype)
            module.weight = nn.Parameter(w, requires_grad=False)
            module.fp8 = False
    if is_kiln_model(model):  # (a plain module holds no fp8_state nor config)
        model.fp8_state = None
        if getattr(model, "config", None) is not None:
            model.config.dequantized(dtype)
    if dtype is not None:
        model.to(dtype)
    return model


@torch.no_grad()
def merged_fp8_linear(module: LoraLinear, delta: torch.Tensor, ue8m0: bool) -> FP8Linear:
    """An FP8Linear holding quantize(dequantized weight + delta) in the module's blocks (a LoRA merge)."""
    merged = dequantize(module.weight, module.weight_scale_inv, module.block, torch.float32) + delta.float()
    q, s = quantize(merged, module.block, ue8m0, module.weight_scale_inv.dtype)
    out = FP8Linear(module.in_features, module.out_features, module.bias is not None, module.block, s.dtype,
                    module.compute_dtype, device=q.device)
    out.weight = nn.Parameter(q, requires_grad=False)
    out.weight_scale_inv = s
    if module.bias is not None:
        out.bias = nn.Parameter(module.bias.detach().clone())
    return out
