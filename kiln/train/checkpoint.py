"""Checkpoints: one versioned directory per save, written whole or not at all.

    RUN_DIR/ckpt-000200/
      model/               an HF directory (save_pretrained: config.json, model.safetensors, tokenizer)
      optimizer.safetensors + optimizer.json   tensor state / param groups and scalars
      trainer.json         step, epoch, data cursor, best metric, counters, run config, fingerprint
      rng.json             every generator's state, per rank
      manifest.json        sha256 and size of every file above; written last

A save goes to `.ckpt-000200.tmp`, every file fsynced, then renamed; a directory without a valid
manifest is partial or corrupt and is skipped (by name) on resume, and so is one whose files match
their manifest but cannot be read (a safetensors header that does not cover its file, JSON that does
not parse, a DCP shard its metadata names that is gone): the resume falls back to the previous
checkpoint, naming the file. A resume also checks what it reads besides the weights before it picks a
checkpoint (`kiln.train.ckpt_check`), and falls back on any load that still fails (`kiln.train.fallback`).
Nothing here unpickles, except torch's own reader of a sharded checkpoint's
dcp/.metadata, which a load of that checkpoint runs on the same file anyway.
`--resume` takes a run directory or one of its checkpoints (`resume_target`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from kiln.errors import KilnError
from kiln.hub import load_weights
from kiln.hub.config import write_json_atomic
from kiln.hub.files import as_umask_allows, file_sha256, fsync_dir, fsync_file
from kiln.hub.jsonio import read_json
from kiln.models.common.lora import has_adapter, read_adapter_tensors
from kiln.models.pretrained import PreTrainedModel, copy_state_dict
from kiln.train.ckpt_check import loading, missing_structure

CKPT_RE = re.compile(r"^ckpt-(\d{6,})$")
FORMAT = 1


def ckpt_name(step: int) -> str:
    return f"ckpt-{step:06d}"


def fault_point(kind: str, step: int) -> None:
    """Testing hook: KILN_FAULT="kind:step" SIGKILLs this process here (crash-safety tests); KILN_FAULT_SIGNAL
    names another signal to send (SIGTERM: the graceful stop of kiln.train.preempt, mid-checkpoint)."""
    spec = os.environ.get("KILN_FAULT", "")
    if spec and spec == f"{kind}:{step}" and int(os.environ.get("RANK", "0")) == int(os.environ.get("KILN_FAULT_RANK", "0")):
        os.kill(os.getpid(), getattr(signal, os.environ.get("KILN_FAULT_SIGNAL", "SIGKILL")))


# ---- files ----------------------------------------------------------------------------------
def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")


# ---- RNG and optimizer state as safetensors / JSON -------------------------------------------
def rng_state() -> dict[str, Any]:
    """Every generator this process draws from: Python, NumPy, torch CPU and accelerators."""
    py = random.getstate()
    npst = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state())  # the legacy tuple (its default)
    state: dict[str, Any] = {"python": [py[0], list(py[1]), py[2]],
                             "numpy": [npst[0], npst[1].tolist(), int(npst[2]), int(npst[3]), float(npst[4])],
                             "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _optimizer_files(sd: dict) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, scalars = {}, {}
    for pid, pstate in sd["state"].items():
        for k, v in pstate.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{pid}.{k}"] = v.detach().cpu().contiguous()
            else:
                scalars[f"{pid}.{k}"] = v
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def _optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state: dict[int, dict[str, Any]] = {}
    for key, v in list(tensors.items()) + list(meta["scalars"].items()):
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = v
    groups = [{k: tuple(v) if k == "betas" else v for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


# ---- save -----------------------------------------------------------------------------------
def save_checkpoint(run_dir: str | os.PathLike, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], rng_states: list[dict[str, Any]]) -> Path:
    """Write RUN_DIR/ckpt-<step> atomically (temp dir, fsync, rename) and return its path."""
    run_dir = Path(run_dir)
    tmp = run_dir / f".{ckpt_name(step)}.tmp"
    with _writing(run_dir, tmp, step):
        return _save(run_dir, tmp, step, model, optimizer, trainer_state, rng_states)


@contextlib.contextmanager
def _writing(run_dir: Path, tmp: Path, step: int) -> Iterator[None]:
    """A write that fails (a full disk, a file-size limit, a read-only mount) takes its partial checkpoint
    away and says which checkpoint it was, why, and which complete one a resume starts from."""
    try:
        yield
    except (OSError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)  # half a checkpoint is none; its space goes back to the disk
        why = f"{e.strerror} ({e.filename})" if isinstance(e, OSError) and e.strerror else str(e)
        if "os error 28" in why or getattr(e, "errno", None) == errno.ENOSPC:
            why += " (the disk is full: free some space)"
        elif "os error 27" in why or getattr(e, "errno", None) == errno.EFBIG:
            why += " (a file-size limit: ulimit -f, or the filesystem's largest file)"
        done = list_checkpoints(run_dir)
        then = (f"resume with --resume from {done[-1][1].name}, the newest complete checkpoint" if done else
                "no checkpoint was complete yet: start the run again")
        raise KilnError(f"{run_dir}: writing checkpoint {ckpt_name(step)} failed: {why}; its partial files are "
                        f"removed, the rest of the run directory is as it was; {then}") from None


def _save(run_dir: Path, tmp: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
          trainer_state: dict[str, Any], rng_states: list[dict[str, Any]]) -> Path:
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_pretrained = getattr(model, "save_pretrained", None)
    if save_pretrained is not None:
        save_pretrained(tmp / "model")
    else:  # a plain nn.Module: its own state dict names
        (tmp / "model").mkdir()
        save_file({k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
                  str(tmp / "model" / "model.safetensors"))
        as_umask_allows(tmp / "model" / "model.safetensors")
    tensors, meta = _optimizer_files(optimizer.state_dict())
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    as_umask_allows(tmp / "optimizer.safetensors")  # safetensors writes 0600
    _write_json(tmp / "optimizer.json", meta)
    fault_point("ckpt", step)  # crash-safety tests kill here: weights on disk, no manifest yet
    return seal_checkpoint(run_dir, tmp, step, trainer_state, rng_states)


def seal_checkpoint(run_dir: Path, tmp: Path, step: int, trainer_state: dict[str, Any],
                    rng_states: list[dict[str, Any]]) -> Path:
    """Finish a checkpoint whose weights are in `tmp`: trainer and RNG state, fsync, manifest last, rename."""
    with _writing(run_dir, tmp, step):
        return _seal(run_dir, tmp, step, trainer_state, rng_states)


def _seal(run_dir: Path, tmp: Path, step: int, trainer_state: dict[str, Any], rng_states: list[dict[str, Any]]) -> Path:
    final = run_dir / ckpt_name(step)
    _write_json(tmp / "trainer.json", {"format": FORMAT, **trainer_state})
    _write_json(tmp / "rng.json", rng_states)
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        fsync_file(path)
        files[str(path.relative_to(tmp))] = {"sha256": file_sha256(path), "bytes": path.stat().st_size}
    _write_json(tmp / "manifest.json", {"format": FORMAT, "step": step, "files": files})
    fsync_file(tmp / "manifest.json")
    for d in [*(p for p in tmp.rglob("*") if p.is_dir()), tmp]:
        fsync_dir(d)
    if final.exists():  # a save at a step already saved (e.g. resumed, then saved again) replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(run_dir)
    return final


# ---- find and verify ------------------------------------------------------------------------
def verify_checkpoint(path: str | os.PathLike, resume: bool = False) -> str | None:
    """None if the checkpoint is complete and every checksum matches, else what is wrong. With `resume`, also
    everything a resume reads besides the weights (`missing_structure`): an export needs only the model."""
    path = Path(path)
    manifest = path / "manifest.json"
    if not manifest.is_file():
        return "no manifest.json (the write never finished)"
    try:
        files = read_json(manifest, want=dict).get("files")
    except KilnError as e:
        return f"manifest.json is unreadable ({e})"
    if not isinstance(files, dict):
        return "manifest.json is unreadable (no files object)"
    for rel, info in files.items():
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != info["bytes"] or file_sha256(f) != info["sha256"]:
            return f"{rel} does not match its checksum"
    for rel in files:  # checksums can match a file written wrong (or a manifest rewritten to match it)
        problem = _unreadable(path / rel)
        if problem is not None:
            return f"{rel} cannot be read ({problem})"
    return _dcp_missing(path) or (missing_structure(path) if resume else None)


def _dcp_missing(path: Path) -> str | None:
    """For a sharded checkpoint: a shard file its DCP metadata names that is not there (a manifest edited to
    match the loss would pass the checksums), or None."""
    if not (path / "dcp" / ".metadata").is_file():
        return None
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(path / "dcp")).read_metadata()
    except Exception as e:  # noqa: BLE001 - torch's reader: a torn or foreign .metadata
        return f"dcp/.metadata cannot be read ({type(e).__name__}: {e})"
    named = sorted({info.relative_path for info in (meta.storage_data or {}).values()})
    missing = [rel for rel in named if not (path / "dcp" / rel).is_file()]
    return f"dcp/{missing[0]} is missing (dcp/.metadata names it)" if missing else None


def _unreadable(f: Path) -> str | None:
    """Why a checkpoint file cannot be read, or None: a safetensors header must parse and cover the file
    exactly; a JSON file must parse. Headers only: no tensor is read."""
    try:
        if f.suffix == ".safetensors":
            with safe_open(str(f), framework="pt") as st:
                st.keys()
        elif f.suffix == ".json":
            json.loads(f.read_text(encoding="utf-8"))
    except PermissionError:
        return "permission denied"
    except Exception as e:  # noqa: BLE001 - safetensors' own error type, JSON, encoding: any of them means "cannot load"
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


def resume_target(path: str | os.PathLike) -> Path:
    """The run directory for `--resume PATH`: PATH itself, or the run holding PATH when PATH is one of its
    checkpoints (`RUN/ckpt-000004`) and the newest complete one there. A resume continues the run, so an
    older checkpoint with newer ones beside it is refused, naming them, rather than overwritten."""
    path = Path(path)
    if not (CKPT_RE.match(path.name) and path.is_dir()):
        return path
    problem = verify_checkpoint(path, resume=True)
    if problem is not None:
        raise KilnError(f"{path}: not a usable checkpoint to resume from: {problem}")
    named = CKPT_RE.match(path.name)
    assert named is not None  # matched above
    newer = [p.name for step, p in list_checkpoints(path.parent)
             if step > int(named.group(1)) and verify_checkpoint(p, resume=True) is None]
    if newer:
        raise KilnError(f"{path}: the run {path.parent} holds newer checkpoints ({', '.join(newer)}); a resume "
                        f"continues from the newest (--resume {path.parent}); to branch off {path.name}, copy the "
                        "run without the newer ones and resume that")
    return path.parent


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    out = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := CKPT_RE.match(p.name)) and p.is_dir()]
    return sorted(out)


def list_paths(run_dir: str | os.PathLike) -> list[Path]:
    return [p for _, p in list_checkpoints(run_dir)]


def latest_checkpoint(run_dir: str | os.PathLike, report: Callable[[str], None] = print) -> Path | None:
    """The newest complete checkpoint; partial and corrupt ones are reported by name and skipped."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise KilnError(f"{run_dir}: no such run directory to resume (a run that stopped before it began writes none: start it without --resume)")
    for tmp in sorted(run_dir.glob(".ckpt-*.tmp")):
        report(f"{tmp.name}: partial checkpoint write (the run stopped while saving); ignored")
    for _, path in reversed(list_checkpoints(run_dir)):
        problem = verify_checkpoint(path, resume=True)
        if problem is None:
            return path
        report(f"{path.name}: {problem}; using the previous checkpoint")
    return None


def read_trainer_state(path: str | os.PathLike) -> dict[str, Any]:
    return read_json(Path(path) / "trainer.json", want=dict)


def read_rng_states(path: str | os.PathLike) -> list[dict[str, Any]]:
    with loading(Path(path), "rng.json"):
        return read_json(Path(path) / "rng.json", want=list)


def load_optimizer_state(path: str | os.PathLike) -> dict:
    """optimizer.json and optimizer.safetensors as torch's optimizer state dict; a CheckpointLoadError names
    the file that fails."""
    path = Path(path)
    with loading(path, "optimizer.json"):
        meta = read_json(path / "optimizer.json", want=dict)
    with loading(path, "optimizer.safetensors"):
        tensors = load_file(str(path / "optimizer.safetensors"))
    with loading(path, "optimizer.json"):
        return _optimizer_state(tensors, meta)


def load_model_weights(path: str | os.PathLike, model: Any) -> None:
    """Copy a checkpoint's weights into a live model in place (optimizer refs stay valid).

    A kiln model maps and checks them as every HF load does (`copy_hf_state_dict`); a plain
    nn.Module was saved under its own names.
    """
    model_dir = Path(path) / "model"
    with loading(Path(path), "model/"):  # the message names the tensor (and the file when it is unreadable)
        tensors = load_weights(model_dir)
        if has_adapter(model_dir):  # a LoRA run: the adapter sits beside the frozen base
            tensors.update(read_adapter_tensors(model_dir))
        if isinstance(model, PreTrainedModel):
            model.copy_hf_state_dict(tensors, source=str(model_dir))
        else:
            copy_state_dict(model, tensors, source=str(model_dir))


def load_checkpoint_model(path: str | os.PathLike, dtype: torch.dtype | None = None) -> Any:
    """The kiln model stored in a checkpoint directory (its `model/` is a plain HF directory)."""
    from kiln.models.auto import load_pretrained

    path = Path(path)
    problem = verify_checkpoint(path)
    if problem is not None:
        raise KilnError(f"{path}: not a usable checkpoint: {problem}")
    return load_pretrained(path / "model", dtype=dtype)


def prune_checkpoints(run_dir: str | os.PathLike, keep_last: int, keep: set[str]) -> list[str]:
    """Delete all but the newest `keep_last` checkpoints and those named in `keep` (the best)."""
    ckpts = list_checkpoints(run_dir)
    doomed = [p for _, p in ckpts[:-keep_last] if p.name not in keep] if keep_last else []
    for p in doomed:
        shutil.rmtree(p)
    return [p.name for p in doomed]


def write_best(run_dir: str | os.PathLike, name: str, metric: str | None, value: float) -> None:
    write_json_atomic(Path(run_dir) / "best.json", {"checkpoint": name, "metric": metric, "value": value})
