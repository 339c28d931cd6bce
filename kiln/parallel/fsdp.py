"""FSDP2: shard parameters, gradients and optimizer state over the data-parallel ranks, block by block.

Each block is its own `fully_shard` unit (all-gathered just before it runs, freed right after),
then the root takes what is left (embeddings, final norm, head). Parameters become DTensors
sharded on dim 0; gradients are reduce-scattered and averaged over the mesh, as DDP averages them.
After tensor parallelism on a 2-D mesh, FSDP shards the tp-local pieces over the dp dimension.

Frozen low-precision parameters (an FP8 checkpoint kept FP8, a packed 4-bit base) cross the
collectives as bytes (`frozen_as_bytes`): gloo has no float8 (nor does every nccl build), and a
mixed-precision policy would otherwise widen them to `param_dtype` before the all-gather.

Code that is not a unit's forward (the generation engine's runners call a model's submodules directly, and
check their exact classes): `own_classes` shows the units as the classes the model was built with, `gathered`
all-gathers every unit's parameters for a while (a rollout: no collective inside, so each rank generates on
its own), `unit_forward` runs a function as a unit's forward (gathered before, freed after, its gradients
reduce-scattered in the backward: the engine's scoring forward, one block at a time).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, overload

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, Shard

from kiln.errors import KilnError
from kiln.parallel.blocks import find_blocks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# dtypes a collective backend may lack; a frozen parameter in one of them crosses as uint8 bytes
BYTE_DTYPES = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                    "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2")
                        if hasattr(torch, n))
AS_BYTES = "kiln_as_bytes"  # set True on a frozen parameter of any dtype to have it cross as bytes too


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: str | None = None, reduce_dtype: str = "fp32",
               offload: bool = False, reshard_after_forward: bool = True) -> nn.Module:
    """Shard `model` over the 1-D `mesh` in place: one unit per block, the root last; returns the model.

    `param_dtype` is the dtype blocks compute in (None: the parameters' own); `reduce_dtype` the
    dtype gradients are reduced in; `offload` keeps the shards and their gradients in CPU memory
    (the optimizer step then runs on the CPU). Frozen low-precision parameters go as bytes
    (`frozen_as_bytes`) and keep their dtype whatever `param_dtype` says.
    """
    frozen_as_bytes(model)
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[param_dtype] if param_dtype else None,
                                  reduce_dtype=DTYPES[reduce_dtype])
    placement: OffloadPolicy = CPUOffloadPolicy() if offload else OffloadPolicy()
    blocks = find_blocks(model)
    for i, block in enumerate(blocks):
        # the last block's parameters are needed again at once by the backward: keep them gathered
        fully_shard(block, mesh=mesh, mp_policy=policy, offload_policy=placement,
                    reshard_after_forward=reshard_after_forward and i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=placement,
                reshard_after_forward=reshard_after_forward,
                ignored_params=replicated_root(model, blocks, DTYPES[param_dtype] if param_dtype else None) or None)
    if len(blocks):
        blocks[-1].register_forward_hook(free_held_gather)  # after FSDP's own post-forward hook
    for name in getattr(model, "fsdp_forward_methods", ()):  # methods that use the root's weights (the head) as a
        register_fsdp_forward_method(model, name)            # forward does: gathered around them too
    return model


def free_held_gather(module: nn.Module, args: tuple, output: object) -> None:
    """Free the last block's flat all-gather buffer once its forward is done, not at the end of the root's forward.

    FSDP2 keeps each forward all-gather's flat output (one whole block) until the next unit's all-gather, so its
    copy-out overlaps that collective; after the last block there is none, and it holds the buffer until the root's
    forward ends. A kiln causal LM computes its head and loss inside that forward, at the step's peak (every
    activation saved): the buffer sat there, one gathered block per rank (58 MiB on the 1B Qwen3 of
    benchmarks/bench_load.py; ~1.4 GiB for a 70 GB, 48-layer model). The same waits as FSDP's root, then the drop."""
    get_state = getattr(module, "_get_fsdp_state", None)
    ctx = getattr(get_state(), "_comm_ctx", None) if get_state is not None else None
    held = getattr(ctx, "all_gather_state", None)
    if held is None or ctx is None:  # (no state without a context)
        return
    if held.event is not None:  # on a GPU: the copy-out must finish before its memory can be reused
        ctx.all_gather_copy_in_stream.wait_event(held.event)
        ctx.all_gather_stream.wait_event(held.event)
    ctx.all_gather_state = None


def replicated_root(model: nn.Module, blocks: nn.Module, param_dtype: torch.dtype | None = None) -> set[nn.Parameter]:
    """The frozen parameters outside the blocks (a LoRA run's embedding, tied head, final norm) that the root
    unit leaves whole on every rank: sharding them saves nothing, since FSDP gathers the root for the whole
    forward, and gathering costs a second whole copy (the all-gather buffer) on every rank each step. Not when
    `param_dtype` would have FSDP cast them (they stay as stored). Trained ones shard as usual (their
    gradients and optimizer state are what sharding them saves)."""
    inside = {id(p) for p in blocks.parameters()}
    return {p for p in model.parameters() if id(p) not in inside and not p.requires_grad and not isinstance(p, DTensor)
            and (param_dtype is None or p.dtype == param_dtype or not p.dtype.is_floating_point)}


def frozen_as_bytes(model: nn.Module) -> list[str]:
    """Make each frozen parameter in `BYTE_DTYPES` (or marked `AS_BYTES`) a uint8 view of its own storage,
    before `fully_shard`; returns their names. Call it once before the first `fully_shard` of the model
    (later calls change nothing).

    FSDP then shards, all-gathers and frees them like any other parameter, as bytes: uint8 is in
    every backend and is not floating point, so no mixed-precision cast applies. A forward pre-hook
    on the owning module views the gathered bytes as the stored dtype again, so the module's code
    (`self.weight`, or `self._parameters[...]`) sees its FP8 tensor; `state_dict()` shows the stored
    dtype, and `load_state_dict` takes it. A dtype wider than a byte views as (..., last * itemsize)
    bytes; sharding stays on dim 0, so the last dimension must not be sharded.
    """
    names = []
    for prefix, module in model.named_modules():
        for name, p in list(module._parameters.items()):
            if p is None or p.requires_grad or p.dtype == torch.uint8:
                continue
            if p.dtype not in BYTE_DTYPES and not getattr(p, AS_BYTES, False):
                continue
            if p.dim() == 0 and p.element_size() > 1:
                raise KilnError(f"{prefix}.{name}: a 0-d {p.dtype} parameter cannot cross collectives as bytes")
            byte_params = module.__dict__.get("_kiln_byte_params")
            if byte_params is None:
                byte_params = module.__dict__["_kiln_byte_params"] = {}
                module.register_forward_pre_hook(_view_stored)  # appended: runs after FSDP's unshard
                module.register_state_dict_post_hook(_state_dict_stored)
                module.register_load_state_dict_pre_hook(_load_as_bytes)
            byte_params[name] = p.dtype
            module._parameters[name] = nn.Parameter(retype(p.detach(), torch.uint8), requires_grad=False)
            names.append(f"{prefix}.{name}" if prefix else name)
    return names


@overload
def retype(t: DTensor, dtype: torch.dtype) -> DTensor: ...
@overload
def retype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...
def retype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The same bytes as `dtype` (a view; a DTensor stays one, with the same placements)."""
    if not isinstance(t, DTensor):
        return t.view(dtype)
    if t.element_size() == torch.empty(0, dtype=dtype).element_size():
        return t.view(dtype)
    if any(isinstance(pl, Shard) and pl.dim in (-1, t.dim() - 1) for pl in t.placements):
        raise KilnError(f"a {t.dtype} DTensor sharded on its last dimension cannot be viewed as {dtype}")
    local = t.to_local().view(dtype)
    shape = (*t.shape[:-1], local.shape[-1]) if t.dim() else ()
    return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _byte_params(module: nn.Module) -> dict[str, torch.dtype]:
    """The stored dtypes frozen_as_bytes recorded on `module` (in its __dict__, apart from nn.Module's own)."""
    return module.__dict__["_kiln_byte_params"]


def _view_stored(module: nn.Module, args: tuple) -> None:
    # FSDP's pre-forward hook (prepended) has all-gathered the unit: what is here now is the full bytes
    for name, dtype in _byte_params(module).items():
        t = module._parameters.get(name)
        if t is not None and t.dtype == torch.uint8 and dtype != torch.uint8:
            module._parameters[name] = nn.Parameter(retype(t.detach(), dtype), requires_grad=False)


def _state_dict_stored(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
    for name, dtype in _byte_params(module).items():
        t = state.get(prefix + name)
        if t is not None and t.dtype == torch.uint8:
            state[prefix + name] = retype(t, dtype)  # a view: DCP loads in place into the parameter's bytes


def _load_as_bytes(module: nn.Module, state: dict, prefix: str, *args) -> None:
    for name, dtype in _byte_params(module).items():
        t = state.get(prefix + name)
        if t is not None and t.dtype == dtype:  # bytes, not a numeric cast into uint8
            state[prefix + name] = retype(t, torch.uint8)


# ---- code other than a unit's forward on a sharded model ------------------------------------------
def units(model: nn.Module) -> list[FSDPModule]:
    """The model's FSDP2 units (each `fully_shard`-ed module: the blocks, then the root), in module order."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _state(unit: nn.Module | FSDPModule) -> Any:
    # the unit's FSDP state by the module (not its class: own_classes may have swapped that)
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state

    assert isinstance(unit, nn.Module), "fully_shard makes its units of modules"
    state = _get_module_fsdp_state(unit)
    if state is None:
        raise KilnError(f"{type(unit).__name__} is not an FSDP2 unit")
    return state


@contextmanager
def own_classes(model: nn.Module) -> Iterator[nn.Module]:
    """`model` with each unit's class the one it was built with for the duration (fully_shard makes a unit an
    instance of FSDP<Class>, a subclass): code that accepts a module by its exact class (the generation engine's
    runner registry) sees the model as built. Nothing else changes (parameters, hooks, state), and the FSDP
    classes come back on exit. The units' own methods (`unshard`, a registered forward method) are not there
    meanwhile: `gathered` and `unit_forward` reach the state without them."""
    swapped: list[tuple[FSDPModule, type]] = []
    try:
        for unit in units(model):
            cls = type(unit)
            unit.__class__ = cls.__mro__[cls._orig_cls_mro_index]  # FSDP's own record of where the built class sits
            swapped.append((unit, cls))
        yield model
    finally:
        for unit, cls in reversed(swapped):
            unit.__class__ = cls


def gathered_bytes(model: nn.Module) -> int:
    """Bytes every unit's parameters take gathered whole, in the dtype the forward computes in (the
    mixed-precision policy's param_dtype, else each parameter's own): what `gathered` allocates on each rank,
    beside the shards it keeps."""
    total = 0
    for unit in units(model):
        state = _state(unit)
        cast = state._mp_policy.param_dtype
        for group in state._fsdp_param_groups:
            for fp in group.fsdp_params:
                own = fp.sharded_param.dtype  # uint8 for what crosses as bytes: never cast
                dtype = cast if cast is not None and own.is_floating_point else own
                total += fp._orig_size.numel() * torch.empty((), dtype=dtype).element_size()
    return total


@contextmanager
def gathered(model: nn.Module) -> Iterator[nn.Module]:
    """Every unit's parameters all-gathered (whole, in the forward's dtype) for the duration, then resharded:
    code inside uses the model as one process's, with no collective of its own (each rank may run it as long as
    it likes). Entering is collective: every rank enters together. Enter it before `own_classes` (it calls the
units' own unshard and reshard). Under no_grad: gradients of gathered
    parameters would not reach the shards (`unit_forward` is the way for a forward with a backward)."""
    if torch.is_grad_enabled():
        raise KilnError("fsdp.gathered runs under torch.no_grad(): a backward through gathered parameters would "
                        "not reduce its gradients into the shards (use unit_forward)")
    done: list[Any] = []
    try:
        for unit in units(model):
            unit.unshard()  # waits for the all-gather
            done.append(unit)
        yield model
    finally:
        for unit in reversed(done):
            unit.reshard()


def unit_forward(unit: nn.Module, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) run as `unit`'s forward, for FSDP2: its parameters gathered before (the tensors in args cast
    to the policy's param_dtype, as a forward's inputs are; the backward's post-hook put on those requiring
    grad), then freed after as its forward would free them, with the pre-backward hook on the output that
    gathers them again for the backward, whose gradients are reduce-scattered into the shards. What
    `register_fsdp_forward_method` does for a method, for any function (and with own_classes in force)."""
    state = _state(unit)
    args, _ = state._pre_forward(unit, args, {})
    return state._post_forward(unit, args, fn(*args))
