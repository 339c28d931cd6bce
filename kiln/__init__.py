"""kiln: a PyTorch-native training engine that reads and writes HuggingFace formats bit-exactly."""

import sys as _sys

__version__ = "0.1.0"


def _bytecode_safe() -> None:
    """Under a file-size limit (`ulimit -f`, a scheduler's RLIMIT_FSIZE), CPython writes a .pyc cut short by the
    limit without an error, and that truncated cache then fails every later import of the module ("EOFError:
    marshal data too short") until its source changes: every kiln command dead after one limited run. With a
    finite limit, no bytecode is written (modules load from source as usual)."""
    try:
        import resource
    except ImportError:  # not POSIX: no such limit
        return
    if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
        _sys.dont_write_bytecode = True


_bytecode_safe()
