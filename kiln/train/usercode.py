"""Calling user code (reward functions, environments, tools) so that it cannot hang or kill a run.

`call_user` runs the call in a daemon thread and waits in short joins: past its timeout the call is abandoned
(UserTimeout); once the run is told to stop (kiln.train.preempt caught SIGTERM / SIGINT), a call still running
STOP_GRACE seconds later is abandoned too (Abandoned), so the step in flight ends and the stop's checkpoint is
written within a scheduler's grace period. A thread cannot be stopped: an abandoned one is left running, and as a
daemon it never holds the process open. What the call raises comes back as a UserCodeError naming it.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kiln.errors import KilnError
from kiln.train import preempt

_POLL = 0.05      # seconds between looks at the stop flag while user code runs
STOP_GRACE = 2.0  # seconds a call may still run once the run is stopping, before it is abandoned


class UserCodeError(KilnError):
    """User code raised, did not return in time, or returned something malformed."""


class UserTimeout(UserCodeError):
    """User code did not return within its timeout; it was abandoned."""


class Abandoned(UserCodeError):
    """User code was abandoned while still running because the run is stopping (SIGTERM / SIGINT)."""


def call_user(fn: Callable[..., Any], *args: Any, timeout: float, what: str, key: str = "grpo.env_timeout",
              **kwargs: Any) -> Any:
    """fn(*args, **kwargs) (awaited when it returns a coroutine) in a daemon thread, within `timeout` seconds
    (`key`: the setting, for the message), abandoned on a stop as the module says."""
    box: dict[str, Any] = {}
    grad = torch.is_grad_enabled()  # thread-local: the worker computes as the caller would

    def run() -> None:
        try:
            with torch.set_grad_enabled(grad):
                out = fn(*args, **kwargs)
                if inspect.isawaitable(out):
                    out = asyncio.run(_awaited(out))
            box["value"] = out
        except BaseException as e:  # noqa: BLE001  (user code: everything it raises is the call's failure)
            box["error"] = e

    worker = threading.Thread(target=run, name=f"kiln-user:{what}", daemon=True)
    worker.start()
    deadline, stop_by = time.monotonic() + timeout, None
    while worker.is_alive():  # short joins: the stop flag is seen within _POLL, whatever the timeout
        now = time.monotonic()
        if now >= deadline:
            raise UserTimeout(f"{what} did not return within {timeout:g} s ({key})")
        caught = preempt.signalled()
        if caught is not None:  # a call that ends within STOP_GRACE keeps its result: the step stays exact
            stop_by = now + STOP_GRACE if stop_by is None else stop_by
            if now >= stop_by:
                raise Abandoned(f"{what} was abandoned: still running {STOP_GRACE:g} s after the run was told to "
                                f"stop ({caught})")
        worker.join(min(deadline - now, _POLL))
    if "error" in box:
        e = box["error"]
        raise UserCodeError(f"{what} raised {type(e).__name__}: {e}") from e
    return box.get("value")


async def _awaited(x: Any) -> Any:
    return await x
