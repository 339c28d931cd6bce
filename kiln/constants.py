"""Constants shared by every layer (this module imports nothing)."""

IGNORE_INDEX = -100  # a target position that carries no loss (the value transformers and torch use)
BASE_TASK = "base"  # the bare backbone's task (no head, HF names unprefixed); kiln.models.tasks.BASE is its Task
# `kiln launch` names a folder here where each rank leaves its pid once it catches SIGTERM / SIGINT
# (kiln.train.preempt), so the launcher can pass a signal on to the ranks themselves.
LAUNCH_DIR_ENV = "KILN_LAUNCH_DIR"
# ... and, when the launcher itself got SIGTERM / SIGINT, a file of this name, so a rank tells the launcher's
# signal (say so, stop) from torchrun's teardown after a lost peer (stay quiet: the launcher says what happened)
LAUNCHER_SIGNAL_FILE = "launcher-signal"
# ... and where kiln.cli.torchrun leaves its one line on how the ranks ended, for the launcher to print
LAUNCH_CAUSE_FILE = "launch-cause.txt"
# ... and where a rank that lost its peer leaves why (gloo's or the store's words), as f"{prefix}{rank:05d}", for
# that line
LAUNCH_PEER_LOST_PREFIX = "peer-lost-"
# Exit codes that the launcher's torchrun wrapper (which must not import the CLI) shares with `kiln train`; the
# whole table is kiln.cli.common's (README, "Exit codes")
EXIT_STOPPED = 75        # stopped by SIGTERM / SIGINT or train.max_time, checkpoint written: requeue with --resume
                         # (EX_TEMPFAIL of sysexits.h)
EXIT_PEER_LOST = 76      # a rank lost a peer (one killed, a node gone, a collective timed out): every rank ends;
                         # requeue with --resume from the newest checkpoint (EX_PROTOCOL of sysexits.h)
