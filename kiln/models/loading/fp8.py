"""Reading an FP8 checkpoint to dequantize (`fp8 = "dequantize"`, the default) shard by shard, and, kept FP8
(`fp8 = "keep"`), the FP8 weights no FP8 module holds (DeepSeek-V4's grouped `wo_a`), which a whole load
dequantizes too.

Each rank reads its piece of an FP8 weight (its rows, columns, or box of them, under any plan whose piece is
a box; the whole weight for one process) and only the scale blocks that piece touches, and dequantizes that
piece alone: Q * S is elementwise, one rounding to the compute dtype, so the piece equals the same piece of a
whole load's dequantization bit for bit (kiln.hub.fp8.dequantize). A tensor that needs a tensor step (stacked
experts, a transpose) is read whole, one at a time, its FP8 sources dequantized with their whole scales as a
whole load does, then cut to this rank's piece (kiln.models.loading.read's general path). The FP8 pairs a whole load keeps
beside the model for a one-process export (`Fp8State.originals`) are not read: kept FP8, where they lie is noted for
a sharded checkpoint's export (kiln.parallel.sharded_fp8_export); one process reads them after the
model (kiln.models.loading.plan.read_held).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from kiln.errors import WeightsError
from kiln.hub.fp8 import FP8, dequantize
from kiln.hub.index import CarriedRef, CheckpointIndex
from kiln.models.common.pretrained import PreTrainedModel


def note_unheld(model: Any, stored: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]) -> None:
    """Kept FP8 (`fp8 = "keep"`): the FP8 weights no FP8 module holds (DeepSeek-V4's grouped `wo_a`), which a
    whole load dequantizes (`stored`: the checkpoint's tensors, `weights`: the state a whole load loads; meta),
    go to the load plan's `unheld_fp8`, read as the dequantized are. A whole load keeps their FP8 pairs for a
    one-process export (`Fp8State.originals`); a sharded read notes where they lie (`note_pairs`)."""
    if model.fp8_state.mode == "keep":
        model.deferred_read.unheld_fp8 = frozenset(k for k, t in stored.items() if t.dtype in (FP8, torch.int8)
                                                   and k in weights and weights[k].dtype != t.dtype)


def _scale_box(index: tuple[slice, ...], block: tuple[int, int] | None) -> tuple[slice, ...]:
    """The scale entries a box of the weight touches: whole blocks around it (leading dims as the box's)."""
    if block is None:
        return ()
    rows, cols = index[-2:]
    return (*index[:-2], slice(rows.start // block[0], -(-rows.stop // block[0])),
            slice(cols.start // block[1], -(-cols.stop // block[1])))


def whole_piece(hf: dict[str, torch.Tensor], name: str, target: torch.Tensor, keymap: Any, path: Path,
                key: str) -> torch.Tensor:
    """This rank's piece of kiln tensor `name`, made from whole HF tensors `hf` (`key`: the first source, for the
    message); cut with no communication where `target` is a DTensor. Empties `hf` once the kiln tensors are made."""
    full, _ = keymap.to_kiln(hf)
    hf.clear()
    value = full[name]
    if tuple(value.shape) != tuple(target.shape):
        raise WeightsError(f"{path}: tensor {key!r} gives {name!r} the shape {tuple(value.shape)}, but this "
                           f"config expects {tuple(target.shape)}")
    if isinstance(target, DTensor):  # this rank's piece of the whole tensor, no communication
        value = distribute_tensor(value, target.device_mesh, target.placements, src_data_rank=None).to_local()
    return value


def read_dequantized(name: str, target: torch.Tensor, index: tuple[slice, ...] | None, sources: list[tuple[str, str]],
                     handles: dict[str, Any], scales: dict[str, str], keymap: Any, path: Path, stage: Any,
                     scheme: Any) -> bool:
    """Fill this rank's piece of kiln tensor `name` (`index`: that piece of a DTensor as a box of the whole, or
    None) from sources some of which are FP8 weights to dequantize (`scales`: weight key -> scale key; `handles`:
    key -> an open safe_open handle, the scales' too). Returns whether it read the sources whole."""
    local = target.to_local() if isinstance(target, DTensor) else target
    if not isinstance(target, DTensor):  # one process: the whole tensor is its piece
        index = tuple(slice(0, n) for n in target.shape)
    key = sources[0][0]
    whole = not (len(sources) == 1 and index is not None and keymap.is_plain(sources[0][1]) \
            and handles[key].get_slice(key).get_dtype() != "I8")  # packed FP4: read whole (two values a byte)
    if not whole:
        assert index is not None  # (a box: `whole` says so)
        weight = handles[key].get_slice(key)
        shape = tuple(weight.get_shape())
        if shape != tuple(target.shape):
            raise WeightsError(f"{path}: tensor {key!r} has shape {shape}, but this config expects {tuple(target.shape)}")
        q = weight[index]  # only this rank's FP8 rows / columns, and the scale blocks around them, leave the file
        s = handles[scales[key]].get_slice(scales[key])[_scale_box(index, scheme.block)]
        value = dequantize(q, s, scheme.block, local.dtype, origin=(index[-2].start, index[-1].start))
        read = q.nbytes + s.nbytes
    else:
        hf = {}
        for k, hf_name in sources:
            t = handles[k].get_tensor(k)
            hf[hf_name] = dequantize(t, handles[scales[k]].get_tensor(scales[k]), scheme.block, local.dtype) \
                if k in scales else t
        read = sum(t.nbytes for t in hf.values())
        value = whole_piece(hf, name, target, keymap, path, key)
    if stage is not None:
        stage.note(read + value.nbytes)
    with torch.no_grad():
        local.copy_(value)
    return whole


def note_pairs(model: PreTrainedModel, stored: dict[str, torch.Tensor], index: CheckpointIndex) -> None:
    """At a shard-by-shard load kept FP8, before its meta pairs are dropped: where each pair a whole load would keep
    (`model.fp8_state.originals`, its tensors those of `stored`, the checkpoint's meta tensors by key) lies in the
    files of `index`, as `model.carried.fp8_pairs` (name the save writes -> (weight ref, scale ref))."""
    state = model.fp8_state
    if state is None or state.mode != "keep" or not state.originals:
        return
    key_of = {id(t): k for k, t in stored.items()}

    def ref(t: torch.Tensor) -> CarriedRef:
        return index.ref(key_of[id(t)], t.dtype, tuple(t.shape))

    model.carried.fp8_pairs = {name: (ref(q), ref(s)) for name, (q, s) in state.originals.items()}

