"""Tensors a family carries beside its model, in a load from a plan: recorded where they lie, not held.

A family's own load keeps some checkpoint tensors the model has no module for and writes them back on export
(DeepSeek-V3's multi-token-prediction layer `model.layers.{num_hidden_layers}.*` in `hf_extras`, a Qwen3.5
release's `mtp.*` in `hf_passthrough`, DeepSeek-V4's `mtp.*` in `mtp_tensors`). They are not trained, and at
real size they are large (V3's MTP layer is ~11B parameters with its experts), so a read from the plan does not read
them: the plan runs the family's load on the headers, and each tensor it carries exactly as stored (the same
checkpoint tensor, its stored dtype and shape) stays a meta placeholder in its holder, with a `CarriedRef` (source
directory, file, tensor name, dtype, shape, the file's size and mtime) in `model.carried.refs`. An FP8 (or packed FP4)
weight a whole load dequantizes to carry (an FP8 release's MTP layer) is held so too, as its stored pair, where the
family `carries_fp8_pairs` (DeepSeek-V3 and the families built on it, V4). A sharded checkpoint writes the references
and its export reads them from their files (kiln.parallel.sharded_carried).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from kiln.hub.fp8 import FP8
from kiln.hub.index import CarriedRef, CheckpointIndex
from kiln.models.common.pretrained import PreTrainedModel

HOLDERS = ("hf_extras", "hf_passthrough", "mtp_tensors")  # the attributes a family carries tensors in

def note_carried(model: PreTrainedModel, weights: dict[str, torch.Tensor], unplaced: list[str],
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
    scheme = model.fp8_state.scheme if pairs and model.fp8_state is not None else None
    refs: dict[tuple[str, str], CarriedRef] = {}
    for holder in HOLDERS:
        held = getattr(model, holder, None)
        if not held:
            continue
        kept: dict[str, torch.Tensor] = {}
        for name, t in held.items():
            found: list[tuple[str, str, torch.Tensor, tuple[str, str, Any] | None]]
            if id(t) in by_id:
                found = [(name, by_id[id(t)], t, None)]
            elif id(t) in pairs and scheme is not None:  # the dequantized stand-in of an FP8 weight: its stored pair
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

def _stored_pairs(model: PreTrainedModel, weights: dict[str, torch.Tensor], unplaced: list[str],
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

def placeholders(model: PreTrainedModel) -> dict[str, dict[str, torch.Tensor]]:
    """The carried placeholders still held (holder -> name -> meta tensor): those a live MTP module took are gone."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for (holder, name) in model.carried.refs:
        t = (getattr(model, holder, None) or {}).get(name)
        if t is not None and t.is_meta:
            out.setdefault(holder, {})[name] = t
    return out

def read_keys(model: PreTrainedModel) -> set[str]:
    """The checkpoint keys the family's load took (held by reference, or since made live: an MTP module's
    parameters, its copies of the shared embedding and head): a read reports them used, not ignored."""
    return {r.key for r in model.carried.refs.values()}

def carried_keys(model: PreTrainedModel, live_mtp: bool = False, checkpoint_keys: Iterable[str] = ()
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
    model.enable_mtp("kiln plan")  # type: ignore[operator]  # (a family's, where it has one: hasattr above)
    refs = model.carried.refs
    still = {refs[(holder, name)].key for holder, held in placeholders(model).items() for name in held}
    keymap, params = model.family.keymap(model.task), model.state_dict(keep_vars=True)
    names = model.normalise_hf_names(list(keys | set(checkpoint_keys)))
    return still, {k for k in keys - still if keymap.kiln_name(names[k][0]) not in params}

