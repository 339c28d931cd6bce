"""A checkpoint's index: the model directory resolved once, every weight file's header read once.

Every load reads the checkpoint through one `CheckpointIndex`: the whole load (kiln.models.auto.load_pretrained),
the sharded load (kiln.parallel.sharded_load: the model built on the meta device from the headers, then each rank's
pieces read from the files) and `kiln plan`. The index resolves the path (a Hub repo id through the HF cache) once,
lists the weight files once (the shard index's JSON), and reads each file's header the first time something asks
for a tensor of it, and never again:

- safetensors: the JSON header (kiln.hub.headers.parse_safetensors, checked as the library checks it on open);
- PyTorch `.bin`: the pickle read onto the meta device (kiln.hub.pickled.bin_layout: names, dtypes, shapes and
  byte offsets, no tensor data). A whole load of a `.bin` file unpickles it with its data instead (`load_all`):
  that is its one read of the pickle.

Tensors are read from those spans (`read`, `reader`): read, not mapped, so no page of a file stays counted in the
process's memory, each into memory with the address phase a mapping would give it (kiln.hub.weights).
What a run carries by reference (a tensor it does not hold, written back from its source file on export) is a
`CarriedRef`, made here from the index (`ref`).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from kiln.errors import WeightsError
from kiln.hub.headers import TORCH_DTYPE_NAMES, TensorHeader, parse_safetensors, weight_files
from kiln.hub.pickled import bin_layout, load_bin
from kiln.hub.resolve import resolve_model_dir

_DTYPE = {name: getattr(torch, t) for t, name in TORCH_DTYPE_NAMES.items()}  # safetensors spelling -> torch dtype
_DTYPE_NAMES = {t: name for name, t in _DTYPE.items()}


@dataclass(frozen=True)
class Span:
    """Where one tensor's bytes lie in its safetensors file."""
    offset: int                # from the start of the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def tensor_spans(path: str | os.PathLike) -> dict[str, Span]:
    """Each tensor of one weights file (safetensors, or a PyTorch .bin) and where its bytes are, from its header
    alone (one read of it; no data), in name order as `safe_open` lists them. A load reads each file's header
    through its `CheckpointIndex`, once."""
    path = Path(path)
    if path.suffix == ".bin":
        return {k: Span(offset, dtype.itemsize * math.prod(shape), dtype, shape)
                for k, (offset, dtype, shape) in bin_layout(path).items()}
    tensors = parse_safetensors(path).tensors
    return {k: Span(tensors[k][2], tensors[k][3] - tensors[k][2], _DTYPE[tensors[k][0]], tensors[k][1])
            for k in sorted(tensors)}


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


def _read_safetensors(f: BinaryIO, spans: dict[str, Span]) -> dict[str, torch.Tensor]:
    """Every tensor of one open safetensors file, from its spans, each read into place (not mapped)."""
    return {k: _read_into_alignment(f, s.offset, s.nbytes, s.dtype, list(s.shape)) for k, s in spans.items()}


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

    def get_slice(self, key: str) -> _SpanSlice:
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


@dataclasses.dataclass(frozen=True)
class CarriedRef:
    """Where one tensor a run does not hold lies: `key` in `file` of directory `source`, as the run read it (its
    dtype and shape, the file's size and mtime, so a changed source is named before an export writes from it)."""

    source: str
    file: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    size: int
    mtime_ns: int
    # an FP8 (packed FP4) weight a whole load holds dequantized: (the name its scale is carried under, in the same
    # holder; the dtype the whole load dequantizes it to; the scale blocks, or None: one scale), so an export that
    # writes no FP8 writes it as that load holds it
    dequantized: tuple[str, str, tuple[int, int] | None] | None = None

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> CarriedRef:
        """A reference as `dataclasses.asdict` wrote it to JSON (lists back to tuples)."""
        deq = row.get("dequantized")
        if deq is not None:
            scale, dtype, block = deq
            deq = (scale, dtype, None if block is None else tuple(block))
        return cls(**{**row, "shape": tuple(row["shape"]), "dequantized": deq})

    def meta(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=getattr(torch, self.dtype), device="meta")


class CheckpointIndex:
    """One model directory's weights: its files, and where each tensor's bytes lie (headers read once, lazily)."""

    def __init__(self, root: Path):
        """`root`: a resolved local directory (`CheckpointIndex.open` resolves a name or repo id)."""
        self.root = Path(root)
        self._files: list[Path] | None = None
        self._spans: dict[Path, dict[str, Span]] = {}
        self._stamp: dict[Path, tuple[int, int]] = {}  # (size, mtime_ns) of each file when its header was read
        self._all: dict[str, Span] | None = None
        self._file_of: dict[str, Path] = {}

    @classmethod
    def open(cls, path: str | os.PathLike) -> CheckpointIndex:
        """The index of a model directory or Hub repo id (resolved here, once)."""
        return cls(resolve_model_dir(path))

    @property
    def files(self) -> list[Path]:
        """The weight files, in the order they are read (the shard index's JSON read the first time): after the
        config, so a directory without one is named for that first."""
        if self._files is None:
            self._files = weight_files(self.root)
        return self._files

    # ---- headers --------------------------------------------------------------------------------------
    def file_spans(self, f: Path) -> dict[str, Span]:
        """Where each tensor of weight file `f` lies (its header read the first time, then kept)."""
        if f not in self._spans:
            stat = os.stat(f)
            self._spans[f], self._stamp[f] = tensor_spans(f), (stat.st_size, stat.st_mtime_ns)
        return self._spans[f]

    def refresh(self) -> None:
        """Before reading data: a file rewritten since its header was read is read afresh (its header again, once),
        so its tensors are checked against what it now holds, not what it held (one stat per file)."""
        for f in list(self._stamp):
            stat = os.stat(f)
            if self._stamp[f] != (stat.st_size, stat.st_mtime_ns):
                del self._spans[f], self._stamp[f]
                self._all = None
                self._file_of.clear()

    @property
    def spans(self) -> dict[str, Span]:
        """Every tensor of the checkpoint -> where its bytes lie, in file order (a name in two files is an error)."""
        if self._all is None:
            out: dict[str, Span] = {}
            for f in self.files:
                part = self.file_spans(f)
                dup = out.keys() & part.keys()
                if dup:
                    raise WeightsError(f"{f}: tensor(s) already present in another shard: {sorted(dup)[:5]}")
                out.update(part)
                self._file_of.update(dict.fromkeys(part, f))
            self._all = out
        return self._all

    def file_of(self, key: str) -> Path:
        self.spans  # noqa: B018 (fills _file_of)
        return self._file_of[key]

    def meta(self) -> dict[str, torch.Tensor]:
        """The checkpoint's tensors as meta tensors of their stored shapes and dtypes, in file order."""
        return {k: torch.empty(s.shape, dtype=s.dtype, device="meta") for k, s in self.spans.items()}

    def headers(self) -> tuple[dict[str, TensorHeader], dict[str, int]]:
        """(every tensor as kiln.hub.headers names it, each file's size in bytes): `kiln plan`'s view."""
        tensors = {k: TensorHeader(k, s.shape, _DTYPE_NAMES[s.dtype], self.file_of(k).name) for k, s in self.spans.items()}
        return tensors, {f.name: f.stat().st_size for f in self.files}

    def ref(self, key: str, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None,
            dequantized: tuple[str, str, tuple[int, int] | None] | None = None) -> CarriedRef:
        """A reference to stored tensor `key` (its own dtype and shape unless given) and the file it lies in."""
        span, f = self.spans[key], self.file_of(key)
        stat = os.stat(f)
        return CarriedRef(str(self.root.resolve()), f.name, key, str(dtype or span.dtype).removeprefix("torch."),
                          tuple(shape if shape is not None else span.shape), stat.st_size, stat.st_mtime_ns, dequantized)

    # ---- data ------------------------------------------------------------------------------------------
    @contextmanager
    def opened(self) -> Iterator[Any]:
        """`file_of(key)` -> that key's file, opened for reading (each file once, all closed on exit)."""
        with ExitStack() as stack:
            handles: dict[Path, BinaryIO] = {}

            def handle(key: str) -> BinaryIO:
                f = self.file_of(key)
                if f not in handles:
                    handles[f] = stack.enter_context(open(f, "rb", buffering=0))
                return handles[f]

            yield handle

    @contextmanager
    def readers(self, keys: list[str]) -> Iterator[dict[str, SpanReader]]:
        """key -> a reader of its file (`safe_open`'s `get_tensor`, `get_slice(key)[index]`), for `keys`."""
        with ExitStack() as stack:
            files = {f: SpanReader(stack.enter_context(open(f, "rb", buffering=0)), self.file_spans(f))
                     for f in {self.file_of(k) for k in keys}}
            yield {k: files[self.file_of(k)] for k in keys}

    def read(self, key: str) -> torch.Tensor:
        """One stored tensor, whole (a small one: a quant state, an extra buffer)."""
        with self.readers([key]) as r:
            return r[key].get_tensor(key)

    def load_all(self) -> dict[str, torch.Tensor]:
        """Every tensor of the checkpoint, by its name on disk, in its stored dtype (the whole load). A `.bin` file
        whose header was not read is unpickled with its data (its one read of the pickle)."""
        state: dict[str, torch.Tensor] = {}
        for f in self.files:
            if f.suffix == ".bin" and f not in self._spans:
                part = load_bin(f, "cpu")
            else:
                with open(f, "rb", buffering=0) as h:
                    part = _read_safetensors(h, self.file_spans(f)) if f.suffix != ".bin" else \
                        {k: SpanReader(h, self.file_spans(f)).get_tensor(k) for k in self.file_spans(f)}
            dup = state.keys() & part.keys()
            if dup:
                raise WeightsError(f"{f}: tensor(s) already present in another shard: {sorted(dup)[:5]}")
            state.update(part)
        return state


def load_weights(model_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of a model directory, by their names on disk, in their stored dtypes."""
    return CheckpointIndex(Path(model_dir)).load_all()
