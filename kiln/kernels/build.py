"""Building kiln's C kernels: a source under kiln/kernels/csrc/ compiled on first use with the system compiler.

A kernel is a C file shipped as package data (no Python or torch headers, so it compiles in about a second);
`read_source(name)` reads `csrc/<name>.c`. `load(name, source)` compiles it once into a shared library under the user
cache dir (`$KILN_CACHE_DIR`, else `$XDG_CACHE_HOME/kiln`, else `~/.cache/kiln`; then `native/`), named by the
hash of the source text, the compiler command and this CPU (the code is built for `-march=native`), so a later
process only loads it. The library is written under a temporary name and renamed into place: two processes
compiling at once both succeed and the one left is whole. Beside it, `<lib>.sum` holds its size and sha256; a
cached library is checked against them before it is loaded (a library truncated after a valid ELF header, by a
full disk or a killed copy, would otherwise crash the process with SIGBUS inside dlopen), and one that does not
match, or has no record, is rebuilt, with one warning.

`load` returns None where there is no native path: `KILN_NATIVE=0` or no compiler (`$CC`, a command with
its own flags if need be, else `cc`), logged at debug level; a failed compile or load, logged once as a
warning with the compiler's last words (the torch path is slower). The caller then uses its torch
implementation, which gives the same values (or, for a fast path, values within its rounding). The ops over
these libraries (their checks, fake implementations, torch.compile) are kiln/kernels/dequant4.py and
lora_update.py.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.resources
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared", "-pthread")  # contract=off: no FMA,
# so a product and a sum round as torch's separate ops round
_LOCK = threading.Lock()
_LOADED: dict[str, ctypes.CDLL | None] = {}
_OFF_LOGGED: list[bool] = []


@functools.cache
def read_source(name: str) -> str:
    """The C source of kernel `name`: kiln/kernels/csrc/<name>.c, read from the installed package (once)."""
    return (importlib.resources.files("kiln.kernels") / "csrc" / f"{name}.c").read_text(encoding="utf-8")


def enabled() -> bool:
    return os.environ.get("KILN_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


def cache_dir() -> Path:
    root = os.environ.get("KILN_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln"
    return Path(root) / "native"


def _cpu() -> str:
    """What -march=native builds for: the CPU's model and flags (one core's lines of /proc/cpuinfo)."""
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [ln for ln in lines if ln.split(":")[0].strip() in ("vendor_id", "model name", "flags", "Features")]
    return "\n".join(dict.fromkeys(keep))


def _compiler() -> list[str] | None:
    """The compiler command: `$CC` split as a shell would (`ccache gcc`, `gcc -m64`), else `cc`; None where
    its program is not found."""
    try:
        cmd = shlex.split(os.environ.get("CC") or "cc")
    except ValueError:
        return None
    path = shutil.which(cmd[0]) if cmd else None
    return [path, *cmd[1:]] if path else None


def library_path(name: str, source: str) -> Path | None:
    """Where `source`'s library is (or will be) cached; None without a compiler."""
    cc = _compiler()
    if cc is None:
        return None
    key = hashlib.sha256("\0".join([source, os.path.realpath(cc[0]), *cc[1:], *FLAGS, platform.machine(),
                                    _cpu()]).encode())
    return cache_dir() / f"{name}-{key.hexdigest()[:16]}.so"


def _record(lib: Path) -> str:
    """What `<lib>.sum` holds for a library: its size and sha256."""
    h = hashlib.sha256()
    with open(lib, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return f"{lib.stat().st_size} {h.hexdigest()}\n"


def sum_path(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sum")


def _cached_ok(path: Path) -> str | None:
    """None when the cached library matches its record; else why it does not (it is then rebuilt)."""
    try:
        want = sum_path(path).read_text()
    except OSError:
        return "it has no size and digest record beside it"
    try:
        have = _record(path)
    except OSError as e:
        return f"it cannot be read ({e.strerror})"
    if have != want:
        size = want.split()[0] if want.split() else "?"
        return f"it does not match its record ({path.stat().st_size} bytes, recorded {size}, or another digest)"
    return None


def _build(name: str, source: str) -> Path:
    path = library_path(name, source)
    if path is None:
        raise OSError(f"no C compiler ({os.environ.get('CC') or 'cc'} not found)")
    why = _cached_ok(path) if path.exists() else None
    if path.exists() and why is None:
        return path
    try:
        _compile(name, source, path)
    except (OSError, subprocess.SubprocessError) as e:
        raise OSError(f"the cached library {path} was refused ({why}) and rebuilding it failed: {e}" if why else e) from e
    if why is not None:  # one warning: the refusal and its mend together
        log.warning("kiln native kernel %r: the cached library %s was rebuilt: %s", name, path, why)
    return path


def _compile(name: str, source: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{name}-") as tmp:
        src, lib = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
        src.write_text(source)
        # relative names, run inside the temporary folder: the library embeds no temporary path, so two builds
        # of one source are the same bytes (a concurrent build's record matches the other's library)
        cc = _compiler()
        if cc is None:  # library_path found one a moment ago
            raise OSError(f"no C compiler ({os.environ.get('CC') or 'cc'} not found)")
        run = subprocess.run([*cc, *FLAGS, "-o", lib.name, src.name], capture_output=True, text=True,
                             check=False, timeout=120, cwd=tmp)
        if run.returncode != 0:
            raise OSError(f"compile failed ({run.returncode}): {run.stderr.strip()[-2000:]}")
        record = Path(tmp) / "sum"
        record.write_text(_record(lib))
        for f in (lib, record):
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        # the record first: a reader between the renames sees a library that does not match it and rebuilds
        # (never loads an unchecked one); a concurrent build renames identical files over both
        os.replace(record, sum_path(path))
        os.replace(lib, path)
    if _cached_ok(path) is not None:  # another process's build landed between our renames: theirs is whole too
        raise OSError(f"{path} changed while it was written (another process building it?); try again")


def load(name: str, source: str) -> ctypes.CDLL | None:
    """The compiled library of C `source` (cached; built on the first call), or None where there is no native
    path (see the module docstring). The answer is kept for the process, per name."""
    if not enabled():
        if not _OFF_LOGGED:
            _OFF_LOGGED.append(True)
            log.debug("kiln native kernels off (KILN_NATIVE=0), using torch")
        return None
    with _LOCK:
        if name in _LOADED:
            return _LOADED[name]
        try:
            lib = ctypes.CDLL(str(_build(name, source)))
        except (OSError, subprocess.SubprocessError) as e:
            # no compiler is an expected setup (debug); a compiler that fails is worth a word (once per kernel)
            level = logging.DEBUG if _compiler() is None else logging.WARNING
            log.log(level, "kiln native kernel %r unavailable, using the slower torch path: %s", name, e)
            lib = None
        _LOADED[name] = lib
        return lib


def forget(name: str) -> None:
    """Drop the process's answer for `name`, so the next `load` tries again (tests change the environment)."""
    with _LOCK:
        _LOADED.pop(name, None)
