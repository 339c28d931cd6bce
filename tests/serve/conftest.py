"""A tiny Qwen3 for the server tests (a real BPE tokenizer and Qwen3's chat template, which renders tools) that was
taught, by a few hundred optimizer steps, to answer the weather question with a tool call and the tool's result with
a sentence: so tool calls come out of the model itself, not from a script. A LoRA adapter over it (random, so it
changes the output), and a live `kiln serve` of both in a thread on a free loopback port."""

from __future__ import annotations

import json
import shutil
import threading
import time
from importlib import resources
from pathlib import Path

import pytest
import torch

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


def _teach(model, examples: list[tuple[list[int], list[int]]], steps: int = 400) -> None:
    """Fit the replies (teacher forcing) until every reply token is the argmax after its prefix: greedy decoding
    then reproduces them exactly."""
    torch.manual_seed(0)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for step in range(steps):
        loss, ok = 0.0, True
        for prompt, reply in examples:
            ids = torch.tensor([prompt + reply])
            logits = model(input_ids=ids[:, :-1]).logits[0, len(prompt) - 1:]  # (len(reply), V)
            target = torch.tensor(reply)
            loss = loss + torch.nn.functional.cross_entropy(logits.float(), target)
            ok = ok and bool((logits.argmax(-1) == target).all()) and \
                bool((logits.log_softmax(-1).gather(1, target[:, None]) > -0.05).all())  # a clear margin
        if ok:
            break
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    print("taught in", step, "steps", [len(p) for p, _ in examples])
    assert ok, f"the tiny model did not learn the replies in {steps} steps"


@pytest.fixture(scope="session")
def served_dirs(tmp_path_factory):
    """{"model": the taught base, "adapter": a LoRA adapter over it, "with_adapter": base + adapter in one
    directory (as a kiln LoRA checkpoint holds them, for `kiln generate`)}."""
    from kiln.data.bpe import train_bpe
    from kiln.data.sft import chat_prompt_ids
    from kiln.hub.chat import ChatTemplate
    from kiln.hub import Tokenizer
    from kiln.models.auto import AutoConfig, from_config, load_pretrained
    from kiln.models.common.lora import LoraConfig, apply_lora, save_adapter
    from kiln.models.tasks import CAUSAL_LM

    d = tmp_path_factory.mktemp("serve")
    template = (resources.files("trl") / "chat_templates" / "qwen3.jinja").read_text()
    # the rendered conversations are in the tokenizer's text, so their prompts are short (fast to teach)
    rendered = [ChatTemplate(template).render(m, add_generation_prompt=True, tools=TOOLS) + r
                for m, r in conversations()]
    text = [QUESTION, CALL_TEXT, ANSWER, RESULT, "The quick brown fox jumps over the lazy dog.", "Once upon a time"]
    (d / "text.txt").write_text("\n".join(text * 3 + rendered * 3) + "\n")
    train_bpe([d / "text.txt"], d / "tok", vocab_size=VOCAB, min_frequency=1)
    cfg = json.loads((d / "tok" / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tok" / "tokenizer_config.json").write_text(json.dumps(cfg))
    config = AutoConfig.for_model("qwen3", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=1024, pad_token_id=0, eos_token_id=2)
    model = from_config(config, task=CAUSAL_LM, seed=0)
    model.tokenizer = tok = Tokenizer.from_dir(d / "tok")
    examples = [(chat_prompt_ids(tok, msgs, TOOLS), tok.backend.encode(reply, add_special_tokens=False).ids)
                for msgs, reply in conversations()]
    _teach(model, examples)
    model.save_pretrained(d / "model")

    lora = load_pretrained(d / "model", task=CAUSAL_LM)
    apply_lora(lora, LoraConfig(r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"]))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    save_adapter(lora, d / "adapter")
    shutil.copytree(d / "model", d / "with_adapter")
    for f in (d / "adapter").iterdir():
        shutil.copy(f, d / "with_adapter" / f.name)
    return {"model": d / "model", "adapter": d / "adapter", "with_adapter": d / "with_adapter"}


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


@pytest.fixture(scope="module")
def live(served_dirs):
    from kiln.cli.serve import build_state

    state = build_state(served_dirs["model"], [f"ad={served_dirs['adapter']}"], name="tiny", max_tokens=1000,
                        max_queue=3)
    server = LiveServer(state)
    yield server
    server.stop()
