"""What a checkpoint must hold to be resumed from, checked before anything is loaded, and the error a load
that still fails raises.

`missing_structure` reads JSON and safetensors headers only (no tensor data): the files a resume opens
(trainer.json with its keys, rng.json with one state per rank, the optimizer's two files or the DCP
folder, the model's weights), and an optimizer whose tensors fit its own param groups. A checkpoint
that passes can still fail against the live model (a tensor of another shape or kind): the loaders raise
`CheckpointLoadError` naming the file, and the resume falls back to the previous checkpoint
(`kiln.train.fallback`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from safetensors import safe_open

from kiln.errors import KilnError

# trainer.json keys a resume reads, and their JSON kinds
_TRAINER_KEYS: dict[str, tuple[type, ...]] = {
    "step": (int,), "skipped": (int,), "evals_since_best": (int,), "data": (dict,), "fingerprint": (dict,)}
_FINGERPRINT_KEYS: dict[str, tuple[type, ...]] = {
    "model": (dict,), "data": (dict,), "precision": (str,), "world_size": (int,)}
# torch optimizers' per-element state: as many elements as the parameter, floating point
PER_ELEMENT = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "acc_delta", "sum"}


class CheckpointLoadError(KilnError):
    """A checkpoint file that passed its checks but failed to load: `file` (relative to the checkpoint) and
    `why`. A resume falls back to the previous checkpoint on it."""

    def __init__(self, path: Path, file: str, why: str):
        self.path, self.file, self.why = Path(path), file, why
        super().__init__(f"{Path(path) / file}: cannot be loaded ({why})")


def _first_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else ""
    return text or type(e).__name__


@contextlib.contextmanager
def loading(path: Path, file: str) -> Iterator[None]:
    """Any failure inside (a KilnError, torch's or safetensors' own) raised as a CheckpointLoadError naming
    `file` of the checkpoint at `path`."""
    try:
        yield
    except CheckpointLoadError:
        raise
    except (KilnError, OSError, RuntimeError, KeyError, TypeError, IndexError, AssertionError) as e:
        raise CheckpointLoadError(path, file, _first_line(e)) from None
    except Exception as e:  # noqa: BLE001 - safetensors' SafetensorError and the like: any of them means "cannot load"
        raise CheckpointLoadError(path, file, _first_line(e)) from None


def _kinds(data: dict, keys: dict[str, tuple[type, ...]], where: str) -> str | None:
    for key, kinds in keys.items():
        value = data.get(key)
        if key not in data:
            return f"{where} has no {key!r}"
        if not isinstance(value, kinds) or isinstance(value, bool):
            return f"{where}: {key!r} is {type(value).__name__}, not {kinds[0].__name__}"
    return None


def _json(path: Path) -> Any:
    return json.loads(path.read_text(encoding="utf-8"))


def _trainer(path: Path) -> tuple[str | None, dict]:
    state = _json(path / "trainer.json")
    if not isinstance(state, dict):
        return "trainer.json is not an object", {}
    problem = _kinds(state, _TRAINER_KEYS, "trainer.json")
    if problem is None:
        problem = _kinds(state["fingerprint"], _FINGERPRINT_KEYS, "trainer.json's fingerprint")
    if problem is None and not isinstance(state["fingerprint"]["model"].get("shapes"), dict):
        problem = "trainer.json's fingerprint has no model shapes"
    if problem is None and "best" not in state:
        problem = "trainer.json has no 'best'"
    return problem, state


def _rng(path: Path, world_size: int) -> str | None:
    states = _json(path / "rng.json")
    if not isinstance(states, list) or len(states) != world_size:
        have = f"{len(states)} states" if isinstance(states, list) else type(states).__name__
        return f"rng.json holds {have}, not one per process of the {world_size} that wrote it"
    for rank, s in enumerate(states):
        if not isinstance(s, dict) or not {"python", "numpy", "torch"} <= set(s):
            return f"rng.json: rank {rank}'s state lacks a generator (python, numpy, torch)"
    return None


def _optimizer(path: Path) -> str | None:
    meta = _json(path / "optimizer.json")
    if not (isinstance(meta, dict) and isinstance(meta.get("param_groups"), list)
            and isinstance(meta.get("scalars"), dict)):
        return "optimizer.json has no param_groups list and scalars object"
    try:
        ids = {int(i) for g in meta["param_groups"] for i in g["params"]}
    except (TypeError, KeyError, ValueError):
        return "optimizer.json: a param group without a list of parameter numbers"
    shapes: dict[int, tuple[str, tuple[int, ...]]] = {}
    with safe_open(str(path / "optimizer.safetensors"), framework="pt") as st:
        names = list(st.keys())
        for key in [*names, *meta["scalars"]]:
            pid = key.partition(".")[0]
            if not pid.isdigit() or int(pid) not in ids:
                return f"optimizer state {key!r} names no parameter of optimizer.json's param groups"
        for key in names:
            pid, _, name = key.partition(".")
            if name not in PER_ELEMENT:
                continue
            view = st.get_slice(key)
            dtype, shape = view.get_dtype(), tuple(view.get_shape())
            if not dtype.startswith(("F", "BF")):
                return f"optimizer.safetensors: {key!r} is {dtype}, not floating point"
            first = shapes.setdefault(int(pid), (key, shape))
            if first[1] != shape:
                return f"optimizer.safetensors: {key!r} has shape {shape} but {first[0]!r} {first[1]}"
    return None


def _has_weights(model_dir: Path) -> bool:
    return model_dir.is_dir() and any(model_dir.glob("*.safetensors"))


def missing_structure(path: Path) -> str | None:
    """Why a checkpoint whose files match its manifest still cannot be resumed from, or None."""
    sharded = (path / "dcp" / ".metadata").is_file()
    need = ["trainer.json", "rng.json"] + ([] if sharded else ["optimizer.json", "optimizer.safetensors"])
    for rel in need:
        if not (path / rel).is_file():
            return f"{rel} is missing"
    if not sharded and not _has_weights(path / "model"):
        return "model/ holds no .safetensors weights"
    try:
        problem, state = _trainer(path)
        if problem is None:
            problem = _rng(path, state["fingerprint"]["world_size"])
        if problem is None and not sharded:
            problem = _optimizer(path)
    except Exception as e:  # noqa: BLE001 - unreadable JSON or header: verify_checkpoint's reader names most of these first
        return _first_line(e)
    return problem
