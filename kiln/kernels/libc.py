"""The C library's own functions through ctypes (glibc's heap controls: kiln.parallel.memory_heap,
kiln.models.common.tied_grad)."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys
from typing import Any


@functools.cache
def glibc(symbol: str) -> Any:
    """The C library's function `symbol` (Linux only), or None where there is none (another OS, musl without
    glibc's malloc tuning)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), symbol)
    except (OSError, AttributeError):
        return None
