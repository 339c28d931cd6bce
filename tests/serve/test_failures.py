"""The server when things go wrong: a streaming client gone before the first byte frees its slot and cancels its
request; a step that raises fails its requests with a 500 naming the cause and the engine is replaced by a fresh one
(/health says so); a submit racing the engine thread's exit is refused, never left waiting."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from kiln.engine.params import SamplingParams
from kiln.serve.async_engine import AsyncEngine, EngineStopped


@pytest.fixture
def state(served_dirs):
    from kiln.cli.serve import build_state

    state = build_state(served_dirs["model"], [], name="tiny", max_tokens=1000, max_queue=2)
    state.engine.start()
    yield state
    assert state.engine.stop(30)


def _wait(condition, what: str, bound_s: float = 30.0) -> None:
    deadline = time.monotonic() + bound_s
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {bound_s}s"
        time.sleep(0.02)


def _scope(path: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json")], "client": ("127.0.0.1", 9),
            "server": ("127.0.0.1", 80)}


def test_a_stream_whose_client_is_gone_before_the_first_send_frees_its_slot(state):
    """The response's first send fails (the socket is closed): the events generator never starts, yet the request is
    cancelled and its slot freed."""
    from kiln.serve.app import build_app

    app = build_app(state)
    body = json.dumps({"model": "tiny", "prompt": "Once upon", "max_tokens": 1000, "stream": True,
                       "ignore_eos": True}).encode()

    async def call() -> None:
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            if messages:
                return messages.pop(0)
            await asyncio.Event().wait()  # the connection says nothing more

        async def send(message):
            raise OSError("the client closed the connection")

        try:
            await app(_scope("/v1/completions"), receive, send)
        except Exception:  # noqa: BLE001 - Starlette re-raises the disconnect; what matters is what is left held
            pass

    asyncio.run(call())
    engine = state.engine.engines["tiny"]
    assert state.engine.held == 0
    _wait(lambda: not engine.has_unfinished(), "the abandoned request was cancelled")
    assert engine.tokens_fed < 500  # cancelled, not run to its 1,000 tokens


def test_a_failed_step_is_a_500_naming_the_cause_and_the_engine_is_rebuilt(state):
    from kiln.serve.app import build_app

    broken = state.engine.engines["tiny"]

    def fail():
        raise RuntimeError("injected step fault")

    broken.step = fail  # the next step raises, as a kernel or a bookkeeping error would

    async def calls():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://kiln") as client:
            request = {"model": "tiny", "prompt": "Once upon", "max_tokens": 4}
            failed = await client.post("/v1/completions", json=request)
            health = await client.get("/health")
            after = await client.post("/v1/completions", json=request)
            return failed, health, after

    failed, health, after = asyncio.run(calls())
    assert failed.status_code == 500, failed.text
    error = failed.json()["error"]
    assert error["code"] == "engine_error" and "RuntimeError: injected step fault" in error["message"]
    assert health.status_code == 200
    assert health.json()["status"] == "degraded" and health.json()["engine_rebuilds"] == {"tiny": 1}
    assert "injected step fault" in health.json()["last_engine_failure"]
    assert state.engine.engines["tiny"] is not broken
    # the rebuilt engine answers (greedy text may end on the model's end token or at max_tokens)
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] in ("length", "stop"), after.text
    assert state.engine.held == 0


def test_submit_after_the_thread_ended_is_refused_not_left_waiting(state, monkeypatch):
    """The race: `alive` was read just before the thread ended (shutdown); the add must not wait forever on a
    thread whose final drain is over."""
    engine = state.engine
    assert engine.stop(30)
    monkeypatch.setattr(AsyncEngine, "alive", property(lambda self: True))  # the stale read of the race

    async def submit():
        return await asyncio.wait_for(engine.submit("tiny", [[5, 6, 7]], SamplingParams(max_tokens=2)), 5.0)

    with pytest.raises(EngineStopped):
        asyncio.run(submit())
    assert engine.held == 0
