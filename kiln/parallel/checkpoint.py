"""Sharded checkpoints (torch.distributed.checkpoint) for FSDP2 / TP / EP models, and their HF export.

    CKPT/
      model/     config.json (+ tokenizer files, lora.json for a LoRA run, load.json for what a family's own
                 load decided from its checkpoint): what the weights are, written by rank 0, no weights
      dcp/       every rank writes its own shards of the model and optimizer state (DCP format), and one copy
                 of the tensors the family carries beside the model (`carried`: MTP layers, ...)
      trainer.json   step and whatever else the caller keeps (rank 0)

No rank ever gathers the whole model: saving and resuming move only local shards. `export_sharded`
runs in one process without a process group: it builds the model from model/config.json on the
meta device (with the run's LoRA adapters where the shards hold some, each tensor in its saved dtype, the
load's decisions from load.json) and writes an ordinary HF directory, as the family's own save names and lays
it out, output file by output file, materialising only the modules whose tensors go into that
file (DCP reads just them), adapters merged as `kiln export` merges a plain LoRA checkpoint's.

Resharding: DCP records each tensor's whole shape and the pieces every rank wrote, so `load_sharded`
reads a checkpoint into another layout (more or fewer processes, or one plain process); a plain
checkpoint's whole optimizer state goes into a sharded run through `load_full_optimizer`.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE
from torch.distributed.checkpoint.state_dict import (
    OptimizerStateType,
    StateDictOptions,
    get_optimizer_state_dict,
    get_state_dict,
    set_optimizer_state_dict,
    set_state_dict,
)

from kiln.errors import KilnError
from kiln.hub.bnb4 import bnb4_scheme_from_config
from kiln.hub.config import write_config, write_json_atomic
from kiln.hub.jsonio import read_json
from kiln.models.common.keymap import KeyMap
from kiln.models.common.lora import LoraConfig, apply_lora, linear_names, lora_config_of, merge_lora
from kiln.models.common.lora_experts import HOLDER, has_expert_lora
from kiln.models.common.pretrained import PreTrainedModel
from kiln.models.common.quant4 import BUFFERS as Q4_BUFFERS
from kiln.models.common.quant4 import dequantize_bnb4_model, is_4bit, prepare_bnb4_modules
from kiln.models.tasks import BASE
from kiln.parallel.sharded_carried import HOLDERS as CARRIED
from kiln.parallel.sharded_carried import as_written, load_written, read_refs, write_refs
from kiln.parallel.sharded_fp8_export import PAIRS, held_pairs, place_fp8
from kiln.parallel.sharded_fp8_export import decisions as fp8_decisions
from kiln.parallel.sharded_fp8_export import restore as restore_fp8

LORA_FILE = "lora.json"  # a LoRA run's adapter settings (kiln's LoraConfig fields), beside model/config.json


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_sharded(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 trainer_state: dict[str, Any] | None = None) -> Path:
    """Every rank writes its shards of model (and optimizer) state under PATH/dcp; rank 0 the config."""
    path = Path(path)
    if _is_main():
        (path / "model").mkdir(parents=True, exist_ok=True)
        if isinstance(model, PreTrainedModel):  # a kiln model (Family.build set its config and family)
            _write_config(path / "model", model)
            lora = lora_config_of(model)
            if lora is not None:  # alpha and rslora are in no tensor's shape
                write_json_atomic(path / "model" / LORA_FILE, dataclasses.asdict(lora))
            decisions = _load_decisions(model)
            if decisions:  # what the export writes back by (see LOAD_FILE)
                write_json_atomic(path / "model" / LOAD_FILE, decisions)
            write_refs(path / "model", model)  # carried tensors a sharded read left in their files (sharded_carried)
    state: STATE_DICT_TYPE
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    else:
        state = {"model": model.state_dict()}
    carried = _carried(model)
    if carried:  # whole on every rank (not parameters): DCP writes one copy
        state["carried"] = carried
    pairs = held_pairs(model)
    if pairs:  # a whole load kept FP8: the pairs its export writes back (sharded_fp8_export), one copy too
        state[PAIRS] = pairs
    dcp.save(state, checkpoint_id=str(path / "dcp"))
    if _is_main() and trainer_state is not None:
        write_json_atomic(path / "trainer.json", trainer_state)
    if dist.is_initialized():
        dist.barrier()  # the checkpoint is complete only when every rank's shards are down
    return path


def load_sharded(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Read PATH/dcp back into an already parallelized model (and optimizer), each rank its own shards.

    Returns trainer.json's contents ({} if there is none).
    """
    path = Path(path)
    if not (path / "dcp" / ".metadata").is_file():
        raise KilnError(f"{path}: not a sharded checkpoint (no dcp/.metadata inside)")
    # DCP stores every tensor whole-shaped with the pieces each rank wrote, and reads whatever pieces this
    # layout asks for: another number of processes, or one plain process without a group (no_dist)
    single = not dist.is_initialized()
    state: STATE_DICT_TYPE
    if optimizer is not None:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        _dcp_load(state, path, no_dist=single)
        own = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        # Pipeline stages list different parameters in their param groups, and DCP keeps one copy of each group
        # entry: a stage whose groups did not come back would fall to the optimizer's defaults (fused off, ...).
        for group, mine in zip(optimizer.param_groups, own):
            for k, v in mine.items():
                if group.get(k) is None:
                    group[k] = v
    else:
        state = {"model": model.state_dict()}
        _dcp_load(state, path, no_dist=single)  # DTensors and plain tensors are filled in place
    trainer = path / "trainer.json"
    return read_json(trainer, want=dict) if trainer.is_file() else {}


def load_full_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Whole optimizer state (torch's own format: parameters numbered in param-group order, as a plain
    checkpoint holds it) into an optimizer over sharded parameters: every rank keeps its own shard of each
    tensor. Collective: every rank calls it, with the same `state`."""
    # torch's names for the parameters, in the optimizer's order (wrappers such as activation checkpointing
    # stripped, as DCP names them)
    # (an optimizer state dict's "param_groups" is a list of groups by construction)
    groups = cast(list[dict[str, Any]], get_optimizer_state_dict(model, optimizer)["param_groups"])
    names = [fqn for group in groups for fqn in group["params"]]
    numbered = [i for group in state["param_groups"] for i in group["params"]]
    if len(numbered) != len(names):
        raise KilnError(f"the checkpoint's optimizer state covers {len(numbered)} parameters, this run's optimizer "
                        f"{len(names)}; did train.freeze, [lora] or the optimizer change?")
    by_name: OptimizerStateType = {"state": {names[int(i)]: v for i, v in state["state"].items()},
               "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
    set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))


def _dcp_load(state: dict, path: Path, no_dist: bool) -> None:
    with warnings.catch_warnings():  # torch warns on every single-process load, even one asked for
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(state, checkpoint_id=str(path / "dcp"), no_dist=no_dist)
        except CheckpointException as e:  # a BaseException holding each rank's error: said as the file at fault
            why = "; ".join(f"rank {rank}: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                            for rank, (exc, _) in sorted(e.failures.items()))
            raise KilnError(f"{path / 'dcp'}: a shard of this sharded checkpoint cannot be read ({why}); the "
                            "checkpoint is incomplete: resume from or export another one") from None


def is_sharded(path: str | os.PathLike) -> bool:
    return (Path(path) / "dcp" / ".metadata").is_file()


def export_sharded(path: str | os.PathLike, out: str | os.PathLike, max_shard_bytes: int | None = None,
                   dtype: torch.dtype | None = None, stream: bool = True, stats: dict | None = None) -> Path:
    """Write a sharded checkpoint as one HF directory from this one process, output file by output file
    (`stream`; the whole model at once when False, or for an FP8 base); `dtype` writes every weight in it
    (as `kiln export --dtype` does for a plain checkpoint). `stats`, when given, receives the files
    written and the most bytes of weights held at once (`peak_bytes`) beside the whole model's.

    A LoRA run's adapters are rebuilt on the modules that hold them in the shards and merged into their
    base weights, as `kiln export` writes a plain LoRA checkpoint. Every model tensor in the shards must
    find its place in the built model (same name, same shape), else nothing is written.
    """
    from kiln.hub import Tokenizer
    from kiln.models.auto import load_config

    path = Path(path)
    if not is_sharded(path):
        raise KilnError(f"{path}: not a sharded checkpoint (no dcp/.metadata inside)")
    if not (path / "model" / "config.json").is_file():
        raise KilnError(f"{path}: sharded checkpoint without model/config.json; it cannot say which model it holds")
    family, config, task = load_config(path / "model")
    meta = dcp.FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata  # read once, passed down
    saved = {k[len("model."):]: tuple(v.size) if hasattr(v, "size") else None for k, v in meta.items()
             if k.startswith("model.")}  # every model entry by its name in the model, whole shape (None: no tensor)
    lora = _lora_config(path, saved)
    with torch.device("meta"):
        model = family.build(config, task or BASE)
        q4 = bnb4_scheme_from_config(config.extra, str(path / "model" / "config.json"))
        if q4 is not None:  # a 4-bit base (QLoRA): its Linears become Linear4 as the quant state says
            prepare_bnb4_modules(model, _quant_states(path, saved, meta), q4, str(path))
        else:
            place_fp8(model, path, saved, config.extra, meta)
        if lora is not None:  # adapters on modules this model lacks stay out: reported by name just below
            present = set(linear_names(model))
            lora.targets = [m for m in lora.targets if m in present]
            if lora.targets or lora.target_parameters:
                apply_lora(model, lora)
    _check_placed(path, saved, {k: tuple(v.shape) for k, v in model.state_dict().items()})
    _held_as_saved(model, meta)
    _apply_decisions(model, path, meta)
    if Tokenizer.present(path / "model"):
        model.tokenizer = Tokenizer.from_dir(path / "model")
    if not stream or q4 is not None or any(t.dtype == torch.float8_e4m3fn for t in model.state_dict().values()):
        return _export_whole(model, path, out, lora, max_shard_bytes, dtype, meta)
    return _export_streaming(model, path, Path(out), saved, max_shard_bytes, dtype, stats, meta)


def _export_whole(model: PreTrainedModel, path: Path, out: str | os.PathLike, lora: LoraConfig | None,
                  max_shard_bytes: int | None, dtype: torch.dtype | None, meta: dict[str, Any]) -> Path:
    """The whole model in this process's memory, then one save (FP8 bases: their merge re-quantizes blocks)."""
    model.to_empty(device="cpu")  # storage for every tensor, filled below; no init work wasted
    _dcp_load({"model": model.state_dict()}, path, no_dist=True)
    model.tie_weights()
    if (lora is not None or dtype is not None) and any(map(is_4bit, model.modules())):
        model = dequantize_bnb4_model(model, dtype)  # a merged or plain-dtype export of a 4-bit base, as export_model
    if lora is not None:  # an HF directory holds plain weights: W + B A * scaling
        merge_lora(model)
    if dtype is not None:
        from kiln.models.common.fp8 import dequantize_model

        model = dequantize_model(model, dtype)
    plain = model.fp8_state is None  # it writes no FP8: carried FP8 pairs dequantized
    for attr, tensors in _carried_meta(path, plain, meta).items():  # the tensors the family carries, for its save
        read = _read_carried(path, {(attr, n): t for n, t in tensors.items()}, plain)
        setattr(model, attr, {n: t for (_, n), t in read.items()})
    return model.save_pretrained(out, max_shard_bytes=max_shard_bytes)


def _export_streaming(model: PreTrainedModel, path: Path, out: Path, saved: dict[str, tuple[int, ...] | None],
                      max_shard_bytes: int | None, dtype: torch.dtype | None, stats: dict | None,
                      meta: dict[str, Any]) -> Path:
    """Write the HF directory output file by output file: for each, only the modules whose tensors it holds
    are read from the shards (and merged, and cast), and the carried tensors it holds, then freed. The names,
    layout and dtypes are the family's own save's (`hf_state_dict`, run on the model with every other tensor on
    meta), so the files, split and bytes are a whole-model export's (`save_pretrained` after `merge_lora`);
    peak: about one output file, plus the parameters whose values the save reads to pick a dtype."""
    from kiln.hub.weights import SAFE_INDEX, SAFE_SINGLE, shard_names, shard_plan, write_index, write_shard
    from kiln.models.common.fp8 import dequantize_model
    from kiln.models.common.lora import LoraLinear

    keymap = model.family.keymap(model.task)
    stored = {k: v.dtype for k, v in model.state_dict().items()}  # as the shards hold them: read, merged in
    if dtype is not None:  # the dtypes a dtype export holds (and the config it writes): dequantize_model, on meta
        dequantize_model(model, dtype)
    final = {k: v.dtype for k, v in model.state_dict().items()}
    plain = model.fp8_state is None  # it writes no FP8: carried FP8 pairs dequantized
    carried = _carried_meta(path, plain, meta)
    for attr, tensors in carried.items():
        setattr(model, attr, dict(tensors))
    # what the save reads the values of (DeepSeek-V4 writes a float32 parameter in its stored half dtype when
    # that is lossless): held read throughout, small (norms, sinks, hyper-connection parameters)
    pinned = {n: t.to(final[n]) for n, t in _read_model(path, {n: (_whole_shape(saved, n), stored[n])
                                                               for n in model.stored_half}).items()}
    _pin(model, pinned)
    plan = model.hf_state_dict()
    needs = _needs(model, keymap, plan, carried)
    groups = shard_plan([(k, v.numel() * v.element_size()) for k, v in plan.items()], max_shard_bytes)
    names = shard_names(len(groups))
    owners = dict(model.named_modules())
    aliases = _aliases(model, saved)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (SAFE_SINGLE, SAFE_INDEX):
        (out / stale).unlink(missing_ok=True)
    peak = 0
    for name, group in zip(names, groups):
        wanted = list(dict.fromkeys(k for k in (needs[h] for h in group) if isinstance(k, str)))
        modules = list(dict.fromkeys(k.rpartition(".")[0] for k in wanted))
        # a module's own tensors only, unless it holds adapters (merged from its submodules' tensors)
        deep = {m: isinstance(owners[m], LoraLinear) or has_expert_lora(owners[m]) for m in modules}
        for m in modules:
            owners[m].to_empty(device="cpu", recurse=deep[m])
        local = {f"{m}.{k}" if m else k: v for m in modules for k, v in owners[m].state_dict(keep_vars=True).items()
                 if deep[m] or "." not in k}
        for k, v in local.items():  # read (and merged) in the stored dtype, then cast as the whole export casts
            if k in stored and v.dtype != stored[k]:
                v.data = torch.empty_like(v, dtype=stored[k])
        # a tied tensor the shards hold under its partner's name is read from there
        _dcp_load({"model": {aliases.get(k, k): v for k, v in local.items()}}, path, no_dist=True)
        for k in wanted:
            module, leaf = owners[k.rpartition(".")[0]], k.rpartition(".")[2]
            value: torch.Tensor
            if isinstance(module, LoraLinear) and leaf == "weight":  # W + B A * scaling, as merge_lora
                value = module.weight + module.delta_weight().to(module.weight.dtype)
            elif has_expert_lora(module):  # stacked experts: the adapted weight the forward reads, as merge_lora
                value = getattr(module, leaf).detach()
            else:
                value = local[k].detach()
            local[k].data = value.to(final[k])
        _pin(model, pinned)
        held = {w for w in (needs[h] for h in group) if isinstance(w, tuple)}
        for (a, n), t in _read_carried(path, {w: carried[w[0]][w[1]] for w in held}, plain).items():
            _holder(model, a)[n] = t
        hf = model.hf_state_dict()
        write_shard(out, name, {h: hf[h] for h in group})
        peak = max(peak, sum(t.nbytes for t in model.state_dict().values() if not t.is_meta)
                   + sum(_holder(model, a)[n].nbytes for a, n in held))
        del hf
        for a, n in held:
            _holder(model, a)[n] = carried[a][n]
        for m in modules:
            owners[m].to_empty(device="meta", recurse=deep[m])
        _pin(model, pinned)
    if len(groups) > 1:
        write_index(out, sum(v.numel() * v.element_size() for v in plan.values()),
                    {h: name for name, group in zip(names, groups) for h in group})
    if stats is not None:
        stats.update(files=len(names), peak_bytes=peak,
                     model_bytes=sum(t.numel() * t.element_size() for t in model.state_dict().values()))
    for attr in ("lora_config", "lora_targets"):
        if hasattr(model, attr):
            delattr(model, attr)
    _write_config(out, model)
    return out


def _write_config(out: Path, model: PreTrainedModel) -> None:
    """config.json (the task's architecture named) and the tokenizer's files, as the model's save writes them."""
    cfg = model.config.to_dict()
    cfg["architectures"] = [model.family.tasks[model.task].architecture]
    write_config(out, cfg)
    if model.tokenizer is not None:
        model.tokenizer.save(out)


def _holder(model: nn.Module, attr: str) -> dict[str, torch.Tensor]:
    """The dict of carried tensors a model holds under `attr` (one of sharded_carried's HOLDERS)."""
    held = getattr(model, attr)
    if not isinstance(held, dict):
        raise KilnError(f"the model's carried tensors {attr!r} are a {type(held).__name__}, not a dict of tensors")
    return held


def _whole_shape(saved: dict[str, tuple[int, ...] | None], name: str) -> tuple[int, ...]:
    """The whole shape the shards record for model tensor `name` (an entry without one holds no tensor)."""
    shape = saved[name]
    if shape is None:
        raise KilnError(f"the shards hold model entry {name!r}, but not as a tensor")
    return shape


# What a family's own load decides from the checkpoint it reads, and its save writes back by (kiln/models): the
# layout and names (Qwen3.5-MoE's fused experts, DeepSeek-V4's release naming and its key/value norm's name), the half dtype a parameter held
# in float32 was stored in (DeepSeek-V4), and the tensors it carries beside the model's (MTP layers, a vision
# tower). A sharded checkpoint records them (model/LOAD_FILE, and the carried tensors under "carried" in the
# shards), so its export writes what a one-process export of the same weights writes; kept FP8, the scales' names
# and the FP8 pairs of the weights the load dequantized too (sharded_fp8_export).
LOAD_FILE = "load.json"
LOAD_FLAGS = ("fused_experts", "release_layout", "release_kv_norm")


def _load_decisions(model: PreTrainedModel) -> dict[str, Any]:
    out: dict[str, Any] = {k: getattr(model, k) for k in LOAD_FLAGS if isinstance(getattr(model, k, None), bool)}
    if model.stored_half:
        out["stored_half"] = {k: str(v).removeprefix("torch.") for k, v in model.stored_half.items()}
    return out | fp8_decisions(model)  # kept FP8: the scale names and the pairs to write back


def _carried(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    held = {a: {n: t for n, t in (getattr(model, a, None) or {}).items() if not t.is_meta} for a in CARRIED}
    return {a: tensors for a, tensors in held.items() if tensors}  # (meta: held by reference, write_refs)


def _apply_decisions(model: PreTrainedModel, path: Path, meta: dict[str, Any]) -> None:
    """The load decisions a sharded checkpoint recorded, back on the model built from its config."""
    if not (path / "model" / LOAD_FILE).is_file():
        return
    decided = read_json(path / "model" / LOAD_FILE, want=dict)
    for k in LOAD_FLAGS:
        if isinstance(decided.get(k), bool):
            setattr(model, k, decided[k])
    half = decided.get("stored_half") or {}
    bad = sorted(k for k, v in half.items() if not isinstance(getattr(torch, str(v), None), torch.dtype))
    if bad:
        raise KilnError(f"{path / 'model' / LOAD_FILE}: stored_half names no torch dtype for {', '.join(bad[:4])}")
    model.stored_half = {k: getattr(torch, v) for k, v in half.items()}
    restore_fp8(model, path, decided, lambda state: _dcp_load(state, path, no_dist=True), meta)


def _carried_meta(path: Path, plain: bool, meta: dict[str, Any]) -> dict[str, dict[str, torch.Tensor]]:
    """The carried tensors the shards hold (`meta`: the DCP metadata's entries), as meta tensors of their shapes and
    dtypes, by holder and name; and those the run left in its source files, as the export writes them (`plain`: FP8
    pairs dequantized, as_written)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key, m in meta.items():
        if key.startswith("carried."):
            attr, _, name = key[len("carried."):].partition(".")
            out.setdefault(attr, {})[name] = torch.empty(tuple(m.size), dtype=m.properties.dtype, device="meta")
    for (attr, name), t in as_written(read_refs(path), plain).items():
        out.setdefault(attr, {})[name] = t
    return out


def _read_carried(path: Path, which: dict[tuple[str, str], torch.Tensor], plain: bool
                  ) -> dict[tuple[str, str], torch.Tensor]:
    """Those carried tensors read from the shards, or the source files (`which`: (holder, name) -> meta tensor)."""
    if not which:  # an output file that holds none: no source checked, nothing read
        return {}
    refs = read_refs(path)
    got = {w: torch.empty_like(t, device="cpu") for w, t in which.items() if w not in refs}
    state: dict[str, dict[str, torch.Tensor]] = {}
    for (a, n), t in got.items():
        state.setdefault(a, {})[n] = t
    if state:
        _dcp_load({"carried": state}, path, no_dist=True)
    return got | {w: load_written(path, w, refs, plain) for w in which if w in refs}


def _read_model(path: Path, which: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    got = {n: torch.empty(shape, dtype=dt) for n, (shape, dt) in which.items()}
    if got:
        _dcp_load({"model": dict(got)}, path, no_dist=True)
    return got


def _pin(model: nn.Module, pinned: dict[str, torch.Tensor]) -> None:
    for n, t in pinned.items():
        owner, _, leaf = n.rpartition(".")
        module = model.get_submodule(owner)
        p = module._parameters[leaf]
        if p is None:
            raise KilnError(f"{n}: the model's parameter slot is empty; the pinned tensor has no parameter to fill")
        if p.is_meta:  # (a meta tensor's data cannot take a real one: a new parameter, none of them tied)
            module._parameters[leaf] = nn.Parameter(t, requires_grad=p.requires_grad)


def _needs(model: PreTrainedModel, keymap: KeyMap, plan: dict[str, torch.Tensor], carried: dict[str, dict[str, torch.Tensor]]
           ) -> dict[str, str | tuple[str, str]]:
    """HF name the save writes -> what it is made of: the model's tensor (its kiln name, found as the load names
    it, so a release's own names and a fused layout too) or a carried tensor ((holder, name): that tensor)."""
    held = {id(t): (a, n) for a, tensors in carried.items() for n, t in tensors.items()}
    names = model.normalise_hf_names(list(plan))
    state = model.state_dict()
    out: dict[str, str | tuple[str, str]] = {}
    for h, t in plan.items():
        if id(t) in held:
            out[h] = held[id(t)]
            continue
        kiln = keymap.kiln_name(names[h][0])
        if kiln is None or kiln not in state:
            raise KilnError(f"the export writes {h!r}, which comes from no tensor of the model nor one it carries; "
                            "this model's sharded export cannot stream it (export with stream=False)")
        out[h] = kiln
    return out


def _aliases(model: nn.Module, saved: dict[str, tuple[int, ...] | None]) -> dict[str, str]:
    """Tied names the shards lack -> the name of the same tensor that they hold."""
    by_id: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(n)
    out = {}
    for group in by_id.values():
        held = [n for n in group if n in saved]
        for n in group:
            if n not in saved and held:
                out[n] = held[0]
    return out


def _quant_states(path: Path, saved: dict[str, tuple[int, ...] | None], meta: dict[str, Any]
                  ) -> dict[str, torch.Tensor]:
    """The 4-bit Linears' quant-state tensors the shards hold (small: read whole), and their packed weights as meta
    tensors of the saved shape (what `prepare_bnb4_modules` needs to rebuild the modules)."""
    names = [k for k in saved if k.rpartition(".")[2] in Q4_BUFFERS]
    state = {k: torch.empty(_whole_shape(saved, k), dtype=meta["model." + k].properties.dtype, device="cpu")
             for k in names}
    _dcp_load({"model": state}, path, no_dist=True)
    for k in names:
        if k.endswith(".weight_quant_state"):
            weight = k.removesuffix("_quant_state")
            state[weight] = torch.empty(_whole_shape(saved, weight), dtype=torch.uint8, device="meta")
    return state


def _held_as_saved(model: nn.Module, meta: dict[str, Any]) -> None:
    """Each floating-point tensor of the built model in the dtype the run held it in (the shards' dtype, `meta`: the
    DCP metadata's entries), as the run's model, loaded from its checkpoint, held it (a bfloat16 release trains in
    bfloat16, whatever the config says); FP8 and packed 4-bit tensors are placed as saved already."""
    for name, t in model.state_dict(keep_vars=True).items():
        got = getattr(meta.get("model." + name), "properties", None)
        dt = getattr(got, "dtype", None)
        if dt is not None and dt != t.dtype and t.is_floating_point() and dt.is_floating_point \
                and t.element_size() > 1 and dt.itemsize > 1:
            t.data = t.data.to(dt)


def _lora_config(path: Path, saved: dict[str, tuple[int, ...] | None]) -> LoraConfig | None:
    """The LoRA adapters the shards hold, on exactly the modules that hold them (None when there are none).

    The scaling is in no shape: it comes from model/lora.json, or for checkpoints written before that
    file from the run config in trainer.json (`kiln train`'s [lora] table)."""
    modules = sorted({k.removesuffix(".lora_A.weight") for k in saved if k.endswith(".lora_A.weight")})
    if not modules:
        return None
    settings = None
    if (path / "model" / LORA_FILE).is_file():
        settings = read_json(path / "model" / LORA_FILE, want=dict)
    elif (path / "trainer.json").is_file():
        settings = (read_json(path / "trainer.json", want=dict).get("run_config") or {}).get("lora")
    if not isinstance(settings, dict) or "r" not in settings or "alpha" not in settings:
        raise KilnError(f"{path}: the shards hold LoRA adapters ({modules[0]}.lora_A.weight and "
                        f"{2 * len(modules) - 1} more) but neither model/{LORA_FILE} nor trainer.json's run_config "
                        f"has their r and alpha; without the scaling they cannot be merged")
    # a routed-expert adapter sits in `<experts>.lora.<param>` (common/lora_experts.py): it targets `<experts>.<param>`
    hold = f".{HOLDER}."
    params = [m.replace(hold, ".") for m in modules if hold in m]
    return LoraConfig(r=int(settings["r"]), alpha=settings["alpha"], dropout=settings.get("dropout", 0.0),
                      targets=[m for m in modules if hold not in m], use_rslora=bool(settings.get("use_rslora", False)),
                      target_parameters=params)


def _check_placed(path: Path, saved: dict[str, tuple[int, ...] | None], built: dict[str, tuple[int, ...]]) -> None:
    """Every model tensor in the shards has a slot of its shape in the built model: none is silently dropped."""
    unplaced = sorted(set(saved) - set(built))
    if unplaced:
        more = f" and {len(unplaced) - 8} more" if len(unplaced) > 8 else ""
        raise KilnError(f"{path}: the shards hold {len(unplaced)} tensor(s) that the model built from "
                        f"model/config.json has no place for: {', '.join(unplaced[:8])}{more}; nothing exported")
    for k, shape in saved.items():
        if shape is not None and shape != built[k]:
            raise KilnError(f"{path}: tensor {k} has shape {shape} in the shards, the model built from "
                            f"model/config.json expects {built[k]}")
