"""What a resume must not change, and the message when it did.

A checkpoint records a fingerprint (every parameter's shape and dtype, the data source, the
content digests of the tokenizer and of the eval data, the precision, the world size) and the run
config. Resuming with a different fingerprint, or a config
changed in a key that breaks exactness, is refused naming every change; other changed keys (lr,
steps, cadences) are allowed and returned for a note.

A resume on another number of processes reshards (`plan_reshard`): only the data-parallel size may
change (tp, ep, pp, cp stay), and the global batch stays the same rows: the per-process batch_size
becomes global / data-parallel processes, so the loaders (whose cursor counts whole global batches)
hand out the very rows an uninterrupted run would have trained on.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from kiln.data.hfdata import source_sha256
from kiln.errors import KilnError


def model_fingerprint(model: nn.Module) -> dict[str, Any]:
    return {"shapes": {n: list(p.shape) for n, p in model.state_dict().items()},
            "dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})}


def _shape_changes(old: dict[str, list], new: dict[str, list]) -> list[str]:
    out = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        # a 4-bit weight's quant-state JSON: its length is that of the absmax mean's repr, unknown on a model
        # built on meta until its weights are read (kiln.parallel.sharded_q4); its shape and blocks have their own
        if a != b and not (name.endswith(".weight_quant_state") and a is not None and b is not None):
            out.append(f"{name} {tuple(a) if a is not None else 'absent'} -> {tuple(b) if b is not None else 'absent'}")
    return out


# Content digests in the data fingerprint, and what their change means.
_DIGESTS = {
    "tokenizer_sha256": "tokenizer changed: its vocabulary, merges, special tokens or chat template differ from "
                        "the run's, so the same text would train on other token ids",
    "eval_sha256": "eval data changed: data.eval's contents differ from the run's, so evaluations (and the best "
                   "checkpoint) would compare different sets",
}


def tokenizer_digest(tokenizer: Any) -> str:
    """sha256 over what decides token ids: the backend's whole definition (vocabulary, merges, normalizer,
    added tokens), the special tokens by role and the chat template; the file layout does not count."""
    h = hashlib.sha256(tokenizer.backend.to_str().encode())
    h.update(json.dumps(dict(tokenizer.specials), sort_keys=True).encode())
    h.update((getattr(tokenizer, "chat_template", None) or "").encode())
    return h.hexdigest()


def content_digests(model: nn.Module, eval_source: str | None) -> dict[str, str]:
    """The digests a resume compares beside the recipe's fingerprint: the model's tokenizer and the eval data."""
    out: dict[str, str] = {}
    tokenizer = getattr(model, "tokenizer", None)
    if tokenizer is not None and hasattr(tokenizer, "backend"):
        out["tokenizer_sha256"] = tokenizer_digest(tokenizer)
    if eval_source and Path(eval_source).exists():
        out["eval_sha256"] = source_sha256(eval_source)
    return out


def check_fingerprint(path: Path, old: dict[str, Any], new: dict[str, Any],
                      settings: tuple[list[str], list[str]] = ([], []), reshard: bool = False) -> None:
    """Raise a KilnError listing each difference between a checkpoint's fingerprint and this run's, and
    the run-config `settings` changes (refused, allowed; from `config_changes`). With `reshard` (a
    `plan_reshard` accepted the new world size) the world size may differ."""
    refused, allowed = settings
    problems = []
    shapes = _shape_changes(old["model"]["shapes"], new["model"]["shapes"])
    if shapes:
        more = f" (and {len(shapes) - 4} more)" if len(shapes) > 4 else ""
        problems.append("model shape changed: " + "; ".join(shapes[:4]) + more)
    if old["model"]["dtypes"] != new["model"]["dtypes"]:
        problems.append(f"parameter dtype changed: {old['model']['dtypes']} -> {new['model']['dtypes']}")
    if old["precision"] != new["precision"]:
        problems.append(f"precision changed: {old['precision']} -> {new['precision']}")
    for key in sorted(set(old["data"]) | set(new["data"])):
        if key in _DIGESTS and key not in old["data"]:
            continue  # a checkpoint written before kiln recorded this digest
        if old["data"].get(key) != new["data"].get(key):
            a, b = old["data"].get(key), new["data"].get(key)
            problems.append(f"{_DIGESTS[key]} (sha256 {str(a)[:12]} -> {str(b)[:12]})" if key in _DIGESTS
                            else f"data source changed: {key} {a!r} -> {b!r}")
    if old["world_size"] != new["world_size"] and not reshard:
        problems.append(f"world size changed: {old['world_size']} -> {new['world_size']} processes "
                        "(the data order depends on it)")
    if refused:
        problems.append("changed settings that would break the run (model, data, precision, seed, batch size, "
                        f"...): {'; '.join(refused)}")
    if problems:
        raise KilnError(f"cannot resume from {path}: " + "; ".join(problems)
                        + (f" (also changed, which would be fine: {'; '.join(allowed)})" if allowed else "")
                        + ". Undo them, or start a new run in another train.out_dir")


# ---- settings changed between the run and its resume ------------------------------------------
# [train] keys that decide what the run computes (data order, precision, which weights train, which
# checkpoint is best): changing them mid-run gives a run that matches neither the old nor a new one.
_EXACT_TRAIN = {"precision", "seed", "batch_size", "freeze", "best_metric", "best_mode", "group_by_length", "exact"}
# Outside [train] every key shapes the model or the data, except these: speed knobs, and where the starting
# weights came from (a resume reads them from the checkpoint; the fingerprint still checks their shapes).
_HARMLESS = {"data.num_workers", "data.prefetch", "parallel.activation_checkpointing", "parallel.checkpoint_every",
             "model.path"}
_IGNORED = {"train.out_dir"}  # --resume RUN_DIR replaces it


def breaks_exactness(key: str) -> bool:
    section, _, rest = key.partition(".")
    if section == "train":
        return rest.split(".")[0] in _EXACT_TRAIN
    return key not in _HARMLESS


def _show(value: Any) -> str:
    return "unset" if value is None else repr(value)


def _diff(old: Any, new: Any, path: str = ""):
    if isinstance(old, dict) and isinstance(new, dict):
        # keys on one side only come from another kiln version's schema, not from the user
        for key in sorted(set(old) & set(new)):
            yield from _diff(old[key], new[key], f"{path}.{key}" if path else key)
    elif old != new and path not in _IGNORED:
        yield path, f"{path} {_show(old)} -> {_show(new)}", breaks_exactness(path)


def config_changes(old: dict[str, Any] | None, new: dict[str, Any],
                   explained: frozenset[str] = frozenset()) -> tuple[list[str], list[str]]:
    """(refused, allowed): one line per key whose value differs between the checkpoint's run config and
    this one. Refused keys break exactness (model, data, precision, seed, batch size, ...);
    `check_fingerprint` raises on them. Allowed ones (lr, steps, eval and save cadence, ...) are noted.
    Keys in `explained` (a reshard's dp and per-process batch size) are left out: their note says why."""
    changes = [c for c in _diff(old, new) if c[0] not in explained] if old else []
    return [line for _, line, bad in changes if bad], [line for _, line, bad in changes if not bad]


# ---- resuming on another number of processes -------------------------------------------------
# Degrees that split one model replica (or its sequence) over ranks: a checkpoint reshards only over
# data parallelism, so these stay as the run that wrote it had them.
_FIXED_DEGREES = ("tp", "ep", "pp", "cp")


@dataclass(frozen=True)
class Reshard:
    """A resume on `new_world` processes of a checkpoint written by `old_world`."""

    old_world: int
    new_world: int
    old_batch_size: int
    batch_size: int       # per process: keeps `global_batch`
    global_batch: int     # rows per micro-step over all data-parallel ranks

    @property
    def what(self) -> str:
        return f"resharding checkpoint from {self.old_world} to {self.new_world} processes"

    def line(self) -> str:
        per = (f"train.batch_size {self.old_batch_size} -> {self.batch_size} per process"
               if self.batch_size != self.old_batch_size else f"train.batch_size {self.batch_size} per process")
        return (f"{self.what}: {per} keeps the global "
                f"batch of {self.global_batch} rows; dropout and other random streams restart from train.seed, "
                "the step and the data rank")


def _degree(parallel: dict[str, Any], key: str) -> int:
    return int(parallel.get(key) or 1)


def plan_reshard(path: Path, state: dict[str, Any], run_config: dict[str, Any], world_size: int,
                 data_shards: int) -> Reshard | None:
    """How a checkpoint written on another world size resumes on `world_size` processes, of which
    `data_shards` read different rows; None if the world size is the one that wrote it. A KilnError
    names what cannot carry over (another tp/ep/pp/cp degree, a cadence run, a global batch that does
    not split over the new data-parallel ranks)."""
    old_world = int(state["fingerprint"]["world_size"])
    if old_world == world_size:
        return None
    where = f"cannot resume from {path} on {world_size} processes (it was written by {old_world})"
    old_config = state.get("run_config") or {}
    if "batch_size" not in old_config.get("train", {}):
        raise KilnError(f"{where}: the checkpoint records no run config, so its global batch is unknown; "
                        f"resume it on {old_world} processes")
    old_par, new_par = old_config.get("parallel") or {}, run_config.get("parallel") or {}
    fixed = [f"parallel.{k} {_degree(old_par, k)} -> {_degree(new_par, k)}" for k in _FIXED_DEGREES
             if _degree(old_par, k) != _degree(new_par, k)]
    if fixed:
        raise KilnError(f"{where}: a checkpoint reshards over data parallelism only (dp, fsdp), but "
                        f"{'; '.join(fixed)}; keep the degrees of the run that wrote it and change only the "
                        "number of data-parallel processes")
    if old_par.get("cadence") is not None or new_par.get("cadence") is not None:
        raise KilnError(f"{where}: a [parallel.cadence] checkpoint holds one data cursor per process (they ran "
                        f"different numbers of batches); resume it on {old_world} processes")
    # the fixed degrees are equal, so the data-parallel part scales with the world size
    assert data_shards * old_world % world_size == 0, (data_shards, old_world, world_size)
    old_shards = data_shards * old_world // world_size
    old_batch = int(old_config["train"]["batch_size"])
    total = old_batch * old_shards
    if total % data_shards:
        raise KilnError(f"{where}: its global batch of {total} rows ({old_batch} per process x {old_shards} "
                        f"data-parallel processes) does not split evenly over {data_shards} data-parallel processes; "
                        f"resume on a number of processes whose data-parallel part divides {total}")
    return Reshard(old_world, world_size, old_batch, total // data_shards, total)


def check_resume(path: Path, state: dict[str, Any], fingerprint: dict[str, Any], run_config: dict[str, Any],
                 data_shards: int) -> tuple[Reshard | None, list[str]]:
    """Everything a resume from `path` (its trainer.json `state`) must keep, checked against this run:
    raises a KilnError naming each break; returns the reshard (None: same world size) and the notes on
    changed settings that are allowed."""
    reshard = plan_reshard(path, state, run_config, fingerprint["world_size"], data_shards)
    explained: frozenset[str] = frozenset()
    if reshard is not None:
        batch = int(run_config["train"]["batch_size"])
        if batch != reshard.batch_size:
            raise KilnError(f"cannot resume from {path}: {reshard.what} needs train.batch_size = "
                            f"{reshard.batch_size} per process to keep the global batch of {reshard.global_batch} "
                            f"rows, but this run has {batch}; set it with --set train.batch_size={reshard.batch_size} "
                            "(kiln train --resume sets it itself unless --set train.batch_size is given)")
        explained = frozenset({"train.batch_size", "parallel.dp"})
    refused, allowed = config_changes(state.get("run_config"), run_config, explained)
    check_fingerprint(path, state["fingerprint"], fingerprint, (refused, allowed), reshard=reshard is not None)
    return reshard, allowed


def keep_global_batch(cfg: Any, resume: Path, world_size: int, data_shards: int) -> tuple[Any, str | None]:
    """The run config with the train.batch_size a resume of RUN_DIR's newest checkpoint needs on
    `world_size` processes (for `kiln train --resume`, before any data is built): the checkpoint's
    global batch over this run's data-parallel processes. Any other value would be refused, and after a
    reshard the run's TOML still holds the batch size of the world size it started on. Returns a note
    when the world size is the checkpoint's and the TOML's batch size was overridden (a reshard says
    its own)."""
    from kiln.train.checkpoint import latest_checkpoint, read_trainer_state

    found = latest_checkpoint(resume, report=lambda _: None) if resume.is_dir() else None
    if found is None:
        return cfg, None  # the Trainer says what is missing
    state = read_trainer_state(found)
    reshard = plan_reshard(found, state, cfg.model_dump(mode="json"), world_size, data_shards)
    saved = ((state.get("run_config") or {}).get("train") or {}).get("batch_size")
    want = reshard.batch_size if reshard is not None else saved
    if want is None or cfg.train.batch_size == want:
        return cfg, None
    note = None if reshard is not None else (
        f"train.batch_size {cfg.train.batch_size} -> {want} per process, as {found.name} was trained "
        f"(its global batch of {want * data_shards} rows); --set train.batch_size=N to ask for another")
    train = cfg.train.model_copy(update={"batch_size": want})
    return cfg.model_copy(update={"train": train}), note


def reseed(seed: int, step: int, rank: int) -> None:
    """Every generator of this process seeded from (seed, step, rank): a resharded run cannot continue
    the saved per-process streams (other ranks draw other rows), but stays reproducible."""
    value = (seed * 1_000_003 + step) * 4099 + rank
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)
