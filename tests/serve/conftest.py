"""A tiny Qwen3 for the server tests (a real BPE tokenizer and Qwen3's chat template, which renders tools) that was
taught, by a few hundred optimizer steps, to answer the weather question with a tool call and the tool's result with
a sentence: so tool calls come out of the model itself, not from a script. A LoRA adapter over it (random, so it
changes the output), and a live `kiln serve` of both in a thread on a free loopback port."""

from __future__ import annotations

import json
import shutil
from importlib import resources

import pytest
import torch

from tests.serve.helpers import ANSWER, CALL_TEXT, QUESTION, RESULT, TOOLS, VOCAB, LiveServer, conversations


def _teach(model, examples: list[tuple[list[int], list[int]]], steps: int = 400) -> None:
    """Fit the replies (teacher forcing) until every reply token is the argmax after its prefix: greedy decoding
    then reproduces them exactly."""
    torch.manual_seed(0)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _step in range(steps):
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
    assert ok, f"the tiny model did not learn the replies in {steps} steps"


@pytest.fixture(scope="session")
def served_dirs(tmp_path_factory):
    """{"model": the taught base, "adapter": a LoRA adapter over it, "with_adapter": base + adapter in one
    directory (as a kiln LoRA checkpoint holds them, for `kiln generate`)}."""
    from kiln.data.bpe import train_bpe
    from kiln.data.sft import chat_prompt_ids
    from kiln.hub import Tokenizer
    from kiln.hub.chat import ChatTemplate
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


@pytest.fixture(scope="module")
def live(served_dirs):
    from kiln.cli.serve import build_state

    state = build_state(served_dirs["model"], [f"ad={served_dirs['adapter']}"], name="tiny", max_tokens=1000,
                        max_queue=3)
    server = LiveServer(state)
    yield server
    server.stop()
