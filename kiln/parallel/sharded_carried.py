"""Tensors a family carries beside its model, in a run read shard by shard: recorded where they lie, not held.

A family's own load keeps some checkpoint tensors the model has no module for and writes them back on export
(DeepSeek-V3's multi-token-prediction layer `model.layers.{num_hidden_layers}.*` in `hf_extras`, a Qwen3.5
release's `mtp.*` in `hf_passthrough`, DeepSeek-V4's `mtp.*` in `mtp_tensors`). They are not trained, and at
real size they are large (V3's MTP layer is ~11B parameters with its experts), so a sharded run does not read
them: `lean_pretrained` runs the family's load on the headers, and each tensor it carries exactly as stored (the
same checkpoint tensor, its stored dtype and shape) stays a meta placeholder in its holder, with a `CarriedRef`
(source directory, file, tensor name, dtype, shape, the file's size and mtime) in `model.carried.refs`. An FP8 (or
packed FP4) weight a whole load dequantizes to carry (an FP8 release's MTP layer; the whole load keeps its pair aside
to write it back unchanged) is held so too, as its stored pair, where the family `carries_fp8_pairs` (DeepSeek-V3 and
the families built on it, V4): the weight and its scale, each a placeholder with its reference, the weight's noting
the dtype the whole load dequantizes it to. An export kept FP8 writes the release's bytes; one that writes no FP8 (a
run that dequantized its base, the default, whose config then drops `quantization_config`; or one in one dtype)
dequantizes each pair as it reads it, as the whole load holds it (`as_written`, `load_written`).

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
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kiln.errors import KilnError
from kiln.hub.config import write_json_atomic
from kiln.hub.fp8 import FP8, dequantize, logical_shape
from kiln.hub.index import CarriedRef, CheckpointIndex, tensor_spans

CARRIED_FILE = "carried.json"  # beside model/config.json of a sharded checkpoint
HOLDERS = ("hf_extras", "hf_passthrough", "mtp_tensors")  # the attributes a family carries tensors in


def note_carried(model: torch.nn.Module, weights: dict[str, torch.Tensor], unplaced: list[str],
                 index: CheckpointIndex) -> list[str]:
    """After the family's own load ran on the headers (`weights`: the meta tensors it was given): each carried
    tensor that is one of the `unplaced` checkpoint tensors as stored stays in its holder as a meta placeholder,
    referenced in `model.carried.refs` ((holder, name) -> CarriedRef); so does, for a family that `carries_fp8_pairs`,
    each FP8 (or packed FP4) weight a whole load dequantized to carry: its stored weight and its scale, the scale
    right after it under the name the whole load's export writes it under (`scheme.scale_key`). Any other meta
    tensor a holder got is dropped (a read cannot fill it). Returns the unplaced keys not carried so: a whole
    load decides on those."""
    wanted = set(unplaced)
    spans = {k: (index.file_of(k), s) for k, s in index.spans.items() if k in wanted}
    # the very tensor the load was given for that key, as stored (not a dequantized or renamed stand-in)
    by_id = {id(weights[k]): k for k in unplaced if k in weights and k in spans
             and (weights[k].dtype, tuple(weights[k].shape)) == (spans[k][1].dtype, tuple(spans[k][1].shape))}
    pairs = _stored_pairs(model, weights, unplaced, spans)
    scheme = model.fp8_state.scheme if pairs else None
    refs: dict[tuple[str, str], CarriedRef] = {}
    for holder in HOLDERS:
        held = getattr(model, holder, None)
        if not held:
            continue
        kept: dict[str, torch.Tensor] = {}
        for name, t in held.items():
            if id(t) in by_id:
                found = [(name, by_id[id(t)], t, None)]
            elif id(t) in pairs:  # the dequantized stand-in of an FP8 weight: its stored pair instead
                scale = scheme.scale_key(name)
                found = [(n, k, torch.empty(spans[k][1].shape, dtype=spans[k][1].dtype, device="meta"), deq)
                         for n, k, deq in zip((name, scale), pairs[id(t)],
                                              ((scale, str(t.dtype).removeprefix("torch."), scheme.block), None))]
            else:
                if not t.is_meta:
                    kept[name] = t
                continue
            for n, key, placeholder, deq in found:
                kept[n] = placeholder
                refs[(holder, n)] = index.ref(key, placeholder.dtype, tuple(placeholder.shape), deq)
        held.clear()  # (in place: the family may hold the same dict elsewhere)
        held.update(kept)
    model.carried.refs = refs
    carried = {r.key for r in refs.values()}
    if pairs and model.carried.fp8_pairs:  # kept FP8: a pair carried as stored is written as held, not
        # also written back from the pairs a whole load keeps (kiln.parallel.sharded_fp8_export)
        model.carried.fp8_pairs = {n: pair for n, pair in model.carried.fp8_pairs.items() if pair[0].key not in carried}
    return [k for k in unplaced if k not in carried]


def _stored_pairs(model: torch.nn.Module, weights: dict[str, torch.Tensor], unplaced: list[str],
                  spans: dict[str, tuple[Path, Any]]) -> dict[int, tuple[str, str]]:
    """id of the dequantized stand-in the family's load was given for an unplaced FP8 (or packed FP4) weight ->
    (its key, its scale's key), both unplaced, for a family that `carries_fp8_pairs` (DeepSeek-V3, V4: its
    save writes them as held, its `enable_mtp` takes them as dequantized); {} for any other."""
    state = getattr(model, "fp8_state", None)
    if state is None or not getattr(model, "carries_fp8_pairs", False):
        return {}
    out = {}
    for k in unplaced:
        scale = state.scheme.scale_key(k)
        if k in weights and k in spans and scale in spans and spans[k][1].dtype in (FP8, torch.int8) \
                and weights[k].dtype != spans[k][1].dtype:
            out[id(weights[k])] = (k, scale)
    return out


def placeholders(model: torch.nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """The carried placeholders still held (holder -> name -> meta tensor): those a live MTP module took are gone."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for (holder, name) in model.carried.refs:
        t = (getattr(model, holder, None) or {}).get(name)
        if t is not None and t.is_meta:
            out.setdefault(holder, {})[name] = t
    return out


def read_keys(model: torch.nn.Module) -> set[str]:
    """The checkpoint keys the family's load took (held by reference, or since made live: an MTP module's
    parameters, its copies of the shared embedding and head): a read reports them used, not ignored."""
    return {r.key for r in model.carried.refs.values()}


def carried_keys(model: torch.nn.Module, live_mtp: bool = False, checkpoint_keys: Iterable[str] = ()
                 ) -> tuple[set[str], set[str]]:
    """(carried, dropped) checkpoint keys of a model the family's load built on the headers (sharded_load.read_plan):
    those it holds by reference, and with `live_mtp` ([moe] mtp_weight makes the MTP layer live on the model on meta
    before the read, as the Trainer does) those the live layer holds nowhere (DeepSeek-V3's copies of the shared
    embedding and head). What `kiln plan` leaves out of the weights such a read holds. `checkpoint_keys`: all the
    checkpoint's keys, which name the carried ones as a load does (alone, a Qwen3.5 release's `mtp.*` would read as
    a base model's, under `model.`, and the live layer's parameters as held nowhere)."""
    keys = read_keys(model)
    if not live_mtp or not keys or not hasattr(model, "enable_mtp"):
        return keys, set()
    model.enable_mtp("kiln plan")
    refs = model.carried.refs
    still = {refs[(holder, name)].key for holder, held in placeholders(model).items() for name in held}
    keymap, params = model.family.keymap(model.task), model.state_dict(keep_vars=True)
    names = model.normalise_hf_names(list(keys | set(checkpoint_keys)))
    return still, {k for k in keys - still if keymap.kiln_name(names[k][0]) not in params}


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

