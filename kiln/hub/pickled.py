"""PyTorch `.bin` weights (torch.save's zip format, as transformers wrote pytorch_model*.bin) without their data.

`bin_layout` gives each tensor's byte offset, dtype and shape in the file: the pickle is read with weights_only=True
onto the meta device, where torch reads no tensor data and notes each storage's offset in the file
(`_checkpoint_offset`; the records are stored uncompressed). A sharded read (kiln.parallel.sharded_load) reads
each rank's slices from there, and `kiln plan` sizes the model from it. Chosen over mapping the file (torch's mmap
load, weights-only too): a mapping counts every page a slice touches in the process's memory until it is unmapped,
beside the copy, so a rank's peak would rise by about twice its share (benchmarks/RESULTS.md, the .bin load row).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import torch

from kiln.errors import WeightsError


class NotInPlace(WeightsError):
    """A weights file some tensor of which is not one run of plain bytes in the file (a legacy or compressed
    PyTorch file, big-endian data, a strided tensor): it can only be loaded whole."""


def load_bin(path: str | os.PathLike, map_location: str = "cpu") -> dict[str, torch.Tensor]:
    """The dict of tensors a PyTorch weights file holds (weights_only=True: no code in it runs)."""
    try:
        sd = torch.load(str(path), map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for a bad pickle; all mean "not loadable"
        raise WeightsError(f"{path}: not a loadable PyTorch weights file ({type(e).__name__}: {e})") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise WeightsError(f"{path}: expected a dict of tensors")
    return sd


def bin_layout(path: str | os.PathLike) -> dict[str, tuple[int, torch.dtype, tuple[int, ...]]]:
    """Each tensor of a PyTorch zip checkpoint: (offset of its first byte in the file, dtype, shape); no tensor
    data is read. NotInPlace where some tensor cannot be read as one run of bytes."""
    path = Path(path)
    try:
        with zipfile.ZipFile(path) as z:  # the central directory only
            infos = z.infolist()
            order = [i for i in infos if i.filename.endswith("/byteorder")]
            byteorder = z.read(order[0]).decode() if order else "little"
    except zipfile.BadZipFile:
        raise NotInPlace(f"{path}: not a zip-format PyTorch file (saved by torch before 1.6?); it loads whole") \
            from None
    except OSError as e:
        raise WeightsError(f"{path}: cannot read ({e})") from None
    if byteorder != "little":
        raise NotInPlace(f"{path}: its tensors are stored {byteorder}-endian (kiln reads little-endian bytes in "
                         "place); it loads whole")
    packed = [i for i in infos if "/data/" in i.filename and i.compress_type != zipfile.ZIP_STORED]
    if packed:
        raise NotInPlace(f"{path}: its tensor record {packed[0].filename!r} is compressed (zip method "
                         f"{packed[0].compress_type}, not stored); it loads whole")
    out = {}
    for k, t in load_bin(path, "meta").items():
        base = getattr(t.untyped_storage(), "_checkpoint_offset", None)
        if base is None:
            raise NotInPlace(f"{path}: torch gave no file offset for tensor {k!r} (torch {torch.__version__} reading "
                             "onto meta); it loads whole")
        if not t.is_contiguous():
            raise NotInPlace(f"{path}: tensor {k!r} is not stored as one run of bytes (strided); it loads whole")
        out[k] = (base + t.storage_offset() * t.element_size(), t.dtype, tuple(t.shape))
    return out
