"""Tensors a family carries beside its model, in a sharded checkpoint and its export: written as references.

The load plan (kiln.models.loading.carried) holds each tensor a family carries (an MTP layer) as a meta placeholder
with a `CarriedRef` in `model.carried.refs`, an FP8 pair a whole load dequantizes to carry as its stored pair (the
weight's reference noting the dtype the whole load dequantizes it to). An export kept FP8 writes the release's
bytes; one that writes no FP8 (a run that dequantized its base, the default, whose config then drops
`quantization_config`; or one in one dtype) dequantizes each pair as it reads it, as the whole load holds it
(`as_written`, `load_written`).

`save_sharded` writes those references (model/CARRIED_FILE) instead of their bytes, and `export_sharded` reads
each from its source file when it writes the output shard that holds it, byte for byte as a whole load carried
it; a source that is missing or changed since the run read it is an error naming the tensor and the file.
One process (`load_to_device`) keeps loading such checkpoints whole: its export is `save_pretrained`, which
holds the model anyway.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open

from kiln.errors import KilnError
from kiln.hub.config import write_json_atomic
from kiln.hub.fp8 import dequantize, logical_shape
from kiln.hub.index import CarriedRef, tensor_spans
from kiln.models.loading.carried import HOLDERS, placeholders  # noqa: F401 - HOLDERS: the holders a checkpoint names

CARRIED_FILE = "carried.json"  # beside model/config.json of a sharded checkpoint


def write_refs(out_dir: Path, model: torch.nn.Module) -> None:
    """The references of the placeholders `model` holds, to out_dir/CARRIED_FILE atomically (none: no file)."""
    held = placeholders(model)
    # in the holders' order (the family's load's): the export writes them in it, as a whole load's export does
    refs = [{"holder": h, "name": n, **dataclasses.asdict(r)} for (h, n), r in model.carried.refs.items()
            if n in held.get(h, {})] if held else []
    if refs:
        write_json_atomic(out_dir / CARRIED_FILE, refs)
    else:  # no file, and none left by an earlier save in this directory
        (out_dir / CARRIED_FILE).unlink(missing_ok=True)


def read_refs(ckpt: Path) -> dict[tuple[str, str], CarriedRef]:
    """(holder, name) -> CarriedRef, from a sharded checkpoint's model/CARRIED_FILE ({} without one), each checked
    against its source file's size, mtime and header (no data read), so an export fails before it writes."""
    f = ckpt / "model" / CARRIED_FILE
    if not f.is_file():
        return {}
    try:
        rows = json.loads(f.read_text())
        refs = {(r.pop("holder"), r.pop("name")): CarriedRef.from_row(r) for r in rows}
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise KilnError(f"{f}: not a list of carried-tensor references ({e})") from None
    lone = [(h, n, r.dequantized[0]) for (h, n), r in refs.items()
            if r.dequantized and (h, r.dequantized[0]) not in refs]
    if lone:
        raise KilnError(f"{f}: the FP8 weight {lone[0][1]!r} ({lone[0][0]}) names its scale {lone[0][2]!r}, which is "
                        "not among the references")
    by_file: dict[Path, list[tuple[tuple[str, str], CarriedRef]]] = {}
    for w, ref in refs.items():
        by_file.setdefault(Path(ref.source) / ref.file, []).append((w, ref))
    for held in by_file.values():
        for (holder, name), ref in held:
            why = _changed(ref)
            if why is not None:
                raise _gone(ckpt, holder, name, ref, why)
        spans = tensor_spans(Path(held[0][1].source) / held[0][1].file)
        for (holder, name), ref in held:
            s = spans.get(ref.key)
            if s is None or str(s.dtype).removeprefix("torch.") != ref.dtype or s.shape != ref.shape:
                raise _gone(ckpt, holder, name, ref, f"no longer holds {ref.key!r} as {ref.dtype}{list(ref.shape)}")
    return refs


def load_ref(ckpt: Path, holder: str, name: str, ref: CarriedRef) -> torch.Tensor:
    """The carried tensor `ref` names, read from its source file, after checking the file is the one the run read."""
    why = _changed(ref)
    if why is None:
        with safe_open(str(Path(ref.source) / ref.file), framework="pt") as h:
            t = h.get_tensor(ref.key) if ref.key in h.keys() else None  # noqa: SIM118 - safe_open has keys(), no `in`
        if t is None or str(t.dtype).removeprefix("torch.") != ref.dtype or tuple(t.shape) != ref.shape:
            why = f"no longer holds {ref.key!r} as {ref.dtype}{list(ref.shape)}"
    if why is not None:
        raise _gone(ckpt, holder, name, ref, why)
    return t


def as_written(refs: dict[tuple[str, str], CarriedRef], plain: bool) -> dict[tuple[str, str], torch.Tensor]:
    """The referenced tensors an export writes, as meta tensors by (holder, name): each as stored; where the export
    writes no FP8 (`plain`: the model it saves has no FP8 state, as a run that dequantized its FP8 base, or an export
    in one dtype), each FP8 (FP4) pair a whole load holds dequantized as the one tensor that load holds: its values'
    shape, in the dtype it dequantizes to, its scale left out (as that load's export writes them once plain)."""
    deq = {w: r.dequantized for w, r in refs.items() if plain and r.dequantized}
    scales = {(h, scale) for (h, _), (scale, _, _) in deq.items()}
    return {w: torch.empty(logical_shape(r.meta()), dtype=getattr(torch, deq[w][1]), device="meta") if w in deq
            else r.meta() for w, r in refs.items() if w not in scales}


def load_written(ckpt: Path, w: tuple[str, str], refs: dict[tuple[str, str], CarriedRef], plain: bool
                 ) -> torch.Tensor:
    """The referenced tensor (holder, name) `w` as `as_written` describes it, read from its source file: an FP8 pair
    to write dequantized read weight then scale and dequantized as a whole load dequantizes it (one rounding of
    Q * S to its dtype), so the export's bytes are that load's; one pair held at a time, never the whole layer."""
    ref = refs[w]
    t = load_ref(ckpt, *w, ref)
    if not plain or ref.dequantized is None:
        return t
    scale, dtype, block = ref.dequantized
    return dequantize(t, load_ref(ckpt, w[0], scale, refs[(w[0], scale)]), block, getattr(torch, dtype))


def _changed(ref: CarriedRef) -> str | None:
    f = Path(ref.source) / ref.file
    if not f.is_file():
        return "is missing"
    stat = os.stat(f)
    if (stat.st_size, stat.st_mtime_ns) != (ref.size, ref.mtime_ns):
        return (f"changed since the run read it (size {stat.st_size}, mtime_ns {stat.st_mtime_ns}; the run read size "
                f"{ref.size}, mtime_ns {ref.mtime_ns})")
    return None


def _gone(ckpt: Path, holder: str, name: str, ref: CarriedRef, why: str) -> KilnError:
    return KilnError(f"{ckpt}: the carried tensor {name!r} ({holder}) is not in this checkpoint's shards; the run "
                     f"recorded it as {ref.key!r} of {Path(ref.source) / ref.file}, which {why}. Restore that source "
                     "file to export this checkpoint")

