"""One materialization: fill each tensor this rank holds of a model built on meta, from its load plan.

    model, plan = plan_load(path, task)                  # kiln.models.auto: on the meta device, one source per tensor
    parallelize(model, parallel, world_size, device)     # FSDP2 / TP / EP / PP plans, applied on meta (or none)
    materialize(model, plan.index, device)               # each rank: its pieces, from the files

A whole load (`kiln.models.auto.load_pretrained`) is this on one process with no plans applied. `materialize` puts the
model's (possibly sharded, DTensor) tensors on `device` and fills each from its source
(kiln.models.common.load_plan): a `Stored` tensor sharded on one dimension is read as that slice only (its run of
rows straight into place, or its box through a slice read); a `Stacked` one expert by expert, only the experts this
rank holds (an ep rank its E/ep, FSDP's rows of them too); an `Assembled` one (a tensor step such as a transpose, or
a 2-D placement) whole, one tensor at a time, and this rank's piece taken from it with no communication
(`distribute_tensor(..., src_data_rank=None)`); an `Fp8Box` its box and the scale blocks it touches, dequantized
(kiln.models.loading.fp8); `Rows4` its run of packed bytes (kiln.models.loading.q4); a `Fresh` tensor is kept as
drawn. So a process never holds more than its shards plus one checkpoint tensor. The tensors equal those of the
whole load of stage 3 (`kiln.models.auto.load_whole`) then the same plans, bit for bit (tests/parallel, tests/models).

Straight to the device: when the target is not host memory (`device = "cuda"`), each piece passes through one
bounded host buffer (`HostStage`, stage.py: a tensor read as stored goes in chunks of at most `HostStage.limit`
bytes; one that needs a tensor step or a column slice, one tensor at a time), so the host never holds the model.
Plain `.bin` weights read like safetensors: where each tensor lies comes from their pickle read onto meta (no data).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.errors import WeightsError
from kiln.hub.index import CheckpointIndex, Span, read_into
from kiln.models.common.load_plan import Assembled, Fp8Box, LoadPlan, Part, Source, Stacked, Stored
from kiln.models.common.pretrained import LoadReport, PreTrainedModel
from kiln.models.loading.carried import placeholders, read_keys
from kiln.models.loading.fp8 import read_dequantized, whole_piece
from kiln.models.loading.plan import keys_of
from kiln.models.loading.q4 import read_q4
from kiln.models.loading.stage import HostStage, host_stage


def materialize(model: PreTrainedModel, path: str | os.PathLike | CheckpointIndex, device: torch.device | str = "cpu",
                stage: HostStage | None = None) -> None:
    """Materialise `model` (built on meta by its plan, parallel plans applied or not) on `device` and fill each tensor
    this rank holds from its source.

    `path`: the checkpoint's index, or its directory (the index the model was built from is used when it names
    the same directory: its headers are not read again). A device other than the CPU is filled through a
    `HostStage` (made here unless one is given; a given one is used on the CPU too, which is how the tests exercise
    the device path)."""
    plan = model.deferred_read
    if plan is None:
        raise WeightsError(f"{path}: the model holds its weights already (no load plan to read)")
    device = torch.device(device)
    stage = stage if stage is not None else host_stage(device)
    index = _index_of(plan, path)
    index.refresh()  # a file rewritten since the model was built is read as it now is
    path = index.root
    keymap = model.family.keymap(model.task)
    spans = index.spans  # key -> where its bytes lie in its file
    q4 = plan.q4.names(model) if plan.q4 else set()  # 4-bit Linears: their packed rows and quant state
    # named_parameters / named_buffers list a tied tensor once (under the name the checkpoint holds)
    tensors = [(n, t) for n, t in (*model.named_parameters(), *model.named_buffers()) if n not in q4]
    absent = [n for n, t in tensors if t.is_meta and n not in plan.sources]
    if absent:
        raise WeightsError(f"{path}: tensor(s) {', '.join(map(repr, absent[:4]))} are not in the checkpoint and were "
                           "not drawn by the load plan; load the model whole (kiln.models.auto.load_pretrained)")
    # tensors that are real already (drawn by the plan, LoRA adapters: `init_adapters`) survive to_empty
    kept = {n: _local(t).detach().clone() for n, t in tensors if not t.is_meta}
    model.to_empty(device=device)
    with index.opened() as file_of:
        read_q4(model, plan.q4, spans, file_of, path)
        for name, target in (*model.named_parameters(), *model.named_buffers()):  # (new tensors since to_empty)
            if name in q4:
                continue
            if name in kept:
                with torch.no_grad():
                    _local(target).copy_(kept[name])
            else:
                _read(name, target, plan.sources[name], index, spans, file_of, keymap, path, stage, model)
    names = model.normalise_hf_names(list(spans))  # from all keys, as a whole load: one alone reads a head's as base
    with index.readers(plan.extras) as handles:  # beside the carried placeholders (kiln.models.loading.carried)
        model.hf_extras = placeholders(model).get("hf_extras", {}) | {
            names[k][0]: handles[k].get_tensor(k) for k in plan.extras}
    # a checkpoint tensor whose kiln name the model lacks is reported ignored, as a whole load reports it
    held = model.state_dict(keep_vars=True)
    used = {k for kiln, s in plan.sources.items() if kiln in held for k in keys_of(s)} | set(plan.extras)
    used |= (plan.q4.keys(spans) if plan.q4 else set()) | read_keys(model)
    model.load_report = LoadReport(ignored=sorted(names[k][0] for k in spans if k not in used),
                                   initialized=plan.fresh_names)
    model.tie_weights()
    model.deferred_read = None  # read: the model holds its weights


def _read(name: str, target: torch.Tensor, source: Source, index: CheckpointIndex, spans: dict[str, Span],
          file_of: Any, keymap: Any, path: Path, stage: HostStage | None, model: PreTrainedModel) -> None:
    """Fill this rank's piece of one tensor from its source (the cheapest read its placement allows)."""
    if isinstance(source, Fp8Box):  # its piece and the scale blocks around it, dequantized (kiln.models.loading.fp8)
        assert model.fp8_state is not None  # (the plan put an Fp8Box only on a model with FP8 state)
        scales = dict(source.scales)
        with index.readers([k for k, _ in source.parts] + list(scales.values())) as handles:
            read_dequantized(name, target, _box(target), list(source.parts), handles, scales, keymap, path, stage,
                             model.fp8_state.scheme)
        return
    if isinstance(source, Stored) and _read_rows(target, source.key, spans, file_of(source.key), path, stage):
        return
    if isinstance(source, Stacked) and _read_experts(target, list(source.parts), spans, file_of, keymap, path, stage):
        return
    if not isinstance(source, (Stored, Stacked, Assembled)):
        raise WeightsError(f"{path}: {name!r} has no checkpoint source ({type(source).__name__})")
    parts: list[Part] = [(source.key, source.hf)] if isinstance(source, Stored) else list(source.parts)
    # read, not mapped (a mapping's pages would count in this process's RSS until closed): the read
    # never holds more than its shards plus one tensor
    with index.readers([k for k, _ in parts]) as handles:
        _fill(name, target, parts, handles, keymap, path, stage, slice_read=isinstance(source, Stored))


def _box(t: torch.Tensor) -> tuple[slice, ...] | None:
    """This rank's piece of a sharded DTensor as one slice per dimension (a tp rank's rows or columns, under fsdp
    too), when that piece is a box of the whole tensor; None for a plain tensor or any other piece."""
    if not isinstance(t, DTensor) or not any(p.is_shard() or hasattr(p, "dim") for p in t.placements) \
            or any(p.is_partial() for p in t.placements) or (piece := _piece(t)) is None:
        return None
    return tuple(slice(o, o + n) for n, o in zip(*piece))


def _piece(t: DTensor) -> tuple[list[int], list[int]] | None:
    """(shape, offset) of this rank's piece of `t` by DTensor's own arithmetic (what DCP reads by), when the piece
    is a box of the whole tensor (its local shape); None otherwise."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return (list(shape), list(offset)) if tuple(shape) == tuple(t.to_local().shape) else None


def _index_of(plan: LoadPlan, path: str | os.PathLike | CheckpointIndex) -> CheckpointIndex:
    """The index to read from: `path` itself, or the plan's when `path` names its directory (no header read again),
    else a new one."""
    if isinstance(path, CheckpointIndex):
        return path
    if Path(path) == plan.index.root:
        return plan.index
    return CheckpointIndex.open(path)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _read_rows(target: torch.Tensor, key: str, spans: dict[str, Span], f: Any, path: Path, stage: HostStage | None
               ) -> bool:
    """Read this rank's rows of a tensor stored as is (whole, or a run of rows: dim 0 split over any mesh, e.g.
    fused experts under ep + fsdp) from the file into `target`'s memory: straight in (no mapping, no copy), or
    through `stage` to another device. False when it is not such a tensor (the caller reads it otherwise)."""
    local = _local(target)
    if not local.is_contiguous() or (stage is None and local.device.type != "cpu"):
        return False
    span = spans[key]
    if span.shape != tuple(target.shape):
        raise WeightsError(f"{path}: tensor {key!r} has shape {span.shape}, but this config expects "
                           f"{tuple(target.shape)}")
    run = _row_run(target)
    if run is None:
        return False  # columns are strided in the file: a slice read
    if local.dtype != span.dtype and not (local.dtype == torch.uint8 and local.nbytes == local.numel()
                                          and span.dtype.itemsize == 1):
        return False  # a cast: the general path (a frozen 1-byte dtype held as bytes reads as is)
    start, stop = run
    row = span.nbytes // span.shape[0] if span.shape[0] else 0
    if local.nbytes != (stop - start) * row:
        return False
    if stage is None:
        read_into(f, span.offset + start * row, local)
    else:
        stage.read(f, span.offset + start * row, local)
    return True


def _row_run(target: torch.Tensor) -> tuple[int, int] | None:
    """(first, stop): the rows (dim 0; stacked experts: the experts) this rank holds of `target`, when its piece
    is a run of whole rows."""
    if target.dim() == 0:
        return None
    if not isinstance(target, DTensor):
        return 0, target.shape[0]
    # Shard(0) over ep, FSDP's _StridedShard(0) on top of it
    if any(not p.is_replicate() and getattr(p, "dim", None) != 0 for p in target.placements) \
            or (piece := _piece(target)) is None:
        return None
    return piece[1][0], piece[1][0] + piece[0][0]


def _read_experts(target: torch.Tensor, sources: list[tuple[str, str]], spans: dict[str, Span], file_of: Any,
                  keymap: Any, path: Path, stage: HostStage | None) -> bool:
    """Read the experts this rank holds of a stacked tensor (kiln (E, ...) = stack over experts of the cat of
    their HF parts) part by part from the files into `target`'s memory: an expert parallel rank reads only
    its experts' bytes, in the stored dtype (FP8 weights and their scale grids alike). False when `target` is
    not such a tensor, or needs a cast (the caller reads it otherwise)."""
    slots: dict[tuple[int, int], str] = {}
    for key, hf in sources:
        slot = keymap.stack_slot(hf)
        if slot is None:
            return False
        stack, part, expert = slot
        slots[(part, expert)] = key
    local, run = _local(target).detach(), _row_run(target)
    dtype = spans[sources[0][0]].dtype
    if run is None or not local.is_contiguous() or (stage is None and local.device.type != "cpu") \
            or not (local.dtype == dtype or (local.dtype == torch.uint8 and dtype.itemsize == 1)):
        return False
    parts, dim = len(stack.hf), stack.dim
    num = max(e for _, e in slots) + 1
    missing = [keymap.hf_name(sources[0][1]) or sources[0][0]] if num != target.shape[0] else \
        [f"expert {e} part {p}" for e in range(*run) for p in range(parts) if (p, e) not in slots]
    if missing:
        raise WeightsError(f"{path}: the checkpoint has {num} expert(s) for {missing[0]!r} where this config "
                           f"expects {target.shape[0]}, or misses some ({', '.join(missing[:4])})")
    want = list(target.shape[1:])
    want[dim] //= parts
    for e in range(*run):
        for p in range(parts):
            key = slots[(p, e)]
            span = spans[key]
            if span.shape != tuple(want) or span.dtype != dtype:
                raise WeightsError(f"{path}: tensor {key!r} has shape {span.shape} ({span.dtype}), but this config "
                                   f"expects {tuple(want)} ({dtype}) for each expert's part")
            dest = local[e - run[0]].narrow(dim, p * want[dim], want[dim])
            if not dest.is_contiguous():  # a part of the columns: through one part-sized host tensor
                held = torch.empty(want, dtype=local.dtype)
                read_into(file_of(key), span.offset, held)
                if stage is not None:
                    stage.note(held.nbytes)
                dest.copy_(held)
            elif stage is None:
                read_into(file_of(key), span.offset, dest)
            else:
                stage.read(file_of(key), span.offset, dest)
    return True


def _fill(name: str, target: torch.Tensor, sources: list[Part], where: dict, keymap: Any, path: Path,
          stage: HostStage | None = None, slice_read: bool = False) -> bool:
    """Copy this rank's piece of kiln tensor `name` into `target` (a DTensor's local shard, or a plain tensor): a
    slice read of its box where it has one, else the whole tensor read and cut. Returns whether it read it whole."""
    local = _local(target)
    index = _box(target)
    whole = not (slice_read and index is not None)  # a stored tensor's box: a slice read
    if not whole:
        key = sources[0][0]
        shape = tuple(where[key].get_slice(key).get_shape())
        if shape != tuple(target.shape):
            raise WeightsError(f"{path}: tensor {key!r} has shape {shape}, but this config expects "
                               f"{tuple(target.shape)}")
        value = where[key].get_slice(key)[index]  # only these rows / columns leave the file
        read = value.nbytes
    else:
        hf = {hf: where[key].get_tensor(key) for key, hf in sources}
        read = sum(t.nbytes for t in hf.values())
        value = whole_piece(hf, name, target, keymap, path, sources[0][0])
    if local.dtype == torch.uint8 and value.dtype != local.dtype and value.element_size() == 1:
        value = value.view(torch.uint8)  # a frozen FP8 tensor held as bytes (kiln.parallel.fsdp.frozen_as_bytes)
    elif value.dtype != local.dtype and value.element_size() == 1 and value.dtype.is_floating_point:
        raise WeightsError(f"{path}: FP8 tensor {sources[0][0]!r} would be read into {name!r} ({local.dtype}) "
                           "without its scale; load this checkpoint whole (kiln.models.auto.load_pretrained)")
    if stage is not None:  # what the host held for this tensor (its sources, or the slice read)
        stage.note(read + (value.nbytes if value.dtype != local.dtype else 0))
    with torch.no_grad():
        local.copy_(value.to(local.dtype) if value.dtype != local.dtype else value)
    return whole


def loaded_bytes(model: nn.Module) -> int:
    """Bytes of the tensors this process holds for `model` (its local shards)."""
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in model.state_dict().values())

