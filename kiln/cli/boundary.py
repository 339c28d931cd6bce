"""The CLI's error boundary: which exceptions are the user's to fix, and how their message is shown.

Whatever a user caused (a KilnError, an OSError on their paths such as a read-only or full disk,
text that is not UTF-8, a config that fails validation) becomes one line, `kiln: <message>`.
Anything else is a bug in kiln and keeps its traceback. Under `kiln launch` (KILN_ERROR_DIR set) a
rank writes its message into that folder instead, and the launcher prints it once.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from kiln.errors import KilnError

if TYPE_CHECKING:
    from pydantic import ValidationError

ERROR_DIR_ENV = "KILN_ERROR_DIR"


def _os_message(e: OSError) -> str:
    what = e.strerror or str(e) or type(e).__name__
    if e.errno == errno.ENOSPC:
        what += "; free some space and run the command again"
    elif e.errno == errno.EROFS:
        what += "; choose a location you can write to"
    elif e.errno in (errno.EACCES, errno.EPERM):  # said as what it is, not as a missing file
        what = f"permission denied ({what}): this user may not use it; check its permissions (ls -l) or " \
               "choose a location you can use"
    names = [str(n) for n in (e.filename, e.filename2) if n is not None]
    return f"{' -> '.join(names)}: {what}" if names else what


def _validation_message(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, x['loc'])) or 'value'}: {x['msg']}" for x in e.errors())


def user_message(e: BaseException) -> str | None:
    """The one-line message for an error the user can act on; None for a bug (keep the traceback)."""
    from pydantic import ValidationError

    if isinstance(e, KilnError):
        return str(e)
    if isinstance(e, UnicodeDecodeError):
        return f"text that is not valid UTF-8 ({e.reason} at byte {e.start}); re-encode the file as UTF-8"
    if isinstance(e, OSError):
        return _os_message(e)
    if isinstance(e, ValidationError):
        return _validation_message(e)
    from safetensors import SafetensorError

    if isinstance(e, SafetensorError):  # the Rust library's I/O and format errors (a full disk, a torn file)
        hint = ("; free some space and run the command again" if "os error 28" in str(e) else
                "; a file-size limit (ulimit -f) or the filesystem's largest file stopped it" if "os error 27" in str(e)
                else "")
        return f"a .safetensors file could not be read or written: {e}{hint}"
    import torch

    if isinstance(e, torch.OutOfMemoryError):
        return f"out of memory: {str(e).splitlines()[0]}; use a smaller batch_size or max_length"
    return None


def report(message: str) -> None:
    """Print (or, under `kiln launch`, hand to the launcher) a user error."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if folder:
        try:
            (Path(folder) / f"rank-{int(os.environ.get('RANK', '0')):05d}.txt").write_text(message, encoding="utf-8")
            return
        except OSError:
            pass  # the launcher's folder is gone: say it here instead
    typer.echo(f"kiln: {message}", err=True)
