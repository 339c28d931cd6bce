"""Stopping a run cleanly between steps: on SIGTERM / SIGINT, or before `train.max_time` runs out.

Schedulers (SLURM, Kubernetes, spot instances) stop a job with SIGTERM and a grace period before SIGKILL,
then start the same command again. `Stop` turns the first SIGTERM or SIGINT into a request: the step in
flight finishes, a checkpoint is written (unless `train.stop_save = false`), one line says where to resume,
and `kiln train` exits with EXIT_STOPPED (kiln.cli.common). A second signal ends the process at once, by
the signal's own default action (exit 128 + N in a shell; checkpoint writes are atomic, so this is as safe
as a SIGKILL).

Several processes (kiln launch) agree on the stop step: after every step each rank contributes its reason
(0 = none) to one MAX all-reduce of a single integer, so a signal that reaches one rank stops every rank at
the same step, and the save is the usual collective one (sharded checkpoints included). Under `kiln launch`
each rank leaves its pid in KILN_LAUNCH_DIR once its handlers are in place, so the launcher can pass a
signal on to the ranks themselves (torchrun's own relay would kill them 30 s later).

`train.max_time` ("3h50m", "90m", "45s", "1h30m15s") counts from the start of the process; the run stops at
the first step boundary where the time left is under twice the longest step so far (a step's time includes
the evaluation and the save that followed it): room for one more step, or for the final save.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kiln.constants import LAUNCH_DIR_ENV, LAUNCHER_SIGNAL_FILE
from kiln.train import checkpoint as ckpt

_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Reasons as integers for the all-reduce; MAX picks the most urgent one any rank has.
_REASONS = {0: None, 1: "max_time", 2: "SIGINT", 3: "SIGTERM"}
_CODES = {v: k for k, v in _REASONS.items()}
# The signal the installed Stop caught (None: none yet). Code waiting on user work (kiln.train.envs.call_user)
# polls it, so a hung reward function or environment is abandoned at once instead of holding up the stop.
_CAUGHT: str | None = None
_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s)?$")


def signalled() -> str | None:
    """The signal ("SIGTERM", "SIGINT") a running fit has caught and is stopping for; None when none."""
    return _CAUGHT


def parse_duration(text: str, key: str = "train.max_time") -> float:
    """Seconds in `text`, written as hours, minutes and seconds in that order ("3h50m", "90m", "1h30m15s",
    "2.5h"); anything else is refused naming `key`."""
    m = _DURATION.match(text.strip().replace(" ", "")) if isinstance(text, str) else None
    if not m or not any(m.groups()):
        raise ValueError(f"{key} must be a duration such as \"3h50m\", \"90m\", \"45s\" or \"1h30m15s\" "
                         f"(hours, minutes, seconds in that order), got {text!r}")
    h, mi, s = (float(g) if g else 0.0 for g in m.groups())
    seconds = h * 3600 + mi * 60 + s
    if seconds <= 0:
        raise ValueError(f"{key} must be longer than 0 seconds, got {text!r}")
    return seconds


def process_start_time() -> float:
    """When this process started (seconds since the epoch): where a scheduler's time limit counts from."""
    try:  # Linux: the start time in clock ticks after boot (field 22 of /proc/self/stat), plus the boot time
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, StopIteration, IndexError, ValueError):
        return _IMPORTED  # elsewhere: when kiln's training code was first imported, a little later


_IMPORTED = time.time()


class Stop:
    """The stop request of one run: signal handlers while the loop runs, the max_time clock, the agreement."""

    def __init__(self, trainer: Any):
        self.trainer = trainer
        self.signal: str | None = None
        self.limit = parse_duration(trainer.args.max_time) if trainer.args.max_time else None
        self.deadline = process_start_time() + self.limit if self.limit else None
        self.longest = 0.0
        self._last = time.time()
        self._previous: dict[int, Any] = {}
        self._pid_file: Path | None = None

    # ---- handlers ---------------------------------------------------------------------------------------
    def install(self) -> Stop:
        """Catch SIGINT and SIGTERM (main thread only) until `uninstall`."""
        global _CAUGHT
        _CAUGHT = None
        try:
            for s in _SIGNALS:
                self._previous[s] = signal.signal(s, self._on_signal)
        except ValueError:  # not the main thread: signals cannot be caught here; max_time still works
            self._previous.clear()
        folder = os.environ.get(LAUNCH_DIR_ENV)
        if folder and self._previous and Path(folder).is_dir():
            self._pid_file = Path(folder) / f"pid-{self.trainer.world.rank:05d}"
            tmp = Path(folder) / f".{self._pid_file.name}.tmp"  # renamed: the launcher never reads half a pid
            tmp.write_text(str(os.getpid()))
            tmp.replace(self._pid_file)
        self._last = time.time()
        return self

    def uninstall(self) -> None:
        global _CAUGHT
        _CAUGHT = None  # user code called after this fit is not cut short by its stop
        if self._pid_file is not None:
            self._pid_file.unlink(missing_ok=True)
        for s, handler in self._previous.items():
            if handler is not None:  # None: a handler set outside Python, which cannot be put back from here
                signal.signal(s, handler)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signal is not None:  # the second: stop at once, as if kiln had not caught the first
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        global _CAUGHT
        self.signal = _CAUGHT = signal.Signals(signum).name
        folder = os.environ.get(LAUNCH_DIR_ENV)
        # under `kiln launch`, a signal the launcher did not send is torchrun ending the ranks after a lost peer
        # (the launcher says so in one line) or a signal sent to this rank alone (the stop line says where)
        from_launcher = not folder or (Path(folder) / LAUNCHER_SIGNAL_FILE).exists()
        if self.trainer.world.main and from_launcher:  # os.write to fd 2: print() may not be re-entered here
            with contextlib.suppress(OSError):
                os.write(2, f"{self.signal} received: stopping after the step in flight "
                            f"(send it again to stop at once)\n".encode())

    # ---- the check between steps ------------------------------------------------------------------------
    def _own_reason(self) -> int:
        now = time.time()
        self.longest = max(self.longest, now - self._last)
        self._last = now
        if self.signal is not None:
            return _CODES[self.signal]
        if self.deadline is not None and now + 2 * self.longest >= self.deadline:
            return _CODES["max_time"]
        return 0

    def agreed(self) -> str | None:
        """Why every rank stops after this step (None: go on): one MAX all-reduce when distributed."""
        code = self._own_reason()
        world = self.trainer.world
        if world.active:
            device = self.trainer.device if dist.get_backend() == "nccl" else torch.device("cpu")
            t = torch.tensor([code], dtype=torch.int32, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            code = int(t.item())
        return _REASONS[code]

    def requested(self) -> bool:
        """After a step: True when the run stops here, its checkpoint written (unless train.stop_save = false)
        and the line said. A run that has just taken its last step is done, not stopped."""
        t = self.trainer
        if t.step >= t.total_steps or t.stopped_early:
            return False
        reason = self.agreed()
        if reason is None:
            return False
        saved = t.last_checkpoint is not None and t.last_checkpoint.name == ckpt.ckpt_name(t.step)
        if t.args.stop_save and not saved:
            t.save()
        t.stopped_by = reason
        if t.world.main:
            print(self.line(reason), flush=True)
        return True

    def line(self, reason: str) -> str:
        t = self.trainer
        why = f"train.max_time ({t.args.max_time})" if reason == "max_time" else reason
        if t.args.stop_save or (t.last_checkpoint is not None and t.last_checkpoint.name == ckpt.ckpt_name(t.step)):
            where = f"checkpoint {ckpt.ckpt_name(t.step)}"
        else:
            newest = t.last_checkpoint.name if t.last_checkpoint is not None else "none yet"
            where = f"no checkpoint written (train.stop_save = false; the newest is {newest})"
        return f"stopped by {why} at step {t.step}; {where}; resume with the same command and --resume"
