"""What a resume must not change, and the message when it did.

A checkpoint records a fingerprint: every parameter's shape and dtype, the data source, the
precision and the world size. Resuming with a different one is refused, naming what changed.
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


def check_fingerprint(path: Path, old: dict[str, Any], new: dict[str, Any]) -> None:
    """Raise a KilnError listing each difference between a checkpoint's fingerprint and this run's."""
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
    if problems:
        raise KilnError(f"cannot resume from {path}: " + "; ".join(problems))
