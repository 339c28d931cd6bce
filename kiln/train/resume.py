"""What a resume must not change, and the message when it did.

A checkpoint records a fingerprint (every parameter's shape and dtype, the data source, the
precision, the world size) and the run config. Resuming with a different fingerprint, or a config
changed in a key that breaks exactness, is refused naming every change; other changed keys (lr,
steps, cadences) are allowed and returned for a note.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from kiln.errors import KilnError


def model_fingerprint(model: nn.Module) -> dict[str, Any]:
    return {"shapes": {n: list(p.shape) for n, p in model.state_dict().items()},
            "dtypes": sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})}


def _shape_changes(old: dict[str, list], new: dict[str, list]) -> list[str]:
    out = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a != b:
            out.append(f"{name} {tuple(a) if a is not None else 'absent'} -> {tuple(b) if b is not None else 'absent'}")
    return out


def check_fingerprint(path: Path, old: dict[str, Any], new: dict[str, Any],
                      settings: tuple[list[str], list[str]] = ([], [])) -> None:
    """Raise a KilnError listing each difference between a checkpoint's fingerprint and this run's, and
    the run-config `settings` changes (refused, allowed; from `config_changes`)."""
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
        if old["data"].get(key) != new["data"].get(key):
            problems.append(f"data source changed: {key} {old['data'].get(key)!r} -> {new['data'].get(key)!r}")
    if old["world_size"] != new["world_size"]:
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
        yield f"{path} {_show(old)} -> {_show(new)}", breaks_exactness(path)


def config_changes(old: dict[str, Any] | None, new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(refused, allowed): one line per key whose value differs between the checkpoint's run config and
    this one. Refused keys break exactness (model, data, precision, seed, batch size, ...);
    `check_fingerprint` raises on them. Allowed ones (lr, steps, eval and save cadence, ...) are noted."""
    changes = list(_diff(old, new)) if old else []
    return [line for line, bad in changes if bad], [line for line, bad in changes if not bad]
