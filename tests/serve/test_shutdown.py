"""`kiln serve` as a process: SIGTERM while a request runs stops it within --shutdown-timeout: the request finishes or
is cancelled, and either way its stream ends well (a last chunk with its finish_reason, then [DONE]); the exit status
is 0 and the port is closed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

ROOT = Path(__file__).resolve().parents[2]
BOUND_S = 1.0
# after the bound: uvicorn's 0.1 s pause, cancelling the handlers, the lifespan's shutdown joining the engine thread
# (at most one engine step of a tiny model) and the interpreter's exit; 10 s leaves room for a loaded machine
SLACK_S = 10.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # a spawned server process (its start dominates)
def test_sigterm_stops_within_the_bound(served_dirs):
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "serve", str(served_dirs["model"]), "--name",
                             "tiny", "--port", str(port), "--max-tokens", "1000", "--shutdown-timeout", str(BOUND_S)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.communicate()[0]
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kiln serve did not come up"
            time.sleep(0.1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model="tiny", prompt="Once upon", max_tokens=1000, stream=True,
                                           temperature=1.0, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=BOUND_S + SLACK_S + 20)
        took = time.monotonic() - start
        assert proc.returncode == 0, out
        assert took <= BOUND_S + SLACK_S, f"took {took:.1f}s"
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]  # the rest arrives; the stream ends
        assert reasons and reasons[-1] in ("length", "cancelled") and not any(reasons[:-1]), reasons[-3:]
        with pytest.raises(httpx.TransportError):
            httpx.get(url + "/health", timeout=1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_draining_refuses_new_requests_and_cancels_running_ones_at_the_bound(served_dirs):
    """What SIGTERM starts, in process: /health says 503, a new request is a 503, and a running stream is cancelled
    at the bound and still ends well (finish_reason "cancelled", then [DONE])."""
    from kiln.cli.serve import build_state
    from tests.serve.helpers import LiveServer

    live = LiveServer(build_state(served_dirs["model"], [], name="tiny", max_tokens=1000))
    try:
        client = live.client()
        stream = client.completions.create(model="tiny", prompt="Once upon", max_tokens=1000, stream=True,
                                           temperature=1.0, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        live.state.engine.drain(0.3)
        health = httpx.get(live.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "stopping"
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="tiny", prompt="x", max_tokens=2)
        assert e.value.status_code == 503 and e.value.code == "shutting_down"
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert reasons[-1] == "cancelled" and len(reasons) < 1000 and not any(reasons[:-1])
    finally:
        live.stop()
