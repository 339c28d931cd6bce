"""Weights on disk: model.safetensors, sharded safetensors with an index, or pytorch_model.bin (sharded too).

Tensors keep their stored dtype (f16, bf16, f32, f64, ints): nothing passes through f32.
Writes go to a temp file, are fsynced, then renamed. `tensor_spans` says where each tensor's bytes lie in a
file without reading them, for safetensors and for torch.save's zip format alike, so a sharded read
(kiln.parallel.sharded_load) takes only its slices of either; `SpanReader` reads them as `safe_open` does.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kiln.errors import WeightsError
from kiln.hub.config import write_json_atomic
from kiln.hub.files import as_umask_allows
from kiln.hub.headers import BIN_INDEX, SAFE_INDEX, SAFE_SINGLE, TORCH_DTYPE_NAMES, weight_files
from kiln.hub.jsonio import read_json
from kiln.hub.pickled import bin_layout, load_bin

_TORCH_DTYPES = {name: getattr(torch, t) for t, name in TORCH_DTYPE_NAMES.items()}  # safetensors spelling -> dtype
_DTYPE_NAMES = {t: name for name, t in _TORCH_DTYPES.items()}


@dataclass(frozen=True)
class Span:
    """Where one tensor's bytes lie in its safetensors file."""
    offset: int                # from the start of the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def tensor_spans(path: str | os.PathLike) -> dict[str, Span]:
    """Each tensor of a weights file (safetensors, or a PyTorch .bin) and where its bytes are, from the header
    alone (no data read)."""
    if Path(path).suffix == ".bin":
        return _bin_spans(Path(path))
    try:
        with safe_open(str(path), framework="pt") as f:  # checks the header and the offsets against the file
            keys = list(f.keys())
        with open(path, "rb", buffering=0) as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except SafetensorError as e:
        raise WeightsError(f"{path}: not a readable safetensors file ({e}); is it truncated or another format?") from None
    except OSError as e:
        raise WeightsError(f"{path}: cannot read ({e})") from None
    spans = {}
    for k in keys:
        info = header[k]
        if info["dtype"] not in _TORCH_DTYPES:
            raise WeightsError(f"{path}: tensor {k!r} has dtype {info['dtype']}, which kiln does not read")
        begin, end = info["data_offsets"]
        spans[k] = Span(8 + length + begin, end - begin, _TORCH_DTYPES[info["dtype"]], tuple(info["shape"]))
    return spans


def read_into(f, offset: int, out: torch.Tensor) -> None:
    """Fill the contiguous CPU tensor `out` with the `out.nbytes` bytes at `offset` of the open file `f` (read,
    not mapped: no page of the file stays counted in this process's memory)."""
    if not out.is_contiguous() or out.device.type != "cpu":
        raise ValueError("read_into needs a contiguous CPU tensor")
    nbytes = out.nbytes
    if not nbytes:
        return
    view, done = memoryview(out.reshape(-1).view(torch.uint8).numpy()), 0
    f.seek(offset)
    while done < nbytes:
        n = f.readinto(view[done:])
        if not n:
            raise WeightsError(f"{f.name}: ends inside a tensor; is it truncated?")
        done += n


def _read_into_alignment(f, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """The tensor stored at `offset`, read into ordinary memory whose address has the phase mod 64 the file
    mapping would give it (offset mod 64: mappings start on a page).

    MKL picks GEMV/small-GEMM kernels by operand alignment, and the kernels round differently:
    transformers reads mapped weights, so a plain (64-byte aligned) copy made a single-row Linear
    (poolers, classifiers) differ from transformers in the last bit. Read, not mapped: mapped pages of
    the file would count in the process's memory beside the copy until the file closes, and kernels
    reading weights from mapped pages measured ~40% slower in training (benchmarks/bench_encoders.py).
    """
    buf = torch.empty(nbytes + 64, dtype=torch.uint8)
    start = (offset - buf.data_ptr()) % 64
    out = buf[start:start + nbytes]
    read_into(f, offset, out)
    return out.view(dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        open(path, "rb").close()  # safetensors reports a file it may not read as "No such file or directory"
    except PermissionError:
        raise WeightsError(f"{path}: permission denied: this user may not read the file; ask its owner to make "
                           "it readable (chmod a+r) or copy it somewhere you can read") from None
    except OSError as e:
        raise WeightsError(f"{path}: cannot read ({e})") from None
    try:
        with safe_open(str(path), framework="pt") as f:  # checks the header and the offsets against the file
            keys = list(f.keys())
        with open(path, "rb", buffering=0) as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
            base = 8 + length
            out = {}
            for k in keys:
                info = header[k]
                begin, end = info["data_offsets"]
                out[k] = _read_into_alignment(f, base + begin, end - begin, _TORCH_DTYPES[info["dtype"]],
                                              info["shape"])
            return out
    except SafetensorError as e:
        raise WeightsError(f"{path}: not a readable safetensors file ({e}); is it truncated or another format?") from None
    except KeyError as e:
        raise WeightsError(f"{path}: dtype {e} is not one kiln reads") from None
    except OSError as e:
        raise WeightsError(f"{path}: cannot read ({e})") from None


def _read_bin(path: Path) -> dict[str, torch.Tensor]:
    return load_bin(path, "cpu")


def _bin_spans(path: Path) -> dict[str, Span]:
    """Where each tensor of a PyTorch zip checkpoint lies (kiln.hub.pickled.bin_layout: no data read)."""
    return {k: Span(offset, dtype.itemsize * math.prod(shape), dtype, shape)
            for k, (offset, dtype, shape) in bin_layout(path).items()}


class SpanReader:
    """`safe_open`'s reading calls (`keys`, `get_tensor`, `get_slice(key)[index]`) over the spans of one open
    file of any format: a slice reads the run of rows it needs, then keeps its columns."""

    def __init__(self, f: Any, spans: dict[str, Span]):
        self.f, self.spans = f, spans

    def keys(self) -> list[str]:
        return list(self.spans)

    def get_tensor(self, key: str) -> torch.Tensor:
        s = self.spans[key]
        return _read_into_alignment(self.f, s.offset, s.nbytes, s.dtype, list(s.shape))

    def get_slice(self, key: str) -> "_SpanSlice":
        return _SpanSlice(self.f, self.spans[key])


class _SpanSlice:
    def __init__(self, f: Any, span: Span):
        self.f, self.span = f, span

    def get_shape(self) -> list[int]:
        return list(self.span.shape)

    def get_dtype(self) -> str:
        """The dtype in safetensors' spelling ("BF16", "F8_E4M3"), as safe_open's slice names it."""
        return _DTYPE_NAMES[self.span.dtype]

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        """The box `index` (one step-1 slice per leading dimension) of the tensor: a run of whole rows is one read;
        a run of columns (dim 1, the dimensions after it whole) one read per row; any other box its rows, then cut."""
        s = self.span
        if not s.shape:
            return _read_into_alignment(self.f, s.offset, s.nbytes, s.dtype, [])
        box = [index[d].indices(n) if d < len(index) else (0, n, 1) for d, n in enumerate(s.shape)]
        if any(step != 1 for _, _, step in box):
            raise ValueError("a span slice takes runs of rows and columns")
        (first, stop, _), rest = box[0], box[1:]
        row = s.nbytes // s.shape[0] if s.shape[0] else 0
        whole = [(b0, b1) == (0, n) for (b0, b1, _), n in zip(rest, s.shape[1:])]  # per dimension after the rows
        if rest and not whole[0] and all(whole[1:]):
            c0, c1, _ = rest[0]
            out = torch.empty((max(stop - first, 0), max(c1 - c0, 0), *s.shape[2:]), dtype=s.dtype)
            inner = row // s.shape[1] if s.shape[1] else 0
            for i in range(out.shape[0]):  # each row's columns c0..c1 are one run of bytes
                read_into(self.f, s.offset + (first + i) * row + c0 * inner, out[i])
            return out
        rows = torch.empty((max(stop - first, 0), *s.shape[1:]), dtype=s.dtype)
        read_into(self.f, s.offset + first * row, rows)
        return rows if all(whole) else rows[(slice(None), *(slice(b0, b1) for b0, b1, _ in rest))].contiguous()


def load_weights(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a model directory, by their names on disk, in their stored dtypes."""
    state: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        part = _read_safetensors(path) if path.suffix == ".safetensors" else _read_bin(path)
        dup = state.keys() & part.keys()
        if dup:
            raise WeightsError(f"{path}: tensor(s) already present in another shard: {sorted(dup)[:5]}")
        state.update(part)
    return state


def _atomic(path: Path, write: Any) -> None:
    """`write(tmp)` writes the file under a temporary name; fsynced, given the umask's mode, then renamed to path."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    as_umask_allows(tmp)  # safetensors makes it 0600
    os.replace(tmp, path)


def _write_safetensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    _atomic(path, lambda tmp: save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(tmp),
                                        metadata=metadata))


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
        _atomic(model_dir / name, lambda tmp, group=group: torch.save({k: state[k] for k in group}, tmp))
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
