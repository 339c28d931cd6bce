"""The official `openai` client against a live `kiln serve` (tests/serve/conftest.py): chat, streaming, tool calls
out of the model and back, log-probs (equal to the training forward's), n > 1, errors naming the field, a full queue,
greedy output equal to `kiln generate`'s, LoRA adapters by name."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import torch
from typer.testing import CliRunner

from kiln.cli.main import app
from tests.serve.helpers import ANSWER, QUESTION, RESULT, TOOLS

USER = [{"role": "user", "content": QUESTION}]
# a float32 log-prob computed by two kernel orders differs by a few ulps of its summands (|logit| < 50 here)
LOGPROB_TOL = 1e-4


def _generate(model_dir, prompt: str, n: int) -> str:
    r = CliRunner().invoke(app, ["generate", str(model_dir), prompt, "-n", str(n)])
    assert r.exit_code == 0, r.output
    assert r.output.endswith("\n")
    return r.output[:-1]  # the line end out.print adds


def test_health_and_models(live):
    r = httpx.get(live.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    models = live.client().models.list()
    assert [m.id for m in models.data] == ["tiny", "ad"]
    assert httpx.get(live.url + "/v1/nothing").json()["error"]["type"] == "not_found_error"


def test_greedy_completion_equals_kiln_generate(live, served_dirs):
    client = live.client()
    for prompt in ("The quick brown", "Once upon"):
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        assert got.choices[0].finish_reason in ("stop", "length")
        assert prompt + got.choices[0].text == _generate(served_dirs["model"], prompt, 12)
        assert got.usage.completion_tokens <= 12


def test_chat_tool_call_round_trip(live):
    client = live.client()
    first = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0, max_tokens=40)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert "<tool_call>" not in (choice.message.content or "")
    history = USER + [choice.message.model_dump(),  # as it came, None fields and all
                      {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    second = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, temperature=0, max_tokens=20)
    assert second.choices[0].message.content == ANSWER and second.choices[0].finish_reason == "stop"
    # without tools offered the same text stays text
    plain = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=40)
    assert not plain.choices[0].message.tool_calls


def test_streaming_matches_whole_answer(live):
    client = live.client()
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Once upon a time"}], temperature=0, max_tokens=16)
    whole = client.chat.completions.create(**kw)
    pieces, finish, usage = [], None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(pieces) == whole.choices[0].message.content and finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    # a streamed tool call: no markup in the text deltas, the call in a tool_calls delta
    text, calls, finish = "", [], None
    for chunk in client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, temperature=0,
                                                max_tokens=40, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert "<tool_call>" not in text and finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("weather", {"city": "Paris"})]


def test_logprobs_are_the_training_forward_s(live, served_dirs):
    from kiln.data.sft import chat_prompt_ids
    from kiln.models.auto import load_pretrained

    got = live.client().chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=10,
                                                logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == got.usage.completion_tokens and all(len(e.top_logprobs) == 3 for e in content)
    for e in content:  # greedy: the chosen token is the most likely one
        assert e.token == e.top_logprobs[0].token and e.logprob == e.top_logprobs[0].logprob
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    model = load_pretrained(served_dirs["model"], task="causal-lm")
    prompt = chat_prompt_ids(model.tokenizer, USER, None)
    ids = model.tokenizer.backend.encode("".join(e.token for e in content), add_special_tokens=False).ids
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    expect = logits.log_softmax(-1).gather(1, torch.tensor(ids)[:, None])[:, 0]
    assert len(ids) == len(content)
    assert max(abs(e.logprob - float(x)) for e, x in zip(content, expect)) <= LOGPROB_TOL
    legacy = live.client().completions.create(model="tiny", prompt="Once upon", max_tokens=5, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == legacy.choices[0].text and lp.text_offset[0] == 0


def test_n_completions(live):
    client = live.client()
    kw = dict(model="tiny", messages=[{"role": "user", "content": "fox"}], temperature=1.0, max_tokens=12, seed=7)
    a = client.chat.completions.create(n=3, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    texts = [c.message.content for c in a.choices]
    assert len(set(texts)) > 1, texts  # each completion draws its own tokens
    assert [c.message.content for c in client.chat.completions.create(n=3, **kw).choices] == texts  # the seed holds
    streamed = {}
    for chunk in client.chat.completions.create(n=3, stream=True, **kw):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == texts
    many = client.completions.create(model="tiny", prompt=["Once upon", "The quick"], n=2, max_tokens=4,
                                     temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2, 3] and many.choices[0].text == many.choices[1].text


def test_bad_requests_name_the_field(live):
    client = live.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, temperature=5)
    assert e.value.status_code == 400 and e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=USER, max_tokens=100_000)
    assert e.value.param == "max_tokens" and "--max-tokens" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}])
    assert e.value.param == "messages.0.role"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=[5, 99999])
    assert e.value.param == "prompt" and "vocabulary" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # more prompts than the queue holds: never servable
        client.completions.create(model="tiny", prompt=["a", "b", "c", "d"], max_tokens=2)
    assert e.value.param == "prompt" and "--max-queue" in e.value.message
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="nope", messages=USER)
    assert e.value.param == "model" and "tiny" in e.value.message
    r = httpx.post(live.url + "/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and "not JSON" in r.json()["error"]["message"]


def test_full_queue_is_429_and_a_closed_stream_frees_its_slot(live):
    """max_queue is 3: three long streams hold every slot; a fourth request is refused; closing the streams (the client
    leaves) cancels them and frees the slots."""
    client = live.client()
    kw = dict(model="tiny", prompt="Once upon", max_tokens=400, temperature=1.0, stream=True,
              extra_body={"ignore_eos": True})
    streams = [client.completions.create(**kw) for _ in range(3)]
    for s in streams:
        next(iter(s))  # each is running
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2)
    assert e.value.status_code == 429 and e.value.code == "queue_full"
    for s in streams:
        s.close()
    deadline = time.monotonic() + 30
    while httpx.get(live.url + "/health").json()["requests"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(live.url + "/health").json()["requests"] == 0
    assert client.completions.create(model="tiny", prompt="x", max_tokens=2).choices[0].finish_reason


def test_a_client_that_leaves_cancels_its_request(live):
    """A non-streamed request whose client gives up is cancelled: the engine runs far fewer than its 1,000 tokens
    (one engine step of even this tiny model costs over a millisecond, so 1,000 take over a second; the client leaves
    after 0.2 s and the server looks every 0.1 s)."""
    engine = live.state.engine.engines["tiny"]
    fed = engine.tokens_fed
    with pytest.raises(httpx.TimeoutException):
        httpx.post(live.url + "/v1/completions", timeout=0.2, json={"model": "tiny", "prompt": "Once upon",
                                                                   "max_tokens": 1000, "ignore_eos": True})
    deadline = time.monotonic() + 30
    while live.state.engine.held and time.monotonic() < deadline:
        time.sleep(0.02)
    assert live.state.engine.held == 0
    assert engine.tokens_fed - fed < 500


def test_lora_adapter_by_name(live, served_dirs):
    """Requests naming the adapter get what the base + adapter gives through `kiln generate`; the base is unchanged;
    both served at once give what each gives alone."""
    client = live.client()
    prompt = "The quick brown"
    alone = {m: client.completions.create(model=m, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
             for m in ("tiny", "ad")}
    assert prompt + alone["ad"] == _generate(served_dirs["with_adapter"], prompt, 12)
    assert prompt + alone["tiny"] == _generate(served_dirs["model"], prompt, 12)
    assert alone["ad"] != alone["tiny"]  # the adapter changes the output (else the test above shows nothing)
    together, errors = {}, []

    def ask(m):
        try:
            together[m] = client.completions.create(model=m, prompt=prompt, max_tokens=12,
                                                    temperature=0).choices[0].text
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=ask, args=(m,)) for m in ("tiny", "ad")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and together == alone


def test_stop_strings_cut_the_text(live):
    client = live.client()
    full = client.completions.create(model="tiny", prompt="Once upon", max_tokens=12, temperature=0).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop.strip(), full  # a stop string that is not only blanks (so the greedy text does hold it)
    cut = client.completions.create(model="tiny", prompt="Once upon", max_tokens=12, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Once upon", max_tokens=12, temperature=0, stop=stop, stream=True) if c.choices)
    assert streamed == cut.choices[0].text
    echo = client.completions.create(model="tiny", prompt="Once upon", max_tokens=12, temperature=0, echo=True)
    assert echo.choices[0].text == "Once upon" + full


def test_a_run_serves_its_newest_checkpoint_and_a_checkpoint_itself(served_dirs, tmp_path):
    import shutil

    from kiln.cli.serve import build_state

    run = tmp_path / "run"
    shutil.copytree(served_dirs["model"], run / "ckpt-000001" / "model")
    shutil.copytree(served_dirs["with_adapter"], run / "ckpt-000002" / "model")  # the newest carries the adapter
    newest = build_state(run, [], name="m").engine.engines["m"].model
    first = build_state(run / "ckpt-000001", [], name="m").engine.engines["m"].model
    assert getattr(newest, "lora_config", None) is not None and getattr(first, "lora_config", None) is None


def test_logprob_bytes_join_up_to_the_text(served_dirs):
    """A byte-level BPE splits a multi-byte character over tokens whose own text is U+FFFD; their `bytes` are the
    real ones, so the bytes of all tokens are the text's UTF-8. Control: the tokens' text does not give it back."""
    from kiln.hub import Tokenizer
    from kiln.serve.results import token_bytes, token_text

    tok = Tokenizer.from_dir(served_dirs["model"])
    text = "Paris: 18° 🙂 日本 <|im_end|>"
    ids = tok.backend.encode(text, add_special_tokens=False).ids
    pieces = [token_text(tok, t) for t in ids]
    assert b"".join(bytes(token_bytes(tok, t, p)) for t, p in zip(ids, pieces)) == text.encode("utf-8")
    assert "".join(pieces) != text  # some character was split (else the test shows nothing)
