"""torch.distributed.run for `kiln launch`, without torchrun's own failure report.

When a rank fails, torchrun prints a traceback of its agent (ChildFailedError) under the rank's
message. Here the failure ends the process quietly with the rank's exit code; `kiln launch` then
prints the message each failed rank left in KILN_ERROR_DIR, once. A rank that died without one
(a signal, a bug) is still described.
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def main(argv: list[str] | None = None) -> int:
    # the agent logs each failed rank at ERROR before raising; the launcher reports failures itself
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        codes = []
        # After a rank exits 75 (every rank saved and passed the barrier) torchrun ends the others with SIGTERM.
        stopped = any(f.exitcode == 75 for f in e.failures.values())
        for rank, failure in sorted(e.failures.items()):
            codes.append(failure.exitcode)
            # not kiln's own 1 (a message), 3 (non-finite, a message) or 75 (stopped, its line said): say how it ended.
            if failure.exitcode not in (1, 3, 75) and not (stopped and failure.exitcode < 0):
                how = failure.signal_name() if failure.exitcode < 0 else f"exit code {failure.exitcode}"
                print(f"kiln launch: rank {rank} ended with {how}", file=sys.stderr)
        # a rank's own code first; else one ended by a signal N, as a shell says it (128 + N)
        return next((c for c in codes if c > 0), next((128 - c for c in codes if c < 0), 1))
    except SignalException as e:  # a signal reached torchrun itself (before any rank caught it): it ended them
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
