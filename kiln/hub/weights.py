"""Writing weights: model.safetensors, sharded safetensors with an index, or pytorch_model.bin (sharded too).

Tensors keep their stored dtype (f16, bf16, f32, f64, ints): nothing passes through f32.
Writes go to a temp file, are fsynced, then renamed. Reading is kiln.hub.index's (every header read once); its
reading names are importable from here too, where callers have long found them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from kiln.hub.config import write_json_atomic
from kiln.hub.files import write_atomic

# the reading names, where callers have long imported them from (kiln.hub.index reads)
from kiln.hub.headers import (
    BIN_INDEX,
    SAFE_INDEX,
    SAFE_SINGLE,
    weight_files,  # noqa: F401
)
from kiln.hub.index import Span, SpanReader, load_weights, read_into, tensor_spans  # noqa: F401


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    write_atomic(path, lambda tmp: save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp),
                                             metadata=metadata), umask_mode=True)  # safetensors makes it 0600


def save_weights(
    model_dir: str | os.PathLike,
    state: dict[str, torch.Tensor],
    max_shard_bytes: int | None = None,
    metadata: dict[str, str] | None = None,
) -> list[Path]:
    """Write `state` as model.safetensors, or as shards plus an index past `max_shard_bytes`."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", **(metadata or {})}
    # Tensors that share storage (tied weights) must be written as separate copies.
    seen: set[tuple[int, int]] = set()
    clean: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset()) if v.numel() else (id(v), 0)
        clean[k] = v.clone() if key in seen else v
        seen.add(key)
    for stale in (SAFE_SINGLE, SAFE_INDEX):
        (model_dir / stale).unlink(missing_ok=True)

    groups = shard_plan([(k, v.numel() * v.element_size()) for k, v in clean.items()], max_shard_bytes)
    names = shard_names(len(groups))
    for name, group in zip(names, groups):
        _write_safetensors(model_dir / name, {k: clean[k] for k in group}, metadata)
    if len(groups) > 1:
        write_index(model_dir, sum(v.numel() * v.element_size() for v in clean.values()),
                    {k: name for name, group in zip(names, groups) for k in group})
    return [model_dir / name for name in names]


def shard_plan(sizes: list[tuple[str, int]], max_shard_bytes: int | None) -> list[list[str]]:
    """Tensor names per output file, in order: one file, or a new file whenever the next tensor would pass
    `max_shard_bytes` (the split `save_weights` writes; `kiln export` of sharded checkpoints streams it)."""
    total = sum(n for _, n in sizes)
    if max_shard_bytes is None or total <= max_shard_bytes:
        return [[k for k, _ in sizes]]
    groups: list[list[str]] = [[]]
    size = 0
    for k, nbytes in sizes:
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(k)
        size += nbytes
    return groups


def shard_names(count: int, suffix: str = ".safetensors") -> list[str]:
    """The file names transformers gives `count` weight files (suffix ".bin": PyTorch's, pytorch_model*.bin)."""
    stem = "pytorch_model" if suffix == ".bin" else "model"
    if count == 1:
        return [stem + suffix]
    return [f"{stem}-{i + 1:05d}-of-{count:05d}{suffix}" for i in range(count)]


def save_bin_weights(model_dir: str | os.PathLike, state: dict[str, torch.Tensor],
                     max_shard_bytes: int | None = None) -> list[Path]:
    """`state` as transformers' save_pretrained(safe_serialization=False) wrote it before safetensors (torch.save's
    zip format): pytorch_model.bin, or pytorch_model-0000i-of-0000n.bin shards past `max_shard_bytes` (split as
    `shard_plan` splits) and pytorch_model.bin.index.json; each file atomically. Kiln reads such releases
    (`load_weights`, `tensor_spans`); this writes them for the tests and benchmarks of that read."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    groups = shard_plan([(k, v.nbytes) for k, v in state.items()], max_shard_bytes)
    names = shard_names(len(groups), ".bin")
    for name, group in zip(names, groups):
        write_atomic(model_dir / name, lambda tmp, group=group: torch.save({k: state[k] for k in group}, tmp),
                     umask_mode=True)
    if len(groups) > 1:
        write_index(model_dir, sum(v.nbytes for v in state.values()),
                    {k: name for name, group in zip(names, groups) for k in group}, BIN_INDEX)
    return [model_dir / name for name in names]


def write_shard(model_dir: str | os.PathLike, name: str, tensors: dict[str, torch.Tensor],
                metadata: dict[str, str] | None = None) -> Path:
    """One weight file of a directory being written file by file (atomic, as every kiln write)."""
    path = Path(model_dir) / name
    _write_safetensors(path, tensors, {"format": "pt", **(metadata or {})})
    return path


def write_index(model_dir: str | os.PathLike, total: int, weight_map: dict[str, str], name: str = SAFE_INDEX) -> None:
    write_json_atomic(Path(model_dir) / name, {"metadata": {"total_size": total}, "weight_map": weight_map})
