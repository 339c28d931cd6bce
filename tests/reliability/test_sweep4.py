"""The bad cases of the fourth fault sweep (issue 41), each held through the CLI or the server where the user meets
it: the message, the exit code or HTTP status, no traceback, nothing under the inputs changed. Before: a GRPO run whose
reward functions returned None for every completion warned, then ended "done" (exit 0) having learned nothing;
`[grpo] max_new_tokens = 100000` on a 64-position model was accepted and its truncation alarm advised raising it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.bad_inputs_world import write_toml
from tests.cli.reliability_world import run_cli, snapshot
from tests.train.train_helpers import write_sum_prompts

TINY = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "max_position_embeddings": 64,
        "pad_token_id": 0, "eos_token_id": 2}


@pytest.fixture(scope="module")
def grpo_inputs(tmp_path_factory) -> Path:
    return write_sum_prompts(tmp_path_factory.mktemp("grpo"), 4, {"rw.py": (
        "def nothing(prompts, completions, **columns):\n    return [None] * len(completions)\n\n"
        "def length(prompts, completion_ids, **columns):\n"
        "    return [float(len(c)) for c in completion_ids]\n")})


def grpo_config(d: Path, out: Path, reward: str, steps: int, **grpo) -> Path:
    return write_toml(d / f"{out.name}.toml", {
        "model": {"family": "qwen3", "task": "causal-lm", "tokenizer": "tok", "config": TINY},
        "data": {"train": "prompts.jsonl", "max_length": 32},
        "train": {"out_dir": out, "steps": steps, "batch_size": 2, "progress": False, "device": "cpu"},
        "grpo": {"rewards": [f"rw:{reward}"], "num_generations": 2, "max_new_tokens": 4, **grpo}})


@pytest.mark.parametrize("steps,stop", [(5, 3), (2, 2)])
def test_a_grpo_run_with_no_reward_at_all_is_refused(grpo_inputs, tmp_path, steps, stop):
    """Every reward None in the first 3 rollouts (or in all of a shorter run): stopped, exit 1, no checkpoint."""
    cfg = grpo_config(grpo_inputs, tmp_path / f"none{steps}", "nothing", steps)
    before = snapshot(grpo_inputs)
    code, out = run_cli("train", "--config", cfg)
    assert code == 1 and "Traceback" not in out, out
    assert ("[grpo] nothing can be learned: every reward function (nothing) returned None for every completion of "
            f"the first {stop} rollout(s) (up to step {stop})") in out, out
    assert "done:" not in out and out.count("alarm/none_rewards") == 1, out
    assert not list((tmp_path / f"none{steps}").glob("ckpt-*"))
    assert snapshot(grpo_inputs) == before


def test_a_grpo_run_with_rewards_counts_its_groups_with_signal(grpo_inputs, tmp_path):
    cfg = grpo_config(grpo_inputs, tmp_path / "scored", "length", 1)
    code, out = run_cli("train", "--config", cfg)
    assert code == 0 and "done: step 1" in out and "nothing can be learned" not in out, out
    rows = [json.loads(x) for x in (tmp_path / "scored" / "metrics.jsonl").read_text().splitlines()]
    assert any("groups_with_signal" in r for r in rows), rows


def test_grpo_max_new_tokens_past_the_model_positions_is_refused_before_any_work(grpo_inputs, tmp_path):
    cfg = grpo_config(grpo_inputs, tmp_path / "long", "length", 1, max_new_tokens=100000)
    before = snapshot(grpo_inputs)
    code, out = run_cli("train", "--config", cfg)
    assert code == 1 and "Traceback" not in out, out
    assert "grpo.max_new_tokens = 100000: the longest prompt (" in out, out
    assert "+ 100000 = " in out and "over the model's max_position_embeddings = 64; set grpo.max_new_tokens <=" in out
    assert not (tmp_path / "long").exists() and snapshot(grpo_inputs) == before


# ---- kiln serve ----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A live `kiln serve` (the command's own build_state) of a tiny untaught Qwen3 with a ChatML template; its
    request body limit 64 KB."""
    import shutil
    from importlib import resources

    from kiln.cli.serve import build_state
    from kiln.data.bpe import train_bpe
    from kiln.interop.tiny import make_tiny
    from tests.serve.helpers import LiveServer

    d = tmp_path_factory.mktemp("serve")
    (d / "text.txt").write_text("hello there\nhow are you today\nthe cat sat on the mat\n" * 10)
    train_bpe([d / "text.txt"], d / "tok", vocab_size=300, min_frequency=1)
    cfg = json.loads((d / "tok" / "tokenizer_config.json").read_text())
    cfg["chat_template"] = (resources.files("trl") / "chat_templates" / "qwen3.jinja").read_text()
    (d / "tok" / "tokenizer_config.json").write_text(json.dumps(cfg))
    model = make_tiny("qwen3", "causal-lm", d / "model", tokenizer=False, vocab_size=300, eos_token_id=2,
                      pad_token_id=0, max_position_embeddings=64)
    for f in (d / "tok").iterdir():
        shutil.copy(f, model / f.name)
    state = build_state(model, [], name="tiny", max_tokens=8)
    state.max_body = 64 * 1024
    server = LiveServer(state)
    yield server
    server.stop()


def post(server, path: str, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, json.loads(r.read())
    finally:
        conn.close()


def chat(messages: list, **kw) -> bytes:
    return json.dumps({"model": "tiny", "messages": messages, "max_tokens": 2, **kw}).encode()


def test_serve_answers_a_body_over_the_limit_with_413_naming_it(served):
    big = chat([{"role": "user", "content": "hello " * 20000}])  # ~120 KB, over the 64 KB limit
    status, body = post(served, "/v1/chat/completions", big)
    assert status == 413, body
    assert body["error"]["message"] == ("the request body is over this server's limit of 65536 bytes (0.0625 MB, "
                                        "kiln serve --max-body-mb)"), body
    status, body = post(served, "/v1/completions", json.dumps({"model": "tiny", "prompt": "hi " * 40000}).encode())
    assert status == 413 and body["error"]["code"] == "body_too_large", body
    status, body = post(served, "/v1/chat/completions", chat([{"role": "user", "content": "hello"}]))
    assert status == 200, body  # a body within the limit is served


def test_serve_health_answers_while_a_long_prompt_is_tokenized(served, monkeypatch):
    """The chat template is rendered and tokenized in a thread: a request whose rendering takes long (here held
    on an event, so the test knows it is in flight) does not stall /health."""
    import threading
    import urllib.request

    import kiln.serve.app as app

    started, release = threading.Event(), threading.Event()
    real = app._chat_ids

    def held(*a, **kw):
        started.set()
        assert release.wait(60)
        return real(*a, **kw)

    monkeypatch.setattr(app, "_chat_ids", held)
    got: list = []
    t = threading.Thread(target=lambda: got.append(post(served, "/v1/chat/completions",
                                                        chat([{"role": "user", "content": "hello"}]))))
    t.start()
    try:
        assert started.wait(60)
        with urllib.request.urlopen(served.url + "/health", timeout=30) as r:  # answered while rendering is held
            assert r.status == 200 and json.loads(r.read())["status"] == "ok"
    finally:
        release.set()
        t.join(60)
    assert got and got[0][0] == 200, got


@pytest.mark.parametrize("field,value,says", [
    ("temperature", float("nan"), "temperature: Input should be a finite number"),
    ("top_p", float("inf"), "top_p: Input should be a finite number")])
def test_serve_a_non_finite_sampling_value_is_told_it_must_be_finite(served, field, value, says):
    status, body = post(served, "/v1/chat/completions", chat([{"role": "user", "content": "hi"}], **{field: value}))
    assert status == 400 and body["error"]["message"] == says and body["error"]["param"] == field, body


def test_serve_a_user_message_with_null_content_is_refused_naming_it(served):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": None}]
    status, body = post(served, "/v1/chat/completions", chat(msgs))
    assert status == 400 and body["error"]["param"] == "messages.1.content", body
    assert "messages.1.content: a user message needs content" in body["error"]["message"], body
    # an assistant message carrying only tool calls has null content, as OpenAI's clients send it back
    ok = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}, {"role": "user", "content": "x"}]
    assert post(served, "/v1/chat/completions", chat(ok))[0] == 200


def test_serve_a_client_that_leaves_during_the_upload_is_one_line(served, capfd):
    import socket
    import time

    s = socket.create_connection(("127.0.0.1", served.port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 50000\r\n\r\n" + b'{"model": "tiny", "messages": [' + b" " * 1000)
    time.sleep(0.5)
    s.close()
    deadline = time.monotonic() + 30
    err = ""
    while "the client left during the upload" not in err and time.monotonic() < deadline:
        time.sleep(0.1)
        err += capfd.readouterr().err
    assert "kiln serve: POST /v1/chat/completions: the client left during the upload" in err, err
    assert "Traceback" not in err and "ClientDisconnect" not in err, err
    assert post(served, "/v1/chat/completions", chat([{"role": "user", "content": "hi"}]))[0] == 200


def test_serve_on_a_taken_port_names_it_and_says_no_serving_line(tmp_path):
    import socket
    import subprocess
    import sys

    from tests.kiln_cli import REPO

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "kiln.cli.main", "serve", str(tmp_path / "m"), "--port",
                               str(port)], capture_output=True, text=True, cwd=REPO, timeout=300,
                              env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode == 1 and "Traceback" not in out, out
    assert f"cannot serve on 127.0.0.1:{port}: Address already in use" in out and "http://" not in out, out
    assert list(tmp_path.iterdir()) == []


def test_a_sigterm_while_kiln_train_starts_exits_75_and_writes_nothing(grpo_inputs, tmp_path):
    """Before: the signal came before the trainer's handlers, so the process died by it (143) without a word. A
    reward module that sleeps on import holds the run in its startup, where the signal is sent."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.kiln_cli import REPO

    marker = tmp_path / "importing"
    (grpo_inputs / "slow_rw.py").write_text(f"import pathlib, time\npathlib.Path({str(marker)!r}).touch()\n"
                                            "time.sleep(120)\n\ndef r(prompts, completions, **c):\n"
                                            "    return [0.0] * len(completions)\n")
    cfg = grpo_config(grpo_inputs, tmp_path / "early", "r", 2)
    cfg.write_text(cfg.read_text().replace('"rw:r"', '"slow_rw:r"'))
    before = snapshot(grpo_inputs)
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "train", "--config", str(cfg)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
                                 "PYTHONDONTWRITEBYTECODE": "1"})  # Python's own cache of the reward module
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGTERM)
        out = " ".join(proc.communicate(timeout=60)[0].split())
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75 and "Traceback" not in out, (proc.returncode, out)
    assert ("stopped by SIGTERM before the first step; no checkpoint was written: run the same command again "
            "(without --resume)") in out, out
    assert not (tmp_path / "early").exists() or not list((tmp_path / "early").glob("ckpt-*"))
    assert snapshot(grpo_inputs) == before
