"""Safetensors headers without the weights: each tensor's name, shape, dtype and file, from the 8-byte
header length and the JSON header of every file a model directory's index names (nothing is mapped).

This is what `kiln plan` reads: a 700 GB checkpoint's headers are a few megabytes. No torch import, but for
PyTorch `.bin` weights (pytorch_model.bin, or shards and their index), whose pickle is read onto the meta device
(kiln.hub.pickled: names, dtypes and shapes, no tensor data).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import WeightsError
from kiln.hub.jsonio import read_json

SAFE_SINGLE = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
BIN_SINGLE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"

# Bytes per element of each safetensors dtype name (the format's own spelling).
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
               "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
# torch's dtype names -> the safetensors spelling (kiln.hub.weights maps the same names to torch dtypes)
TORCH_DTYPE_NAMES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                     "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0", "int64": "I64",
                     "int32": "I32", "int16": "I16", "int8": "I8", "uint64": "U64", "uint32": "U32", "uint16": "U16",
                     "uint8": "U8", "bool": "BOOL"}
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
# A header this large is a corrupt length field, not a header (safetensors itself caps it at 100 MB).
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorHeader:
    name: str
    shape: tuple[int, ...]
    dtype: str           # safetensors spelling: BF16, F32, F8_E4M3 ...
    file: str            # the file's name inside the model directory

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


def index_files(index: Path) -> list[Path]:
    """The weight files a shard index (`*.index.json`) names, each checked to be beside it."""
    weight_map = read_json(index, error=WeightsError, want=dict).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise WeightsError(f"{index}: not a valid shard index (no weight_map object)")
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not (index.parent / f).is_file()]
    if missing:
        raise WeightsError(f"{index}: names shard file(s) that are not in the directory: {', '.join(missing)}")
    return [index.parent / f for f in files]


def weight_files(model_dir: str | os.PathLike) -> list[Path]:
    """The weight files of a model directory, in the order they are read (safetensors first): those an index
    names (all present), or the single file."""
    model_dir = Path(model_dir)
    for index_name in (SAFE_INDEX, BIN_INDEX):
        index = model_dir / index_name
        if index.is_file():
            return index_files(index)
    for single in (SAFE_SINGLE, BIN_SINGLE):
        if (model_dir / single).is_file():
            return [model_dir / single]
    raise WeightsError(
        f"{model_dir}: no weights found (looked for {SAFE_SINGLE}, {SAFE_INDEX}, {BIN_SINGLE}, {BIN_INDEX})"
    )


@dataclass(frozen=True)
class SafetensorsHeader:
    """One safetensors file's header, parsed and checked once: each tensor's (dtype, shape, first byte, end byte)
    from the start of the file, in the header's order."""
    tensors: dict[str, tuple[str, tuple[int, ...], int, int]]


def parse_safetensors(path: str | os.PathLike) -> SafetensorsHeader:
    """Read and check one safetensors file's header (8 + header-length bytes; no tensor data): the checks the
    safetensors library makes on open (a JSON object, known dtypes, each tensor's bytes its shape times its width,
    the tensors' byte ranges tiling the data buffer to the end of the file), so a truncated file or another format
    is named here, once, not when a tensor is read."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise WeightsError(_unreadable(path, f"{len(head)} bytes, too short for a header length"))
            (length,) = struct.unpack("<Q", head)
            if length > min(_MAX_HEADER, size - 8):
                raise WeightsError(_unreadable(path, f"header length {length} does not fit the file ({size} bytes)"))
            raw = f.read(length)
    except PermissionError:
        raise WeightsError(f"{path}: permission denied: this user may not read the file; ask its owner to make "
                           "it readable (chmod a+r) or copy it somewhere you can read") from None
    except OSError as e:
        raise WeightsError(f"{path}: cannot read ({e})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(_unreadable(path, f"the header is not valid JSON: {e}")) from None
    if not isinstance(header, dict):
        raise WeightsError(_unreadable(path, "the header is not a JSON object"))
    data = 8 + length
    out: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if not isinstance(info, dict) or info.get("dtype") not in DTYPE_BYTES or not isinstance(info.get("shape"), list) \
                or not all(isinstance(d, int) and d >= 0 for d in info["shape"]) or not isinstance(offsets, list) \
                or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets):
            raise WeightsError(_unreadable(path, f"tensor {name!r} has no readable dtype/shape/data_offsets ({info!r})"))
        shape = tuple(info["shape"])
        begin, end = offsets
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end or end - begin != numel * DTYPE_BYTES[info["dtype"]]:
            raise WeightsError(_unreadable(path, f"tensor {name!r} has data_offsets {offsets}, which do not hold "
                                                 f"{info['dtype']}{list(shape)}"))
        out[name] = (info["dtype"], shape, data + begin, data + end)
    covered = data
    for _, _, begin, end in sorted(out.values(), key=lambda t: (t[2], t[3])):
        if begin != covered:
            raise WeightsError(_unreadable(path, f"its tensors' bytes leave a gap or overlap at byte {covered}"))
        covered = end
    if covered != size:
        raise WeightsError(_unreadable(path, f"its tensors end at byte {covered}, the file at {size}"))
    return SafetensorsHeader(out)


def _unreadable(path: Path, why: str) -> str:
    return f"{path}: not a readable safetensors file ({why}); is it truncated or another format?"


def read_header(path: str | os.PathLike) -> dict[str, TensorHeader]:
    """The tensors one safetensors file holds, from its header alone (reads 8 + header-length bytes); of a .bin
    file, from its pickle."""
    path = Path(path)
    if path.suffix == ".bin":
        return _bin_header(path)
    return {name: TensorHeader(name, shape, dtype, path.name)
            for name, (dtype, shape, _, _) in parse_safetensors(path).tensors.items()}


def _bin_header(path: Path) -> dict[str, TensorHeader]:
    from kiln.hub.pickled import load_bin

    out = {}
    for name, t in load_bin(path, "meta").items():
        dtype = TORCH_DTYPE_NAMES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise WeightsError(f"{path}: tensor {name!r} has dtype {t.dtype}, which kiln does not read")
        out[name] = TensorHeader(name, tuple(t.shape), dtype, path.name)
    return out


def read_headers(model_dir: str | os.PathLike) -> tuple[dict[str, TensorHeader], dict[str, int]]:
    """(every tensor of a model directory by name, each file's size in bytes), from headers only."""
    tensors: dict[str, TensorHeader] = {}
    sizes: dict[str, int] = {}
    for path in weight_files(model_dir):
        part = read_header(path)
        dup = tensors.keys() & part.keys()
        if dup:
            raise WeightsError(f"{path}: tensor(s) already present in another shard: {sorted(dup)[:5]}")
        tensors.update(part)
        sizes[path.name] = path.stat().st_size
    return tensors, sizes
