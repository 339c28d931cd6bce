"""What several commands share: flag range checks and loading a model to predict with.

A model loaded for prediction must hold what it predicts with: a head the directory does not have
(classify on a masked-LM directory) or weights its config.json does not describe are refused
(kiln.interop.load_report) unless --allow-missing / --allow-unused say otherwise, and whatever was
dropped or initialised is said on stderr.

`share_cores` sets the default torch thread count of a compute command: this process's share of the cores
it may run on, counting the other kiln processes of this user running on the machine (and the ranks a
launch starts), so two runs side by side do not each spin a thread per core. OMP_NUM_THREADS, when set,
wins and nothing is said. A process that started earlier keeps the count it chose.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import math
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from kiln.cli.output import note
from kiln.constants import EXIT_PEER_LOST, EXIT_STOPPED, LAUNCH_DIR_ENV, LAUNCH_PEER_LOST_PREFIX  # noqa: F401 (the table)
from kiln.errors import KilnError

# Exit codes of `kiln train` (README, "Exit codes"): what a scheduler script needs to decide on a requeue.
# 2 is a command-line usage error (typer); a second SIGTERM / SIGINT ends the process by that signal (128 + N).
EXIT_OK = 0
EXIT_USER_ERROR = 1      # bad config, data or paths: the message says what to fix; rerunning as is fails again
EXIT_NON_FINITE = 3      # non-finite loss or gradient with train.non_finite = "fail"
EXIT_INTERNAL = 70       # a bug in kiln (traceback printed); EX_SOFTWARE of sysexits.h
# EXIT_STOPPED (75) and EXIT_PEER_LOST (76) live in kiln.constants (the torchrun wrapper needs them without typer)


def exit_codes(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command` with kiln train's exit codes: a non-finite abort exits EXIT_NON_FINITE with its message, a bug
    EXIT_INTERNAL with its traceback; user errors are left to the CLI's boundary (exit 1)."""
    from kiln.cli.boundary import report, user_message
    from kiln.errors import NonFiniteError

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except NonFiniteError as e:
            report(str(e))
            raise typer.Exit(EXIT_NON_FINITE) from None
        except (typer.Exit, typer.Abort):
            raise
        except Exception as e:
            from kiln.parallel.world import lost_peer

            why = lost_peer(e)
            if why is not None:
                peer_lost_exit(why)
            if user_message(e) is not None:
                raise
            traceback.print_exc()
            raise typer.Exit(EXIT_INTERNAL) from None
    return run


def peer_lost_exit(why: str) -> None:
    """End this rank at once with EXIT_PEER_LOST: no barrier or teardown (the group is broken). Under `kiln
    launch` the launcher says, in one line, which rank was lost; elsewhere this rank says it."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    folder = os.environ.get(LAUNCH_DIR_ENV)
    if folder:  # the launcher's line says why (a timeout names the setting that bounds it)
        with contextlib.suppress(OSError):
            (Path(folder) / f"{LAUNCH_PEER_LOST_PREFIX}{rank:05d}").write_text(why, encoding="utf-8")
    else:
        print(f"kiln: rank {rank} lost a peer ({why}); every rank ends: requeue with --resume "
              f"(exit {EXIT_PEER_LOST})", file=sys.stderr)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(EXIT_PEER_LOST)


ALLOW_MISSING = typer.Option(False, "--allow-missing", help="Use tensors the directory lacks (e.g. a head) "
                                                            "freshly initialised, instead of refusing.")
ALLOW_UNUSED = typer.Option(False, "--allow-unused", help="Drop tensors the model config does not use, "
                                                          "instead of refusing.")


def check_range(flag: str, value: float, low: float | None = None, high: float | None = None,
                low_open: bool = False) -> None:
    """Refuse `value` outside [low, high] (or (low, high] with `low_open`), or not a finite number."""
    ok = not (isinstance(value, float) and not math.isfinite(value))
    if low is not None:
        ok = ok and (value > low if low_open else value >= low)
    if high is not None:
        ok = ok and value <= high
    if not ok:
        lo = "" if low is None else (f"> {low:g}" if low_open else f">= {low:g}")
        hi = "" if high is None else f"<= {high:g}"
        finite = "" if math.isfinite(value) else "a finite number "  # else "must be >= 0, got inf" reads as false
        raise KilnError(f"{flag} must be {finite}{' and '.join(x for x in (lo, hi) if x)}, got {value:g}")


def load_for_prediction(model_dir: Path, task: str, allow_missing: bool, allow_unused: bool):
    """The model of `model_dir` with the `task` head, refused if that head or its weights would be made up."""
    from kiln.interop.load_report import check_load
    from kiln.models.auto import load_config, load_pretrained
    from kiln.train.checks import check_model_tokenizer

    source_task = load_config(model_dir)[2]
    model = load_pretrained(model_dir, task=task)
    for line in check_load(model, str(model_dir), source_task, allow_missing=allow_missing,
                           allow_unused=allow_unused):
        note(line)
    if model.tokenizer is None:
        raise KilnError(f"{model_dir}: no tokenizer files (tokenizer.json or vocab.txt) next to the model")
    check_model_tokenizer(model, None, str(model_dir))
    return model


def fit_length(model, n_tokens: int, what: str, cut: bool) -> int | None:
    """The position limit of `model` if `n_tokens` passes it: refused, or (`cut`) noted and returned."""
    from kiln.train.checks import position_limit

    limit = position_limit(model)
    if limit is None or n_tokens <= limit:
        return None
    if not cut:
        raise KilnError(f"{what} is {n_tokens} tokens, more than the model's {limit} positions; shorten it")
    note(f"{what} is {n_tokens} tokens; the model reads the first {limit}, the rest is cut off")
    return limit


# ---- threads ------------------------------------------------------------------------------------
# One file per running kiln compute process: RUN/<pid> holding "<start time> <processes it stands for>".
_REGISTRY = Path(tempfile.gettempdir()) / f"kiln-{getattr(os, 'getuid', lambda: 0)()}-processes"


def _start_time(pid: int) -> str | None:
    """A process's start time (clock ticks after boot), which tells a live entry from a reused pid; None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[19]  # field 22 counts from the pid; the name may hold spaces
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"  # no /proc: alive, start unknown


def _others() -> int:
    """Processes the other live entries stand for; entries of processes that are gone are removed."""
    total = 0
    for entry in _REGISTRY.glob("[0-9]*") if _REGISTRY.is_dir() else []:
        try:
            pid = int(entry.name)
            start, weight = entry.read_text().split()
        except (OSError, ValueError):
            continue
        if pid == os.getpid():
            continue
        now = _start_time(pid)
        if now is None or (now != "?" and start != "?" and now != start):
            entry.unlink(missing_ok=True)  # gone (or its pid reused): not running kiln
            continue
        total += max(1, int(weight)) if weight.isdigit() else 1
    return total


def _register(weight: int) -> None:
    try:
        _REGISTRY.mkdir(parents=True, exist_ok=True)
        entry = _REGISTRY / str(os.getpid())
        tmp = _REGISTRY / f".{os.getpid()}.tmp"
        tmp.write_text(f"{_start_time(os.getpid()) or '?'} {weight}")
        tmp.replace(entry)
        atexit.register(entry.unlink, missing_ok=True)
    except OSError:
        pass  # a temp folder we cannot write: this process is not counted by others; nothing breaks


def share_cores(processes: int = 1) -> int | None:
    """This command's thread count per process, when OMP_NUM_THREADS does not set it: the cores this process
    may run on over every kiln process of this user running here, this command's `processes` included;
    registers this command for the ones that start later and says what it chose. None when the user chose."""
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    others = _others()
    _register(processes)
    threads = max(1, cores // (others + processes))
    who = f"{processes} process(es) of this command" if processes > 1 else "this process"
    note(f"torch threads: {threads} per process ({cores} cores over {who}"
         + (f" and {others} other kiln process(es) running here" if others else "")
         + "); set OMP_NUM_THREADS to choose")
    return threads


def share_cores_for(argv: list[str]) -> None:
    """At the entry point (`kiln` / `python -m kiln.cli.main`, not an in-process call): a `kiln train`
    process (or launch rank) takes its share of the cores as torch's thread count."""
    command = next((a for a in argv if not a.startswith("-")), None)
    if command != "train" or "--help" in argv or "-h" in argv:  # help stays light (no torch)
        return
    threads = share_cores(int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
