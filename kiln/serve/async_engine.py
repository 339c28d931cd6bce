"""The bridge between the single-threaded Engine and the asyncio server: one background thread owns the engines
(one per served model name), drives their step() and hands each step's outputs to the waiting requests' asyncio
queues.

Handlers never touch an engine: they put commands (add, cancel, cancel_all, stop) into an inbox the thread drains
between steps.
A request holds a slot from `submit` until its Stream is closed (the HTTP response is over, or the client left), so
`max_queue` bounds what is queued and running together; past it `submit` raises QueueFull (429). Engines of several
models are stepped in turn; since a request's tokens depend only on its own inputs (the engine's batch invariance),
the interleaving changes no result.

When a step raises, the engine may be left inconsistent (blocks lent to no sequence), so its model's requests fail
(EngineFailed, naming the cause) and the thread replaces it with a fresh Engine from the same factory (same model and
settings); `rebuilds` counts these per model for /health.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.engine.engine import Engine

IDLE_WAIT_S = 0.05  # how long the idle thread sleeps between looks at its inbox (a submit wakes it at once)


class QueueFull(Exception):
    """The server holds `max_queue` requests already."""


class EngineStopped(Exception):
    """The engine thread is stopping or has stopped; no new request is taken."""


class EngineFailed(Exception):
    """A step raised (or adding the request did, not for the request's sake): the request cannot go on."""


class ClientGone(Exception):
    """The client left before the answer was ready; the request was cancelled."""


class RequestRefused(Exception):
    """The engine refused the request as given (KilnError from add_request: too many blocks, n > max_seqs, ...)."""


@dataclass
class _Request:
    model: str
    ids: list[str]          # engine request ids, one per prompt
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    remaining: int          # completions not yet finished (prompts x n)
    added: asyncio.Future   # set when the engine took every prompt (or failed with why it did not)
    done: set = field(default_factory=set)  # (engine request id, completion index) of the finished completions
    index_of: dict[str, int] = field(default_factory=dict)  # engine request id -> prompt index


class Stream:
    """One submitted request's outputs, as (prompt index, RequestOutput) in the order the engine made them. Ends when
    every completion of every prompt has finished; raises EngineFailed if the engine could not go on. Close it when
    the response is over: an unfinished request is cancelled and its slot freed."""

    def __init__(self, owner: AsyncEngine, request: _Request):
        self._owner, self._request, self._closed = owner, request, False
        self.finished = False

    def __aiter__(self) -> AsyncIterator[tuple[int, Any]]:
        return self._iterate()

    async def _iterate(self):
        while not self.finished:
            item = await self._request.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item is None:  # every completion finished
                self.finished = True
                return
            yield item

    def abandon(self) -> None:
        """The client left: cancel the request and end the iteration (with ClientGone). Call from the event loop."""
        if not self._closed:
            self.close()
            self._request.queue.put_nowait(ClientGone("the client closed the connection"))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            self._owner._command(("cancel", self._request))
        self._owner._release(len(self._request.ids))


class AsyncEngine:
    """`factories` maps each served model name to a function making its Engine: called once here, and again to
    replace an engine whose step raised."""

    def __init__(self, factories: Mapping[str, Callable[[], Engine]], max_queue: int):
        if max_queue < 1:
            raise KilnError(f"--max-queue must be >= 1, got {max_queue}")
        self._factories = dict(factories)
        self.engines = {name: make() for name, make in self._factories.items()}
        self.rebuilds: dict[str, int] = dict.fromkeys(self.engines, 0)  # engines replaced after a failed step
        self.last_failure: str | None = None  # the cause of the latest failed step, for /health
        self._closed = False  # the thread's final drain has begun: no command put from now on would be read
        self.max_queue = max_queue
        self._lock = threading.Lock()
        self._held = 0                         # slots held by open Streams
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._requests: dict[str, _Request] = {}  # engine request id -> its request (engine thread only)
        self._stopping = False
        self._draining = False
        self._counter = itertools.count()
        self._thread = threading.Thread(target=self._run, name="kiln-engine", daemon=True)
        self.failure: BaseException | None = None  # what stopped the thread, if it died

    # ---- the asyncio side --------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        """Taking requests: the thread runs and no shutdown has begun."""
        return self._thread.is_alive() and not self._stopping and not self._draining

    def drain(self, bound_s: float) -> None:
        """Shutdown's first half: take no new request; those running may finish within `bound_s` seconds, then
        each is cancelled (its completions end with finish_reason "cancelled", so every answer still ends well)."""
        if self._draining:
            return
        self._draining = True
        timer = threading.Timer(bound_s, self._command, (("cancel_all",),))
        timer.daemon = True
        timer.start()

    @property
    def held(self) -> int:
        return self._held

    async def submit(self, model: str, prompts: list[list[int]], params: Any,
                     prompt_inputs: dict | None = None) -> Stream:
        """Queue `prompts` (each with `params`) on the engine of `model`, once the engine has taken them (so a
        request it refuses is refused before any answer starts): RequestRefused, QueueFull, EngineStopped."""
        if not self.alive:
            raise EngineStopped("the server is shutting down")
        with self._lock:
            if self._closed:  # the thread ended after the check above: its final drain would never see the add
                raise EngineStopped("the server is shutting down")
            if self._held + len(prompts) > self.max_queue:
                raise QueueFull(f"the server holds {self._held} of its {self.max_queue} requests (--max-queue); "
                                "retry later")
            self._held += len(prompts)
        tag = f"{uuid.uuid4().hex[:12]}-{next(self._counter)}"
        ids = [f"{tag}-{i}" for i in range(len(prompts))]
        loop = asyncio.get_running_loop()
        request = _Request(model, ids, loop, asyncio.Queue(), remaining=len(prompts) * params.n,
                           added=loop.create_future(), index_of={rid: i for i, rid in enumerate(ids)})
        stream = Stream(self, request)
        with self._lock:  # put under the lock: either the final drain reads it, or _closed refuses it
            closed = self._closed
            if not closed:
                self._command(("add", request, prompts, params, prompt_inputs))
        if closed:
            stream.close()
            raise EngineStopped("the server is shutting down")
        try:
            await asyncio.shield(request.added)
        except BaseException:  # refused, or the client left while waiting: nothing stays held
            stream.close()
            raise
        return stream

    def stop(self, timeout: float) -> bool:
        """Cancel what is left and end the thread; True if it ended within `timeout` seconds."""
        self._stopping = True
        self._command(("stop",))
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _command(self, command: tuple) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _release(self, n: int) -> None:
        with self._lock:
            self._held -= n

    # ---- the engine thread -------------------------------------------------------------------------------------
    def _send(self, request: _Request, item: Any) -> None:
        try:
            request.loop.call_soon_threadsafe(request.queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _settle(self, request: _Request, error: BaseException | None) -> None:
        def settle():
            if not request.added.done():
                request.added.set_result(None) if error is None else request.added.set_exception(error)
        try:
            request.loop.call_soon_threadsafe(settle)
        except RuntimeError:
            pass

    def _drop(self, request: _Request) -> None:
        for rid in request.ids:
            self._requests.pop(rid, None)

    def _drain(self) -> bool:
        """Run the inbox's commands; False once told to stop."""
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return True
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "cancel_all":  # the engines report each as finished ("cancelled"), delivered as usual
                for rid, request in list(self._requests.items()):
                    self.engines[request.model].cancel(rid)
                continue
            request = command[1]
            engine = self.engines[request.model]
            if kind == "add":
                _, _, prompts, params, inputs = command
                try:
                    for rid, prompt in zip(request.ids, prompts):
                        engine.add_request(prompt, params, request_id=rid, prompt_inputs=inputs)
                        self._requests[rid] = request
                except KilnError as e:
                    self._cancel(request)
                    self._settle(request, RequestRefused(str(e)))
                except Exception as e:  # noqa: BLE001 - the request fails, the server goes on
                    self._cancel(request)
                    self._settle(request, EngineFailed(f"{type(e).__name__}: {e}"))
                else:
                    self._settle(request, None)
            elif kind == "cancel":
                self._cancel(request)

    def _cancel(self, request: _Request) -> None:
        engine = self.engines[request.model]
        for rid in request.ids:
            if self._requests.pop(rid, None) is not None:
                engine.cancel(rid)

    def _deliver(self, out: Any) -> None:
        request = self._requests.get(out.request_id)
        if request is None:  # cancelled meanwhile
            return
        key = (out.request_id, out.index)
        if key in request.done:  # a cancel reports every completion, the finished ones too
            return
        self._send(request, (request.index_of[out.request_id], out))
        if out.finished:
            request.done.add(key)
            request.remaining -= 1
            if request.remaining == 0:
                self._drop(request)
                self._send(request, None)

    def _step(self, name: str, engine: Any) -> bool:
        if not engine.has_unfinished():
            return False
        try:
            outputs = engine.step()
        except Exception as e:  # noqa: BLE001 - this model's requests fail; the others go on
            cause = f"{type(e).__name__}: {e}"
            failed = {id(r): r for r in self._requests.values() if r.model == name}
            for request in failed.values():
                self._drop(request)  # not cancelled on the broken engine: it is replaced below
            self.last_failure = f"{name}: {cause}"
            try:  # replaced before the requests hear of it, so a client that then asks /health sees the rebuild
                self._rebuild(name)
            finally:
                for request in failed.values():
                    self._send(request, EngineFailed(f"the engine failed: {cause}"))
            return False
        for out in outputs:
            self._deliver(out)
        return True

    def _rebuild(self, name: str) -> None:
        """Replace the engine of `name` by a fresh one (its failed step may have left blocks lent to nobody).
        If even that fails the thread ends (failure, /health 503): there is no engine left to serve it."""
        # drop the broken one (and its KV pool) before allocating the new; the key stays (the loop iterates the dict)
        self.engines[name] = None  # type: ignore[assignment]
        self.engines[name] = self._factories[name]()
        self.rebuilds[name] += 1

    def _run(self) -> None:
        try:
            while True:
                self._wake.clear()
                if not self._drain():
                    break
                busy = False
                for name, engine in self.engines.items():
                    busy = self._step(name, engine) or busy
                if not busy:
                    self._wake.wait(IDLE_WAIT_S)
        except BaseException as e:  # noqa: BLE001 - recorded for /health; the requests are told below
            self.failure = e
        finally:
            self._stopping = True
            with self._lock:
                self._closed = True
            for request in {id(r): r for r in self._requests.values()}.values():
                try:
                    self._cancel(request)
                except Exception:  # noqa: BLE001 - stopping anyway
                    pass
                self._send(request, EngineStopped("the server stopped before this request finished"))
            self._requests.clear()
            while True:  # requests added after the last drain never reached an engine
                try:
                    command = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if command[0] == "add":
                    self._settle(command[1], EngineStopped("the server stopped before this request started"))
