"""Make the load plan: the model on meta and one typed source per tensor, from one read of the checkpoint's headers.

    model, plan = build_plan(index, family, config, source_task, task, fp8, quantize, seed)

(kiln.models.auto.plan_load resolves the family and config first.) The model is built on the meta device and the
family's own load runs on the headers (meta tensors of the stored shapes and dtypes), so what it decides from the names
and dtypes (Qwen3.5-MoE's fused expert layout, DeepSeek-V4's release naming and the parameters it holds in float32,
which tensors it carries) it decides as on a whole load. FP8 modules are placed where a whole load places them (kept)
or their weights noted to dequantize as read; 4-bit Linears are placed (kiln.models.loading.q4); tensors the checkpoint
lacks are drawn as a whole load draws them, and a PEFT adapter beside the weights put on (kiln.models.loading.fresh).
Then each tensor's source is written down (kiln.models.common.load_plan.Source). The plan's `whole` says why a
checkpoint loads whole instead (None: the plan reads it); each such case is listed below, with its reason.
"""

from __future__ import annotations

from typing import Any

import torch

from kiln.errors import WeightsError
from kiln.hub import Tokenizer
from kiln.hub.bnb4 import bnb4_scheme_from_config
from kiln.hub.fp8 import FP8, dequantize, scale_renames, scheme_from_config
from kiln.hub.index import CheckpointIndex, Span
from kiln.hub.pickled import NotInPlace
from kiln.models.common.config import FamilyConfig
from kiln.models.common.load_plan import (
    Assembled,
    Fp8Box,
    Fresh,
    LoadPlan,
    Part,
    Rows4,
    Source,
    Stacked,
    Stored,
)
from kiln.models.common.pretrained import PreTrainedModel
from kiln.models.loading.carried import note_carried, placeholders
from kiln.models.loading.fp8 import note_pairs, note_unheld
from kiln.models.loading.fresh import init_fresh, with_adapter
from kiln.models.loading.q4 import WholeLoad4, place_q4

# Why a checkpoint loads whole (every rank, or one process), each case justified where it is decided:
# - an FP8 or 4-bit `.bin` (`_quantized_bin`): their quant state is read from safetensors headers only;
# - a `.bin` not stored in place (pre-1.6 or compressed, strided: kiln.hub.pickled.NotInPlace): no byte range to read;
# - a 4-bit base this read does not take (kiln.models.loading.q4.WholeLoad4: a family with its own load, a 4-bit
#   directory also quantized, a non-float weight to quantize): the whole load names the mistake or does the work;
# - `.bin` weights with carried tensors: a carried reference points into safetensors files only;
# - a family's own load that keeps tensors the model has no place for, not as stored: nothing to refer to;
# - a new head on a family with its own load (kiln.models.loading.fresh: its fresh init runs on the whole model).


def build_plan(index: CheckpointIndex, family: Any, config: FamilyConfig, source_task: str | None, task: str,
               fp8: str = "dequantize", quantize: str | None = None, seed: int | None = None,
               tokenizer: bool = True, dtype: torch.dtype | None = None) -> tuple[PreTrainedModel | None, LoadPlan]:
    """(the model on meta holding its plan in `deferred_read`, the plan). The model is None where the headers cannot
    be taken so (a `.bin` not stored in place, a 4-bit base no read takes: `plan.whole` says which); an FP8 or 4-bit
    `.bin` is built for what its family carries alone (`kiln plan` asks), its plan whole. `dtype`: what FP8 weights
    dequantize to (a whole load's `dtype`: one rounding, not two)."""
    plan = LoadPlan(index, source_task, seed)
    path, source = index.root, str(index.root / "config.json")
    quantized_bin = any(f.suffix == ".bin" for f in index.files) and "quantization_config" in config.extra
    qbin = f"{path}: FP8 or 4-bit .bin weights load whole; a read from the plan takes them as safetensors"
    try:
        with torch.device("meta"):
            model = family.build(config, task)
        model.deferred_read = plan
        scheme = None if bnb4_scheme_from_config(config.extra, source) else scheme_from_config(config.extra, source)
        unplaced, match = _place(model, plan, config, scheme, fp8, quantize, dtype)
    except (WholeLoad4, NotInPlace, WeightsError) as e:
        if quantized_bin or isinstance(e, (WholeLoad4, NotInPlace)):
            plan.whole = qbin if quantized_bin else str(e)
            return None, plan
        raise
    if quantized_bin:
        plan.whole = qbin
    elif placeholders(model) and any(f.suffix == ".bin" for f in index.files):
        bins = sorted(f.name for f in index.files if f.suffix == ".bin")
        plan.whole = (f"{path}: {bins[0]}{' ...' if len(bins) > 1 else ''}: .bin weights with tensors the family "
                      "carries beside the model (an MTP layer) load whole: a carried tensor is referred to in "
                      "safetensors files only")
    elif unplaced and type(model).load_hf_state_dict is not PreTrainedModel.load_hf_state_dict:
        plan.whole = (f"{path}: the family's own load keeps {len(unplaced)} tensor(s) the model has no place for, "
                      f"not as stored ({', '.join(map(repr, unplaced[:2]))}); it loads whole")
    if plan.whole is None:
        _draw(model, plan, seed, match)
    if plan.whole is None and tokenizer and Tokenizer.present(path):
        model.tokenizer = Tokenizer.from_dir(path)
    return model, plan


def _place(model: PreTrainedModel, plan: LoadPlan, config: FamilyConfig, scheme: Any, fp8: str, quantize: str | None,
           dtype: torch.dtype | None) -> tuple[list[str], tuple[dict[str, torch.Tensor], list[str]] | None]:
    """FP8 and 4-bit modules placed, stored dtypes taken, the family's load run on the headers and every checkpoint
    key's source written down; returns the checkpoint keys that land in no tensor (extras, unmatched, a kiln name the
    model lacks, not carried), and the whole load's own matching on the headers as its `load_hf_state_dict` takes them
    (tensors used, fresh names: kiln.models.loading.fresh.init_fresh), None where it fails or a family loads itself."""
    index = plan.index
    spans = index.spans
    weights = index.meta()
    if scheme is not None:
        from kiln.models.common.fp8 import prepare_fp8

        stored, weights = weights, prepare_fp8(model, weights, scheme, fp8, dtype, str(index.root))
        note_unheld(model, stored, weights)  # kept FP8 weights no FP8 module holds: read dequantized
        note_pairs(model, stored, index)  # where the pairs a whole load keeps lie, for a sharded checkpoint's export
        assert model.fp8_state is not None  # (prepare_fp8 placed it)
        key_of = {id(t): k for k, t in stored.items()}  # the pairs a whole load keeps: read on one process
        plan.fp8_pairs = {n: (key_of[id(q)], key_of[id(s)]) for n, (q, s) in model.fp8_state.originals.items()}
        model.fp8_state.originals = {}
    generic = type(model).load_hf_state_dict is PreTrainedModel.load_hf_state_dict
    bnb = bnb4_scheme_from_config(config.extra, str(index.root / "config.json")) is not None
    match = None
    if generic and not bnb:
        # the whole load's own checks (names, shapes, what the source architecture owes), on the headers, before any
        # quantize at load: a bad checkpoint fails here with the whole load's message (a family's own load runs them
        # below; a 4-bit directory is checked as its quant state is read)
        used, _, fresh, _ = model._match_hf(weights, str(index.root), plan.source_task)
        match = used, fresh
    groups, plan.extras = _groups(model, spans)
    plan.q4 = place_q4(model, groups, index, config.extra, quantize, weights)
    if generic and bnb:
        try:
            used, _, fresh, _ = model._match_hf(weights, str(index.root), plan.source_task)  # prepare_bnb4's state
            match = used, fresh
        except WeightsError:
            pass  # a whole load names it
    q4 = plan.q4.names(model) if plan.q4 else set()
    plan.sources = _sources(model, plan, groups)
    tensors = model.state_dict(keep_vars=True)
    placed = {k for kiln, s in plan.sources.items() if kiln in tensors for k in keys_of(s)}
    placed |= plan.q4.keys(spans) if plan.q4 else set()
    for name, t in tensors.items():  # each tensor in its stored dtype, as a whole load (4-bit ones: as packed; FP8
        if name in groups and name not in q4:  # to dequantize: in the load's dtype)
            key = groups[name][0][0]
            dtype = (weights[key] if key in weights else spans[key]).dtype
            if t.dtype != dtype:
                t.data = t.data.to(dtype)
    unplaced = [k for k in spans if k not in placed]
    if type(model).load_hf_state_dict is not PreTrainedModel.load_hf_state_dict:
        # the family's own load, run on the headers; the read fills the values; what it carries stays a reference
        extras = set(plan.extras)
        model.load_hf_state_dict({k: v for k, v in weights.items() if k not in extras}, source=str(index.root),
                                 source_task=plan.source_task)
        unplaced = note_carried(model, weights, unplaced, index)
    return unplaced, match


def _draw(model: PreTrainedModel, plan: LoadPlan, seed: int | None,
          match: tuple[dict[str, torch.Tensor], list[str]] | None) -> None:
    """The tensors no checkpoint tensor fills drawn as a whole load draws them, and an adapter beside the weights put
    on (kiln.models.loading.fresh); `plan.whole` says why not where this cannot be done so."""
    q4 = plan.q4.names(model) if plan.q4 else set()
    missing = [n for n, _ in (*model.named_parameters(), *model.named_buffers())
               if n not in plan.sources and n not in q4]
    if missing and not init_fresh(model, missing, seed, match):
        plan.whole = (f"{plan.index.root}: tensor(s) {', '.join(map(repr, missing[:3]))} are not in the checkpoint "
                      "and only a whole load draws them here (a family with its own load, a 4-bit base)")
    elif not with_adapter(model, plan.index.root, seed):
        plan.whole = f"{plan.index.root}: a PEFT adapter beside a 4-bit base is put on by a whole load"
    else:
        plan.seed = seed
        keymap = model.family.keymap(model.task)
        for name, t in (*model.named_parameters(), *model.named_buffers()):
            if not t.is_meta and name not in plan.sources:  # drawn (a new head) or read whole (an adapter)
                plan.sources[name] = Fresh(keymap.hf_name(name) or name)


def keys_of(source: Source) -> list[str]:
    """The checkpoint keys a source reads (an FP8 box's scales too)."""
    if isinstance(source, Stored):
        return [source.key]
    if isinstance(source, Fp8Box):
        return [k for k, _ in source.parts] + [s for _, s in source.scales]
    if isinstance(source, (Stacked, Assembled)):
        return [k for k, _ in source.parts]
    if isinstance(source, Rows4):
        return [source.key]
    return []


def _sources(model: PreTrainedModel, plan: LoadPlan, groups: dict[str, list[Part]]) -> dict[str, Source]:
    """kiln name -> its source, for every kiln name the checkpoint gives (the model's tensors and those a live MTP
    layer takes later) and the 4-bit Linears' weights."""
    keymap = model.family.keymap(model.task)
    spans = plan.index.spans
    state = getattr(model, "fp8_state", None)
    scales: dict[str, str] = {}
    if state is not None:  # FP8 (packed FP4) weights read dequantized: all of them, or kept, those no module holds
        scales = {k: state.scheme.scale_key(k) for k, span in spans.items()
                  if span.dtype in (FP8, torch.int8) and state.scheme.scale_key(k) in spans
                  and (state.mode == "dequantize" or k in plan.unheld_fp8)}
    out: dict[str, Source] = {}
    for name, parts in groups.items():
        deq = tuple((k, scales[k]) for k, _ in parts if k in scales)
        if deq:
            out[name] = Fp8Box(tuple(parts), deq)
        elif len(parts) == 1 and keymap.is_plain(parts[0][1]):
            out[name] = Stored(*parts[0])
        elif all(keymap.stack_slot(hf) is not None for _, hf in parts):
            out[name] = Stacked(tuple(parts))
        else:
            out[name] = Assembled(tuple(parts))
    q4 = plan.q4.modules if plan.q4 else {}
    for module in plan.q4.held(model) if plan.q4 else ():
        out[f"{module}.weight"] = Rows4(module, q4[module])
    return out


def _groups(model: PreTrainedModel, spans: dict[str, Span]) -> tuple[dict[str, list[Part]], list[str]]:
    """kiln name -> [(checkpoint key, its normalised HF name)], and the keys kept verbatim (extras). Scales
    stored as DeepSeek-V4's `<module>.scale` map under their `_scale_inv` names, as a whole load renames them."""
    keymap = model.family.keymap(model.task)
    state = getattr(model, "fp8_state", None)
    meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in spans.items()}
    renames = scale_renames(meta) if state is not None and state.scheme.scale_names == ".scale" else {}
    names = model.normalise_hf_names([renames.get(k, k) for k in spans])
    groups: dict[str, list[Part]] = {}
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


def read_held(model: PreTrainedModel, plan: LoadPlan) -> None:
    """One process, after the model is read: what a whole load holds beside it, for `save_pretrained` to write back
    (a sharded run notes where these lie instead): the stored FP8 pairs of the weights read dequantized
    (`Fp8State.originals`), and the tensors the family carries, in their holders: as stored, or (an FP8 release's
    MTP layer) an FP8 pair as the one tensor a whole load holds, dequantized as it dequantizes it, its scale not held."""
    if model.carried.refs:
        refs = model.carried.refs
        for holder, held in placeholders(model).items():
            # a dequantized weight's scale is not held (its pair is kept with the others below, as a whole load keeps it)
            values: dict[str, torch.Tensor | None] = {d[0]: None for n in held if (d := refs[(holder, n)].dequantized)}
            for name in held:
                ref = refs[(holder, name)]
                if name in values:
                    continue
                value = plan.index.read(ref.key)
                if ref.dequantized is not None:
                    scale, dtype, block = ref.dequantized
                    value = dequantize(value, plan.index.read(refs[(holder, scale)].key), block, getattr(torch, dtype))
                values[name] = value
            target = getattr(model, holder)
            kept = {n: values.get(n, t) for n, t in target.items() if values.get(n, t) is not None}
            target.clear()  # (in place, the holder's order kept: the family may hold the same dict elsewhere)
            target.update(kept)
        model.carried.refs = {}  # held, as on a whole load: not referred to as well
    if plan.fp8_pairs and model.fp8_state is not None:
        model.fp8_state.originals = {n: (plan.index.read(w), plan.index.read(s)) for n, (w, s) in plan.fp8_pairs.items()}
        model.carried.fp8_pairs = {}  # held, as on a whole load: not referred to as well
