"""What a sharded run kept FP8 (`fp8 = "keep"`) records so its export writes the FP8 a one-process export writes.

A one-process export of an FP8 release kept FP8 writes each scale under the checkpoint's own name (DeepSeek-V4's
`<module>.scale`, which the load renames `weight_scale_inv`: `Fp8Scheme.scale_names`) and writes the FP8 weights
no FP8 module holds (V4's grouped `wo_a`, dequantized at load) back as the pair it read (`Fp8State.originals`:
byte for byte while unchanged, quantized afresh once trained). The shards hold neither: their scales are named as
the modules name them and those weights are dequantized. So `save_sharded` records both in model/load.json (under
FP8_KEY), and `export_sharded` places the FP8 modules on the model it builds (`place_fp8`) and puts both back on
it (`restore`) before the family's save runs.

The pairs come from where the load left them: a run read shard by shard holds none (kiln.models.loading.fp8); its
load notes where each lies in the source files (kiln.models.loading.fp8.note_pairs, `CarriedRef`s, checked as
carried tensors are: sharded_carried), and the export reads them from there. A whole load holds them: the shards keep one copy
(`held_pairs`, under PAIRS in the DCP state).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.errors import KilnError
from kiln.hub.fp8 import FP8, SCALE_SUFFIX, is_fp4, scheme_from_config
from kiln.models.common.fp8 import dequantize_model, prepare_fp8
from kiln.parallel.sharded_carried import CarriedRef, load_ref

FP8_KEY = "fp8"  # in load.json: {"scale_names": ..., "dequantized": [name, ...], "refs": {name: [weight, scale]}}
PAIRS = "fp8_pairs"  # in the DCP state: a whole load's pairs, `name` and `name + SCALE_SUFFIX`
_HOLDER = "fp8 pair"  # how a missing source names what it was (sharded_carried's message)



def decisions(model: nn.Module) -> dict[str, Any]:
    """load.json's FP8_KEY entry for a model kept FP8 ({} otherwise): the scale naming and the pairs to write back."""
    state = getattr(model, "fp8_state", None)
    if state is None or state.mode != "keep":
        return {}
    refs = model.carried.fp8_pairs
    names = sorted(set(state.originals) | set(refs))
    return {FP8_KEY: {"scale_names": state.scheme.scale_names, "dequantized": names,
                      "refs": {n: [dataclasses.asdict(r) for r in refs[n]] for n in sorted(refs)}}}


def held_pairs(model: nn.Module) -> dict[str, torch.Tensor]:
    """The pairs a whole load kept FP8 holds and no reference covers, for the shards (whole on every rank: DCP
    writes one copy)."""
    state = getattr(model, "fp8_state", None)
    if state is None or state.mode != "keep":
        return {}
    refs = model.carried.fp8_pairs
    out: dict[str, torch.Tensor] = {}
    for name, (q, s) in state.originals.items():
        if name not in refs and not q.is_meta:
            out[name], out[name + SCALE_SUFFIX] = q, s
    return out


def place_fp8(model: nn.Module, path: Path, saved: dict[str, tuple[int, ...] | None], config: dict,
              meta: dict[str, Any]) -> None:
    """On the model `export_sharded` builds on meta: a run that kept an FP8 base FP8 (`fp8 = "keep"`) saved FP8
    weights and their scales: the FP8 modules go where they lie (as `prepare_fp8` places them at load, from the
    saved names, shapes and dtypes; no data read).
    A dequantized run's shards hold no FP8 tensor (nor the FP8 pairs a one-process load keeps to write unchanged
    weights back FP8): its model stays as built, plain, and `quantization_config` leaves its config as
    `dequantize_model` drops it, so the export's config says what its tensors are. `meta`: the DCP metadata's
    entries (`state_dict_metadata`), read once by the export."""
    scheme = scheme_from_config(config, str(path / "model" / "config.json"))
    if scheme is None:
        return
    state = {k: torch.empty(shape, dtype=meta["model." + k].properties.dtype, device="meta")
             for k, shape in saved.items() if shape is not None}
    if not any(t.dtype == FP8 or is_fp4(t) for t in state.values()):
        dequantize_model(model)  # nothing FP8 on meta to convert: the config only
        return
    hf, _ = model.family.keymap(model.task).to_hf(state)
    prepare_fp8(model, hf, scheme, "keep", None, str(path))


def restore(model: nn.Module, ckpt: Path, decided: dict[str, Any], read: Callable[[dict], None],
            meta: dict[str, Any]) -> None:
    """On the model `export_sharded` built: the checkpoint's scale naming, and each pair the run's load kept for
    its export, read from the source files (checked unchanged) or from the shards (`read`: fills a DCP state;
    `meta`: its metadata's entries)."""
    entry = decided.get(FP8_KEY)
    if entry is None:
        return
    where = ckpt / "model" / "load.json"
    state = getattr(model, "fp8_state", None)
    if not isinstance(entry, dict) or not isinstance(entry.get("dequantized"), list) \
            or not isinstance(entry.get("refs"), dict) or not isinstance(entry.get("scale_names"), str):
        raise KilnError(f"{where}: {FP8_KEY!r} is not an object with scale_names, dequantized and refs")
    if state is None:
        raise KilnError(f"{where}: the run kept its FP8 base FP8, but the shards hold no FP8 weight")
    if entry["scale_names"] not in (SCALE_SUFFIX, ".scale"):
        raise KilnError(f"{where}: fp8.scale_names {entry['scale_names']!r} is neither {SCALE_SUFFIX!r} nor '.scale'")
    try:
        refs = {n: tuple(CarriedRef.from_row(r) for r in pair) for n, pair in entry["refs"].items()}
    except (TypeError, KeyError, ValueError) as e:
        raise KilnError(f"{where}: fp8.refs is not a map of [weight, scale] source references ({e})") from None
    pairs = {n: tuple(load_ref(ckpt, _HOLDER, n, r) for r in refs[n]) for n in entry["dequantized"] if n in refs}
    held = [n for n in entry["dequantized"] if n not in refs]
    if held:
        pairs.update(_read_held(ckpt, held, read, meta))
    state.scheme = dataclasses.replace(state.scheme, scale_names=entry["scale_names"])
    state.originals = pairs


def _read_held(ckpt: Path, names: list[str], read: Callable[[dict], None], meta: dict[str, Any]
               ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    keys = [k for n in names for k in (n, n + SCALE_SUFFIX)]
    lost = [k for k in keys if f"{PAIRS}.{k}" not in meta]
    if lost:
        raise KilnError(f"{ckpt}: model/load.json names the FP8 pair {lost[0]!r} the run's load kept, but the shards "
                        f"do not hold it ({len(lost)} missing); this checkpoint cannot write its FP8 weights back")
    got = {k: torch.empty(tuple(meta[f"{PAIRS}.{k}"].size), dtype=meta[f"{PAIRS}.{k}"].properties.dtype)
           for k in keys}
    read({PAIRS: dict(got)})
    return {n: (got[n], got[n + SCALE_SUFFIX]) for n in names}
