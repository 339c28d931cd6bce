"""4-bit bases read from the load plan: each rank reads only its rows of the packed 4-bit weights (kiln.models.loading.read).

A 4-bit Linear (`quant4.Linear4`, or a LoRA layer over one) holds its weight as packed bytes, (ceil(n / 2), 1)
uint8, which FSDP2 shards on dim 0 (a run of bytes of the flattened weight per rank), and its quant state as
buffers, which FSDP2 leaves whole on every rank: absmax (one per block of 64 values: float32, or one byte when
double-quantized), the 16-entry code, the nested absmax (float32, one per 256 blocks), the 256-entry nested code
and the quant-state JSON. Per weight of n values the state is n / 64 bytes double-quantized (n / 16 without),
against n / 2 packed bytes: 1/32 (1/8) of the packed weight, read whole as a whole load then shard holds it.

- A bitsandbytes-4bit directory: each rank reads its bytes of `<m>.weight` straight from the file, and the
  small quant-state tensors whole.
- A bf16/fp32 checkpoint quantized at load (`[model] quantize`): each rank reads the stored values of the blocks
  its bytes cover (a block of 64 values is 32 bytes; a rank whose bytes start or end inside a block reads that
  block whole), a chunk at a time, and quantizes them as `bnb4.quantize` quantizes the whole weight: blocks are
  quantized independently, so the bytes are equal. The absmax vector is not: every rank needs all of it (a
  buffer), and the double quantization subtracts the mean of the WHOLE vector (`nested_offset`) before
  quantizing it in groups of 256 blocks. So the ranks all-gather their float32 block absmax (n / 16 bytes per
  weight, one collective per weight over the mesh of the packed weight), and each then double-quantizes the
  whole vector as a whole load does: the same float32 vector through the same ops, so the same bytes and the
  same offset.

A single process or DDP (nothing sharded) reads each weight the same way, as one run holding every byte: the
model is built 4-bit on meta and each weight is read and quantized in turn, so the load never holds the bf16
model (`kiln.models.auto.load_pretrained`, `read_pretrained`). A pipeline stage reads its own layers' weights. To another
device (cuda) each piece passes through one host tensor of its size (a rank's bytes of one weight, or one chunk of
values), not the bounded HostStage; the all-gather runs on the packed weight's device (nccl there). A packed
weight placed otherwise (tensor parallelism splits a Linear's weight on dim 0 or 1, which a 4-bit weight's
flattened blocks and whole quant state do not follow) is refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.errors import WeightsError
from kiln.hub import bnb4
from kiln.hub.index import CheckpointIndex, Span, read_into
from kiln.models.common.load_plan import Q4Read
from kiln.models.common.quant4 import BUFFERS, Bnb4State, Linear4, Q4Meta, is_4bit, prepare_bnb4, quantizable

# stored values quantized at a time (whole blocks): bounds the host temporaries of a quantize at load
# (bnb4.quantize holds about 30 bytes per value: ~8 MB) whatever the weight's size; 1M-value chunks ran no
# faster here (a 3072 x 1024 weight, one thread: 0.29 s in 256K chunks, 0.37 s in 1M ones)
CHUNK_VALUES = 1 << 18


class WholeLoad4(WeightsError):
    """A 4-bit base this read cannot take as a whole load would (the caller loads it whole)."""


def place_q4(model: nn.Module, groups: dict[str, list[tuple[str, str]]], index: CheckpointIndex,
             extra: dict[str, Any], quantize: str | None, weights: dict[str, torch.Tensor]) -> Q4Read | None:
    """Make the Linears that hold 4-bit weights `Linear4` on meta, as a whole load would (`prepare_bnb4` for a
    bitsandbytes directory, `quantize_model` for `quantize`), from the checkpoint's headers and its quant-state
    JSON tensors (a few hundred bytes each); None for a checkpoint without 4 bits. A bitsandbytes directory's
    `weights` (the headers, meta) become what the whole load's `load_hf_state_dict` takes (prepare_bnb4's state).
    WholeLoad4 where this read does not reach (the caller loads whole, which also names any mistake such as
    quantizing a 4-bit directory)."""
    from kiln.models.common.pretrained import PreTrainedModel

    path, spans = index.root, index.spans
    scheme = bnb4.bnb4_scheme_from_config(extra, str(path / "config.json"))
    if scheme is None and quantize is None:
        return None
    if (scheme is not None and quantize is not None) or ("quantization_config" in extra and scheme is None) \
            or type(model).load_hf_state_dict is not PreTrainedModel.load_hf_state_dict:
        raise WholeLoad4(f"{path}: this 4-bit base loads whole")
    if scheme is not None:
        states = [k for k in spans if f".{bnb4.STATE_PREFIX}" in k]
        state = dict(weights)
        state.update({k: index.read(k) for k in states})  # the quant-state JSON tensors: a few hundred bytes each
        prepared = prepare_bnb4(model, state, scheme, str(path))
        weights.clear()
        weights.update(prepared)
        return Q4Read(_plain_weights(model, [n for n, m in model.named_modules() if is_4bit(m)], groups, path))
    bnb4.check_quant_type(quantize, "model.quantize")
    names = quantizable(model)
    modules = _plain_weights(model, names, groups, path)
    dtype = spans[groups[f"{names[0]}.weight"][0][0]].dtype
    for name in names:
        module = model.get_submodule(name)
        key = groups[f"{name}.weight"][0][0]
        if spans[key].dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise WholeLoad4(f"{path}: {key!r} is {spans[key].dtype}")  # the whole load names it
        # the offset (the mean of the whole absmax vector) is known once read: 0.0 stands for it until then
        meta = Q4Meta((module.out_features, module.in_features), spans[key].dtype, quantize, bnb4.BLOCKSIZE, 0.0,
                      bnb4.NESTED_BLOCKSIZE)
        bias = groups.get(f"{name}.bias")
        new = Linear4(module.in_features, module.out_features, module.bias is not None, meta, dtype,
                      spans[bias[0][0]].dtype if bias else None, device="meta")
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    scheme = bnb4.Bnb4Scheme(quantize, True, dtype)
    model.bnb4_state = Bnb4State(scheme)
    extra["quantization_config"] = scheme.to_config()
    return Q4Read(modules, quantize)


def _plain_weights(model: nn.Module, names: list[str], groups: dict[str, list[tuple[str, str]]], path: Path
                   ) -> dict[str, str]:
    """module name -> the checkpoint key of its weight, each stored as is (WholeLoad4 otherwise)."""
    keymap = model.family.keymap(model.task)
    bad = [n for n in names if len(groups.get(f"{n}.weight", ())) != 1 or not keymap.is_plain(groups[f"{n}.weight"][0][1])]
    if not names or bad:
        raise WholeLoad4(f"{path}: the weight(s) of {bad[:2] or 'no Linear'} are not plain checkpoint tensors")
    return {n: groups[f"{n}.weight"][0][0] for n in names}


def _bytes_run(packed: torch.Tensor, name: str) -> tuple[tuple[int, int], Any]:
    """(first, stop) of the packed bytes this rank holds, and the process group they are split over (None when
    whole). FSDP2 shards the (ceil(n / 2), 1) packed weight on dim 0: a run of bytes per rank."""
    if not isinstance(packed, DTensor):
        return (0, packed.shape[0]), None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = packed.device_mesh
    if mesh.ndim != 1 or any(not p.is_replicate() and getattr(p, "dim", None) != 0 for p in packed.placements):
        raise WeightsError(f"{name}.weight: a packed 4-bit weight is read shard by shard when split on its bytes "
                           f"over one mesh dimension (FSDP2), not placed {packed.placements} on a {mesh.ndim}-D mesh "
                           f"{mesh.mesh_dim_names}: tensor parallelism does not split a 4-bit base")
    shape, offset = compute_local_shape_and_global_offset(packed.shape, mesh, packed.placements)
    group = mesh.get_group() if not packed.placements[0].is_replicate() and mesh.size() > 1 else None
    return (offset[0], offset[0] + shape[0]), group


def read_q4(model: nn.Module, plan: Q4Read | None, spans: dict[str, Span], file_of: Any, path: Path) -> None:
    """Fill every 4-bit module of a model built on meta (materialised, plans applied; its load plan's `q4`): this
    rank's packed bytes and the whole quant state, equal to a whole load then the same plans. `file_of(key)` is the
    open file (read, not mapped). Nothing without 4-bit Linears."""
    for name, module in (plan.held(model) if plan else {}).items():
        key = plan.modules[name]
        packed = module.weight
        local = packed.to_local() if isinstance(packed, DTensor) else packed
        (first, stop), group = _bytes_run(packed, name)
        if plan.quantize is None:
            _read_bnb(module, key, spans, file_of, path, local, first, stop)
        else:
            _quantize_rows(module, key, spans[key], file_of(key), path, local, first, stop, group, plan)


def _read_exact(f: Any, span: Span, offset: int, out: torch.Tensor) -> None:
    """`out.nbytes` bytes at `offset` of the tensor `span` into `out` (any device: through a host tensor)."""
    if out.device.type == "cpu" and out.is_contiguous():
        read_into(f, span.offset + offset, out)
        return
    host = torch.empty(out.shape, dtype=out.dtype)
    read_into(f, span.offset + offset, host)
    with torch.no_grad():
        out.copy_(host)


def _read_bnb(module: nn.Module, key: str, spans: dict[str, Span], file_of: Any, path: Path, local: torch.Tensor,
              first: int, stop: int) -> None:
    span = spans[key]
    want = module.weight.shape
    if span.dtype != torch.uint8 or span.shape != tuple(want):
        raise WeightsError(f"{path}: 4-bit tensor {key!r} is {span.dtype} {span.shape}; its quant state says "
                           f"uint8 {tuple(want)}")
    _read_exact(file_of(key), span, first, local)  # one byte per row: rows first..stop are bytes first..stop
    for buf, suffix in BUFFERS.items():
        target = module._buffers.get(buf)
        if target is None:
            continue
        part = bnb4.state_key(key, spans) if suffix == "quant_state" else f"{key}.{suffix}"
        if part is None or part not in spans:
            raise WeightsError(f"{path}: missing quant-state tensor {part or key + '.' + suffix!r}")
        if spans[part].shape != tuple(target.shape) or spans[part].dtype != target.dtype:
            raise WeightsError(f"{path}: quant-state tensor {part!r} is {spans[part].dtype} {spans[part].shape}, "
                               f"expected {target.dtype} {tuple(target.shape)}")
        _read_exact(file_of(part), spans[part], 0, target)
        bnb4.refuse_non_finite(target, part, str(path))


def _quantize_rows(module: nn.Module, key: str, span: Span, f: Any, path: Path, local: torch.Tensor, first: int,
                   stop: int, group: Any, plan: Q4Read) -> None:
    """Quantize the stored values behind packed bytes first..stop (whole blocks: a block of 64 values is 32
    bytes), chunk by chunk, into `local`; then the absmax of every block (all-gathered) and its double quant."""
    shape = (module.out_features, module.in_features)
    if span.shape != shape:
        raise WeightsError(f"{path}: tensor {key!r} has shape {span.shape}, but this config expects {shape}")
    n, bs = shape[0] * shape[1], bnb4.BLOCKSIZE
    blocks, half = -(-n // bs), bs // 2
    b0, b1 = first // half, -(-min(2 * stop, n) // bs) if stop > first else first // half
    absmax = torch.empty(blocks, dtype=torch.float32)
    item = span.dtype.itemsize
    step = CHUNK_VALUES // bs
    host = torch.empty(min(step, max(b1 - b0, 1)) * bs, dtype=span.dtype)
    for c0 in range(b0, b1, step):
        c1 = min(c0 + step, b1)
        v0, v1 = c0 * bs, min(c1 * bs, n)
        values = host[:v1 - v0]
        read_into(f, span.offset + v0 * item, values)
        q = bnb4.quantize(values, plan.quantize, bs, double_quant=False)  # blocks c0..c1, as the whole weight's
        absmax[c0:c1] = q.absmax
        lo, hi = max(first, c0 * half), min(stop, c0 * half + q.packed.shape[0])  # this rank's bytes of the chunk
        with torch.no_grad():
            local[lo - first:hi - first].copy_(q.packed[lo - c0 * half:hi - c0 * half])
    del host
    if group is not None:
        absmax = _gather_absmax(absmax, group, first, stop, local.device)
    q = bnb4.Quant4(local, absmax, bnb4.code4(plan.quantize), shape, span.dtype, plan.quantize, bs)
    offset = absmax.mean()  # the double quant, over the whole vector as bnb4.quantize does
    code = bnb4.dynamic_code()
    q.absmax, q.nested_absmax = bnb4.quantize_blockwise8(absmax - offset, code)
    q.nested_code, q.offset = code, offset.item()
    tensors = q.tensors("w")
    for buf, suffix in BUFFERS.items():
        hf = f"w.{bnb4.STATE_PREFIX}{q.quant_type}" if suffix == "quant_state" else f"w.{suffix}"
        if hf in tensors:
            module._buffers[buf] = tensors[hf].to(local.device)
    module.q4 = Q4Meta.of(q)


def _gather_absmax(absmax: torch.Tensor, group: Any, first: int, stop: int, device: torch.device) -> torch.Tensor:
    """The absmax of every block from the ranks' pieces: each rank sends the blocks that start in its bytes
    (a block is 32 bytes: they partition the blocks), padded to the largest share (on `device`: the backend's)."""
    half = bnb4.BLOCKSIZE // 2
    blocks = absmax.numel()
    world = dist.get_world_size(group)
    own = (-(-first // half), min(-(-stop // half), blocks)) if stop > first else (0, 0)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([own[1] - own[0]], dtype=torch.int64, device=device), group=group)
    sizes = [int(s) for s in sizes]
    mine = torch.zeros(max(sizes), dtype=torch.float32, device=device)
    mine[:own[1] - own[0]] = absmax[own[0]:own[1]]
    parts = [torch.empty(max(sizes), dtype=torch.float32, device=device) for _ in range(world)]
    dist.all_gather(parts, mine, group=group)
    out = torch.cat([p[:s].cpu() for p, s in zip(parts, sizes)])
    if out.numel() != blocks:
        raise WeightsError(f"the ranks' 4-bit blocks ({out.numel()}) do not cover the weight's {blocks} blocks")
    return out

