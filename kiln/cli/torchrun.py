"""torch.distributed.run for `kiln launch`, without torchrun's own failure report.

When a rank fails, torchrun prints a traceback of its agent (ChildFailedError) under the rank's
message. Here the failure ends the process quietly with the rank's exit code; `kiln launch` then
prints the message each failed rank left in KILN_ERROR_DIR, once. A rank that died without one
(a signal, a bug) is still described. A rank killed, or one that lost its peer, ends the launch with
EXIT_PEER_LOST (76) and one line naming the first rank torchrun saw fail.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from kiln.constants import EXIT_PEER_LOST, EXIT_STOPPED, LAUNCH_CAUSE_FILE, LAUNCH_DIR_ENV, LAUNCH_PEER_LOST_PREFIX

# failures torchrun saw within this many seconds of the first came from one event (its SIGKILL of a rank that
# outlived SIGTERM comes after its shutdown grace, 30 s)
_SAME_MOMENT_S = 5


def main(argv: list[str] | None = None) -> int:
    # the agent logs each failed rank at ERROR before raising; the launcher reports failures itself
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        return _exit_for(e)
    except SignalException as e:  # a signal reached torchrun itself (before any rank caught it): it ended them
        return 128 + int(e.sigval)
    return 0


def _exit_for(e: ChildFailedError) -> int:
    """The launch's exit code for failed ranks, with at most one line about how they ended."""
    codes = [f.exitcode for _, f in sorted(e.failures.items())]
    # After a rank exits 75 (every rank saved and passed the barrier) torchrun ends the others with SIGTERM.
    if EXIT_STOPPED in codes:
        return EXIT_STOPPED
    # the cause: a rank ended by a signal other than SIGTERM (SIGKILL, the OOM killer) if there is one, since the
    # peers it left may exit 76 before torchrun notices it; else the first failure torchrun saw. A rank torchrun
    # itself SIGKILLed at the end of its teardown grace (a hung rank, after a peer's collective timed out) is
    # no cause: its failure is stamped (in whole seconds) that grace after the first.
    start = min(f.timestamp for f in e.failures.values())
    killed = [(r, f) for r, f in sorted(e.failures.items())
              if f.exitcode < 0 and -f.exitcode != signal.SIGTERM and f.timestamp <= start + _SAME_MOMENT_S]
    rank, first = killed[0] if killed else e.get_first_failure()
    if first.exitcode < 0 or first.exitcode == EXIT_PEER_LOST:
        # a rank killed (SIGKILL, the OOM killer) or one that lost its own peer: every rank has ended with it;
        # the run itself is sound and resumes from its newest checkpoint
        how = f"ended by {first.signal_name()}" if first.exitcode < 0 else f"lost a peer{_why_lost(rank)}"
        _say(f"kiln launch: rank {rank} {how}; every rank of the run ended with it (exit {EXIT_PEER_LOST}: "
             "requeue with --resume)")
        return EXIT_PEER_LOST
    if first.exitcode not in (1, 3):  # kiln's 1 and 3 said their message; say how any other code came
        _say(f"kiln launch: rank {rank} ended with exit code {first.exitcode}")
    return first.exitcode


def _why_lost(rank: int) -> str:
    """What the rank that lost its peer said about it, in parentheses ('' when it left nothing); a timeout
    names the setting that bounds it (the peer hung, or its node went away without closing its sockets)."""
    folder = os.environ.get(LAUNCH_DIR_ENV)
    if folder is None:  # launched without a launch folder: nothing was left
        return ""
    try:
        why = (Path(folder) / f"{LAUNCH_PEER_LOST_PREFIX}{rank:05d}").read_text(encoding="utf-8").strip()
    except (OSError, TypeError):
        return ""
    if "timed out" in why.lower() or "timeout" in why.lower():
        why += "; a peer hung or its node went away, after parallel.collective_timeout"
    return f" ({why})" if why else ""


def _say(line: str) -> None:
    """Hand the line to `kiln launch` (it prints it unless a rank left a user error, which is the cause then)."""
    folder = os.environ.get(LAUNCH_DIR_ENV)
    if folder:
        with contextlib.suppress(OSError):
            (Path(folder) / LAUNCH_CAUSE_FILE).write_text(line, encoding="utf-8")
            return
    print(line, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
