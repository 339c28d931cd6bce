"""Build on meta, shard, then read: each process holds and reads only its share of a checkpoint.

    model = empty_pretrained(path, task="causal-lm")      # on the meta device: no memory
    parallelize(model, parallel, world_size, device)      # FSDP2 / TP / EP / PP plans, applied on meta
    read_shards(model, path, device)                      # each rank: its slices, from the files

`read_shards` materialises the model's (possibly sharded, DTensor) parameters on `device` and fills
each from the safetensors files: a tensor that maps one to one onto a checkpoint tensor, sharded on
one dimension, is read as that slice only (`safe_open(...).get_slice`); stacked experts (kiln's (E, ...)
stack of per-expert HF tensors) are read expert by expert, only the experts this rank holds (an ep rank
its E/ep, FSDP's rows of them too); any other (a tensor step such as a transpose, a 2-D placement) is
read whole, one tensor at a time, and this rank's piece taken from it with no communication
(`distribute_tensor(..., src_data_rank=None)`). So a process never holds more than its shards plus one
checkpoint tensor. The tensors equal those of a full load (`kiln.models.auto.load_pretrained`) then the
same plans, bit for bit (tests/parallel).

Straight to the device: when the target is not host memory (`device = "cuda"`), each piece passes through
one bounded host buffer (`HostStage`, sharded_stage.py: a tensor read as stored goes in chunks of at most
`HostStage.limit` bytes; one that needs a tensor step or a column slice, one tensor at a time), so the host never
holds the model, only that buffer. `load_to_device` is the one-process (or DDP) form: build on meta, read to the device.

FP8 block-scaled checkpoints kept FP8 (`fp8 = "keep"`) read like any other: each rank its rows of the FP8
weights (as bytes under FSDP2) and their scales (buffers: whole on every rank, as after a whole load); a tp
rank its FP8 rows or columns and their scale blocks (tp_fp8.py; a piece that is a box is one slice read); ep ranks
their experts' FP8 stacks and scale grids only (ep.py). Scales under DeepSeek-V4's `<module>.scale` names map as
a whole load renames them. FP8 to dequantize (the default), and kept FP8 weights no FP8 module holds (DeepSeek-V4's
grouped `wo_a`), are read as sharded_fp8.py says.

A family with its own load (`load_hf_state_dict`) has it run on the headers, so what it decides from the names and
dtypes it decides as on a whole load: Qwen3.5-MoE's fused expert layout (exported fused), DeepSeek-V4's release
naming and the parameters it holds in float32 (norms, sinks, hyper-connections: read into float32); the tensors it
carries beside the model (MTP layers) are held by reference, not read (sharded_carried), an FP8 release's MTP weights
(DeepSeek-V3 / V3.2 / GLM-5 / V4) as their stored pairs (a live MTP module's parameters are read dequantized,
sharded_fp8). A new head and a PEFT adapter beside the weights: drawn and put on as a whole load does (sharded_fresh).
Not covered yet (loaded whole): other carried tensors the family's load does not keep as stored, what sharded_fresh
does not take, `.bin` weights that are FP8 or 4-bit, carry tensors, or are not stored in place (a pre-1.6 or
compressed PyTorch file, a strided tensor: `kiln.hub.pickled.NotInPlace`). Plain `.bin` weights (pytorch_model.bin,
or shards and their index) read like safetensors: where each tensor lies comes from their pickle read onto meta (no
data), and each rank reads its slices from the file (`kiln.hub.index.CheckpointIndex`, `SpanReader`). 4-bit bases (a
bitsandbytes-4bit directory, or `[model] quantize`) read as kiln.parallel.sharded_q4 says: each rank its run of the
packed bytes (quantized at load from the stored values of its blocks), and the small quant state whole.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.errors import WeightsError
from kiln.hub import Tokenizer
from kiln.hub.bnb4 import bnb4_scheme_from_config
from kiln.hub.fp8 import scale_renames, scheme_from_config
from kiln.hub.index import CheckpointIndex, Span, read_into
from kiln.hub.pickled import NotInPlace
from kiln.models.auto import apply_changes, config_of_dir
from kiln.models.load_plan import DeferredRead
from kiln.models.pretrained import LoadReport, PreTrainedModel
from kiln.models.tasks import BASE
from kiln.parallel.sharded_carried import note_carried, placeholders, read_keys
from kiln.parallel.sharded_fp8 import dequantized_pairs, needs_pairs, note_unheld, read_dequantized, whole_piece
from kiln.parallel.sharded_fp8_export import note_pairs
from kiln.parallel.sharded_fresh import init_fresh, start_draws, with_adapter
from kiln.parallel.sharded_q4 import WholeLoad4, place_q4, q4_keys, q4_names, read_q4
from kiln.parallel.sharded_stage import HostStage, host_stage


class QuantizedBin(NotInPlace):
    """FP8 or 4-bit weights in .bin files: loaded whole (`read_plan` still builds the model to see what it carries)."""


def lean_pretrained(path: str | os.PathLike, task: str | None, seed: int | None, fp8: str = "dequantize",
                    quantize: str | None = None, **changes: Any) -> PreTrainedModel | None:
    """`empty_pretrained` when this checkpoint can be read shard by shard (safetensors, or .bin stored in place; a new
    head or an adapter beside it: kiln.parallel.sharded_fresh; 4-bit: kiln.parallel.sharded_q4); else None: the
    caller loads it whole.
    The model's `deferred_read` (kiln.models.load_plan.DeferredRead: the checkpoint's index, the seed) is what the
    Trainer reads it by (`init_adapters`, `read_shards`)."""
    index = CheckpointIndex.open(path)  # the path resolved once; each file's header read once, for every step
    empty = readable_empty(index, task, fp8, quantize, **changes)
    if empty is None:
        return None
    model, groups = empty
    q4 = q4_names(model)
    missing = [n for n, _ in (*model.named_parameters(), *model.named_buffers()) if n not in groups and n not in q4]
    if (missing and not init_fresh(model, index, missing, seed)) or not with_adapter(model, index.root, seed,
                                                                                     init_adapters):
        return None  # a new head or an adapter that only a whole load puts on (kiln.parallel.sharded_fresh)
    model.deferred_read.seed = seed
    if Tokenizer.present(index.root):
        model.tokenizer = Tokenizer.from_dir(index.root)
    return model


def readable_empty(path: str | os.PathLike | CheckpointIndex, task: str | None = None, fp8: str = "dequantize",
                   quantize: str | None = None, **changes: Any
                   ) -> tuple[PreTrainedModel, dict[str, list[tuple[str, str]]]] | None:
    """`empty_pretrained`'s model (and the checkpoint keys of each of its tensors) when the checkpoint can be read
    shard by shard, else None (a whole load); from the headers only (`kiln plan` asks what a read holds)."""
    model, groups, why = read_plan(path, task, fp8, quantize, **changes)
    return None if why is not None else (model, groups)


def read_plan(path: str | os.PathLike | CheckpointIndex, task: str | None = None, fp8: str = "dequantize", quantize: str | None = None,
              **changes: Any) -> tuple[PreTrainedModel | None, dict[str, list[tuple[str, str]]], str | None]:
    """(model, groups, why): `empty_pretrained`'s model and the checkpoint keys of each of its tensors, and why the
    checkpoint loads whole on every rank (None: it reads shard by shard). The model is the family's load run on the
    headers also where the checkpoint loads whole (what it carries: sharded_carried.carried_keys; an FP8 or 4-bit .bin
    is built for that alone, with no groups); None (and {}) where the headers cannot be taken so (a .bin not stored
    in place, a 4-bit base no read takes: `why` says which)."""
    index = path if isinstance(path, CheckpointIndex) else CheckpointIndex.open(path)
    path = index.root
    try:
        model, groups, unplaced = _empty(index, task, fp8, changes, quantize)
    except QuantizedBin as e:  # an FP8 or 4-bit .bin: the family's load on its headers still says what it carries
        try:
            model = _empty(index, task, fp8, changes, quantize, quantized_bin=True)[0]
        except (WholeLoad4, NotInPlace, WeightsError):  # (a 4-bit base's quant state is read as safetensors)
            model = None
        return model, {}, str(e)
    except (WholeLoad4, NotInPlace) as e:
        return None, {}, str(e)
    if placeholders(model) and any(f.suffix == ".bin" for f in index.files):
        bins = sorted(f.name for f in index.files if f.suffix == ".bin")
        return model, groups, (f"{path}: {bins[0]}{' ...' if len(bins) > 1 else ''}: .bin weights with tensors "
                               f"the family carries beside the model (an MTP layer) load whole: a sharded read "
                               f"refers to carried tensors in safetensors files only")  # (sharded_carried)
    if unplaced and type(model).load_hf_state_dict is not PreTrainedModel.load_hf_state_dict:
        # the family's own load keeps tensors the model has no place for, not as stored: a whole load
        return model, groups, (f"{path}: the family's own load keeps {len(unplaced)} tensor(s) the model has no "
                               f"place for, not as stored ({', '.join(map(repr, unplaced[:2]))}); it loads whole")
    return model, groups, None


def empty_pretrained(path: str | os.PathLike | CheckpointIndex, task: str | None = None, fp8: str = "dequantize",
                     quantize: str | None = None, **changes: Any) -> PreTrainedModel:
    """The model of an HF directory built on the meta device (no weights read): for `read_shards`.

    A block-scaled FP8 checkpoint is built kept FP8 (`fp8 = "keep"`: FP8 modules, each weight and its scale in
    the stored dtypes, read shard by shard as bytes like any other tensor), or dequantized piece by piece as read.
    A bitsandbytes-4bit directory, or `quantize` ("nf4" | "fp4"), is built with 4-bit Linears (sharded_q4)."""
    index = path if isinstance(path, CheckpointIndex) else CheckpointIndex.open(path)
    return _empty(index, task, fp8, changes, quantize)[0]


def _empty(index: CheckpointIndex, task: str | None, fp8: str, changes: dict[str, Any], quantize: str | None = None,
           quantized_bin: bool = False) -> tuple[PreTrainedModel, dict[str, list[tuple[str, str]]], list[str]]:
    """`empty_pretrained`'s model, its `_sources` groups and the checkpoint keys that land in none of its tensors
    (extras, unmatched, or a kiln name it lacks), from one read of the checkpoint's headers. `quantized_bin`: an FP8
    or 4-bit .bin is built too (not to be read: `read_plan` asks what its family's load carries)."""
    path = index.root
    family, config, source_task = config_of_dir(path)
    source = str(Path(path) / "config.json")
    scheme = None if bnb4_scheme_from_config(config.extra, source) else scheme_from_config(config.extra, source)
    files = index.files
    if any(f.suffix == ".bin" for f in files) and "quantization_config" in config.extra and not quantized_bin:
        raise QuantizedBin(f"{path}: FP8 or 4-bit .bin weights load whole; a sharded read takes them as safetensors")
    config = apply_changes(config, dict(changes))
    with torch.device("meta"):
        model = family.build(config, task or source_task or BASE)
    model.deferred_read = DeferredRead(index, source_task)  # what this build decides, for the read
    spans = index.spans
    weights = index.meta()
    if scheme is not None:
        weights = _place_fp8(model, weights, scheme, index, fp8)
    groups, extras = _sources(model, spans)
    model.deferred_read.q4 = place_q4(model, groups, index, config.extra, quantize)
    q4 = q4_names(model)
    tensors = model.state_dict(keep_vars=True)
    placed = {k for kiln, sources in groups.items() if kiln in tensors for k, _ in sources} | q4_keys(model, spans)
    placed |= {s for k, s in dequantized_pairs(model, spans).items() if k in placed}  # read with their weights
    for name, t in tensors.items():  # each tensor in its stored dtype, as a whole load (4-bit ones: as packed; FP8
        if name in groups and name not in q4:  # to dequantize: in the load's dtype)
            key = groups[name][0][0]
            dtype = (weights[key] if key in weights else spans[key]).dtype
            if t.dtype != dtype:
                t.data = t.data.to(dtype)
    if type(model).load_hf_state_dict is not PreTrainedModel.load_hf_state_dict:
        # the family's own load, run on the headers: what it decides from the names and dtypes (Qwen3.5-MoE's
        # fused expert layout, DeepSeek-V4's release naming and the parameters it holds in float32) it decides
        # as on a whole load; the read fills the values; what it carries stays a reference (sharded_carried)
        model.load_hf_state_dict({k: v for k, v in weights.items() if k not in extras}, source=str(path),
                                 source_task=source_task)
        return model, groups, note_carried(model, weights, [k for k in spans if k not in placed], index)
    return model, groups, [k for k in spans if k not in placed]


def _place_fp8(model: PreTrainedModel, weights: dict[str, torch.Tensor], scheme: Any, index: CheckpointIndex,
               fp8: str) -> dict[str, torch.Tensor]:
    """Put the FP8 modules where the FP8 weights land (kept), or note the weights to dequantize, decided from the
    headers (`weights`: meta tensors) as a whole load decides it from the tensors; returns the state a whole load
    would load (meta). An FP8 weight to dequantize (all of them, or kept, those no FP8 module holds) is read
    dequantized piece by piece; the pairs a whole load keeps for a one-process export are not held (sharded_fp8)."""
    from kiln.models.common.fp8 import prepare_fp8

    stored, weights = weights, prepare_fp8(model, weights, scheme, fp8, None, str(index.root))
    note_unheld(model, stored, weights)
    note_pairs(model, stored, index)  # where the pairs not held lie, for a sharded checkpoint's export
    model.fp8_state.originals = {}
    return weights


def _meta(spans: dict[str, Span]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors as meta tensors of their stored shapes and dtypes (from the headers)."""
    return {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in spans.items()}


def _sources(model: PreTrainedModel, spans: dict[str, Span]) -> tuple[dict[str, list[tuple[str, str]]], list[str]]:
    """kiln name -> [(checkpoint key, its normalised HF name)], and the keys kept verbatim (extras). Scales
    stored as DeepSeek-V4's `<module>.scale` map under their `_scale_inv` names, as a whole load renames them."""
    keymap = model.family.keymap(model.task)
    state = getattr(model, "fp8_state", None)
    renames = scale_renames(_meta(spans)) if state is not None and state.scheme.scale_names == ".scale" else {}
    names = model.normalise_hf_names([renames.get(k, k) for k in spans])
    groups: dict[str, list[tuple[str, str]]] = {}
    extras = []
    for key in spans:
        name, is_extra = names[renames.get(key, key)]
        if is_extra:
            extras.append(key)
            continue
        kiln = keymap.kiln_name(name)
        if kiln is not None:
            groups.setdefault(kiln, []).append((key, name))
    return groups, extras


def _box(t: torch.Tensor) -> tuple[slice, ...] | None:
    """This rank's piece of a sharded DTensor as one slice per dimension (a tp rank's rows or columns, under fsdp
    too), when that piece is a box of the whole tensor; None for a plain tensor or any other piece."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(t, DTensor) or not any(p.is_shard() or hasattr(p, "dim") for p in t.placements) \
            or any(p.is_partial() for p in t.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(shape) != tuple(t.to_local().shape):
        return None
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def load_to_device(path: str | os.PathLike, device: torch.device | str, task: str | None = None,
                   seed: int | None = None, fp8: str = "dequantize", quantize: str | None = None,
                   **changes: Any) -> PreTrainedModel | None:
    """The model of an HF directory, read file -> `device` tensor by tensor (no whole copy in host memory), as
    `load_pretrained(path, task, seed=seed, fp8=fp8, quantize=quantize, **changes).to(device)` gives it, in eval
    mode; None when the checkpoint cannot be read so (`lean_pretrained`): the caller loads it whole."""
    if seed is not None:  # load_pretrained's first step (a new head's draws follow it: sharded_fresh)
        torch.manual_seed(seed)
    model = lean_pretrained(path, task, seed, fp8=fp8, quantize=quantize, **changes)
    if model is None or needs_pairs(model) or placeholders(model):  # one process exports FP8 it dequantized from
        return None  # the pairs a whole load keeps (Fp8State.originals), and the tensors a family carries
    read_shards(model, model.deferred_read.index, device)
    return model.eval()


def read_shards(model: PreTrainedModel, path: str | os.PathLike | CheckpointIndex, device: torch.device | str = "cpu",
                stage: HostStage | None = None) -> None:
    """Materialise `model` (built on meta, plans applied) on `device` and fill each tensor this rank holds.

    `path`: the checkpoint's index, or its directory (the index the model was built from is used when it names
    the same directory: its headers are not read again). A device other than the CPU is filled through a
    `HostStage` (made here unless one is given; a given one is used on the CPU too, which is how the tests exercise
    the device path)."""
    device = torch.device(device)
    stage = stage if stage is not None else host_stage(device)
    index = _index_of(model, path)
    index.refresh()  # a file rewritten since the model was built is read as it now is
    path = index.root
    keymap = model.family.keymap(model.task)
    spans = index.spans  # key -> where its bytes lie in its file
    groups, extras = _sources(model, spans)
    q4 = q4_names(model)  # 4-bit Linears: their packed rows and quant state (sharded_q4)
    dequantized = dequantized_pairs(model, spans)  # FP8 weight key -> its scale's, when the model dequantizes them
    # named_parameters / named_buffers list a tied tensor once (under the name the checkpoint holds)
    expected = [n for n, _ in (*model.named_parameters(), *model.named_buffers())]
    absent = [k for k in expected if k not in groups and k not in q4 and not _real(model, k)]
    if absent:
        raise WeightsError(f"{path}: tensor(s) {', '.join(map(repr, absent[:4]))} are not in the checkpoint; "
                           "a sharded read cannot initialise new tensors yet: load the model whole")
    # tensors that are real already (LoRA adapters, see `init_adapters`) survive to_empty
    kept = {n: _local(t).detach().clone() for n, t in (*model.named_parameters(), *model.named_buffers())
            if not t.is_meta}
    model.to_empty(device=device)
    with index.opened() as file_of:
        read_q4(model, spans, file_of, path)
        for name, target in (*model.named_parameters(), *model.named_buffers()):
            if name in q4:
                continue
            if name in kept:
                with torch.no_grad():
                    _local(target).copy_(kept[name])
            elif name in groups:
                keys = [k for k, _ in groups[name]]
                if dequantized.keys() & set(keys):  # FP8 to dequantize (sharded_fp8): its piece and scale blocks
                    with index.readers(keys + [dequantized[k] for k in keys if k in dequantized]) as handles:
                        read_dequantized(name, target, _box(target), groups[name], handles, dequantized, keymap, path,
                                         stage, model.fp8_state.scheme)
                    continue
                if _read_rows(target, groups[name], spans, file_of(groups[name][0][0]), keymap, path, stage) \
                        or _read_experts(target, groups[name], spans, file_of, keymap, path, stage):
                    continue
                # read, not mapped (a mapping's pages would count in this process's RSS until closed): the read
                # never holds more than its shards plus one tensor
                with index.readers([k for k, _ in groups[name]]) as handles:
                    _fill(name, target, groups[name], handles, keymap, path, stage)
    names = model.normalise_hf_names(list(spans))  # from all keys, as a whole load: one alone reads a head's as base
    with index.readers(extras) as handles:  # beside the carried placeholders (sharded_carried)
        model.hf_extras = placeholders(model).get("hf_extras", {}) | {
            names[k][0]: handles[k].get_tensor(k) for k in extras}
    # a checkpoint tensor whose kiln name the model lacks is reported ignored, as a whole load reports it
    held = model.state_dict(keep_vars=True)
    used = {k for kiln, sources in groups.items() if kiln in held for k, _ in sources} | set(extras)
    used |= q4_keys(model, spans) | {s for k, s in dequantized.items() if k in used} | read_keys(model)
    model.load_report = LoadReport(ignored=sorted(names[k][0] for k in spans if k not in used),
                                   initialized=model.deferred_read.fresh_names if model.deferred_read else [])
    model.tie_weights()
    model.deferred_read = None  # read: the model holds its weights


def _index_of(model: PreTrainedModel, path: str | os.PathLike | CheckpointIndex) -> CheckpointIndex:
    """The index to read `model` from: `path` itself, or the one the model was built from when `path` names its
    directory (no header read again), else a new one."""
    if isinstance(path, CheckpointIndex):
        return path
    built = model.deferred_read
    if built is not None and Path(path) == built.index.root:
        return built.index
    return CheckpointIndex.open(path)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _real(model: nn.Module, name: str) -> bool:
    t = model.get_parameter(name) if name in dict(model.named_parameters()) else model.get_buffer(name)
    return not t.is_meta


def init_adapters(model: nn.Module, device: torch.device | str, seed: int | None) -> int:
    """Materialise and initialise the LoRA adapters of a model built on meta, before any plan shards them,
    drawing exactly what `apply_lora` draws on a loaded model right after `load_pretrained(seed=seed)`
    (a checkpoint without new tensors draws nothing before). Returns how many modules it initialised."""
    from kiln.models.common.lora import LoraLinear
    from kiln.models.common.lora_experts import ExpertLora

    adapters = [m for m in model.modules() if isinstance(m, (LoraLinear, ExpertLora)) and m.lora_A.weight.is_meta]
    start_draws(model, seed, device)  # the seed, then past a new head's draws (kiln.parallel.sharded_fresh)
    for m in adapters:
        m.lora_A.to_empty(device=device)
        m.lora_B.to_empty(device=device)
        # the draws of LoraLinear.__init__ on a real base: each nn.Linear's own init, then reset_lora
        m.lora_A.reset_parameters()
        m.lora_B.reset_parameters()
        m.reset_lora()
    return len(adapters)


def _read_rows(target: torch.Tensor, sources: list[tuple[str, str]], spans: dict[str, Span], f: Any, keymap: Any,
               path: Path, stage: HostStage | None) -> bool:
    """Read this rank's rows of a tensor stored as is (whole, or a run of rows: dim 0 split over any mesh, e.g.
    fused experts under ep + fsdp) from the file into `target`'s memory: straight in (no mapping, no copy), or
    through `stage` to another device. False when it is not such a tensor (the caller reads it otherwise)."""
    local = _local(target)
    if len(sources) != 1 or not keymap.is_plain(sources[0][1]) or not local.is_contiguous() \
            or (stage is None and local.device.type != "cpu"):
        return False
    key = sources[0][0]
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
    # DTensor's own arithmetic (what DCP reads by): Shard(0) over ep, FSDP's _StridedShard(0) on top of it
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if any(not p.is_replicate() and getattr(p, "dim", None) != 0 for p in target.placements):
        return None
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    if tuple(shape) != tuple(target.to_local().shape):
        return None
    return offset[0], offset[0] + shape[0]


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


def _fill(name: str, target: torch.Tensor, sources: list[tuple[str, str]], where: dict, keymap: Any,
          path: Path, stage: HostStage | None = None) -> bool:
    """Copy this rank's piece of kiln tensor `name` into `target` (a DTensor's local shard, or a plain tensor): a
    slice read of its box where it has one, else the whole tensor read and cut. Returns whether it read it whole."""
    local = _local(target)
    index = _box(target)
    whole = not (len(sources) == 1 and index is not None and keymap.is_plain(sources[0][1]))
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
