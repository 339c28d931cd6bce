"""torch.distributed.run for `kiln launch`, without torchrun's own failure report.

When a rank fails, torchrun prints a traceback of its agent (ChildFailedError) under the rank's
message. Here the failure ends the process quietly with the rank's exit code; `kiln launch` then
prints the message each failed rank left in KILN_ERROR_DIR, once. A rank that died without one
(a signal, a bug) is still described.
"""

from __future__ import annotations

import logging
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run


def main(argv: list[str] | None = None) -> int:
    # the agent logs each failed rank at ERROR before raising; the launcher reports failures itself
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    try:
        run(parse_args(argv))
    except ChildFailedError as e:
        codes = []
        for rank, failure in sorted(e.failures.items()):
            codes.append(failure.exitcode)
            if failure.exitcode != 1:  # not kiln's own exit 1 (a message, or a bug's traceback): say how it ended
                how = failure.signal_name() if failure.exitcode < 0 else f"exit code {failure.exitcode}"
                print(f"kiln launch: rank {rank} ended with {how}", file=sys.stderr)
        return next((c for c in codes if c > 0), 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
