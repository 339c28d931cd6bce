"""What the server tests share: the tiny chat the model is taught (tools, question, call, answer) and a live
`kiln serve` application under uvicorn in a thread."""

from __future__ import annotations

import threading
import time

TOOLS = [{"type": "function", "function": {
    "name": "weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
QUESTION = "Weather in Paris?"
CALL_TEXT = '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ANSWER = "It is 18 degrees."
RESULT = '{"temp": 18}'
VOCAB = 512


def conversations() -> list[tuple[list[dict], str]]:
    """(messages, the reply the model is taught) for both turns of the round trip."""
    first = [{"role": "user", "content": QUESTION}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]}
    second = first + [call, {"role": "tool", "content": RESULT}]
    return [(first, CALL_TEXT + "<|im_end|>"), (second, ANSWER + "<|im_end|>")]


class LiveServer:
    """`kiln serve`'s application (built by the command's own build_state) under uvicorn in a thread."""

    def __init__(self, state, stop_timeout: float = 10.0):
        import uvicorn

        from kiln.serve.app import build_app

        self.state = state
        config = uvicorn.Config(build_app(state, stop_timeout), host="127.0.0.1", port=0, log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60, **kw)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()
