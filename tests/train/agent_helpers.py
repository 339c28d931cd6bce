"""A tiny Qwen3 with a tool-calling chat template (TRL's qwen2_5.jinja, Hermes `<tool_call>` layout) for the
multi-turn GRPO tests, and environments to run it against."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

TEMPLATES = resources.files("trl") / "chat_templates"
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                        "parameters": {"type": "object", "properties": {
                                            "a": {"type": "integer", "description": "first"},
                                            "b": {"type": "integer", "description": "second"}},
                                            "required": ["a", "b"]}}}


def make_tokenizer(d: Path, template: str = "qwen2_5.jinja") -> Path:
    """A byte-level BPE tokenizer (<|im_end|> = id 2, the EOS) whose chat template is one of TRL's."""
    from kiln.data.bpe import train_bpe
    from kiln.hub import ChatTemplate

    text = (TEMPLATES / template).read_text()
    convs = [[{"role": "user", "content": f"what is {a} plus {b}?"},
              {"role": "assistant", "content": "", "tool_calls": [
                  {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}]},
              {"role": "tool", "name": "add", "content": str(a + b)},
              {"role": "assistant", "content": f"{a + b}"}] for a in range(5) for b in range(5)]
    d.mkdir(parents=True, exist_ok=True)
    (d / "corpus.txt").write_text("\n".join(ChatTemplate(text).render(c, tools=[ADD]) for c in convs))
    train_bpe([d / "corpus.txt"], d / "tok", vocab_size=400, min_frequency=1)
    cfg = json.loads((d / "tok" / "tokenizer_config.json").read_text())
    cfg["chat_template"] = text
    (d / "tok" / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d / "tok"


MODEL_CONFIG = dict(vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, pad_token_id=0, eos_token_id=2)


def make_model(tok: Path, seed: int = 0):
    from kiln.hub import Tokenizer
    from kiln.models.auto import AutoConfig, from_config

    model = from_config(AutoConfig.for_model("qwen3", **MODEL_CONFIG), task="causal-lm", seed=seed)
    model.tokenizer = Tokenizer.from_dir(tok)
    return model.eval()


def write_agent_data(d: Path) -> Path:
    """`d`'s prompts.jsonl (guess a number, its answer) and agentrewards.py (`short`: shorter episodes score more)."""
    rows = [{"prompt": f"guess a number below {n}", "answer": str(n // 2)} for n in range(4, 12)]
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "agentrewards.py").write_text("def short(prompts, completions, completion_ids, **kw):\n"
                                       "    return [1.0 / (1 + len(ids)) for ids in completion_ids]\n")
    return d


def agent_toml(d: Path, name: str, grpo: str, steps: int = 2, model: str | None = None, train: str = "",
               max_new_tokens: int = 8) -> Path:
    """`d/name.toml`: a multi-turn [grpo] run on d's prompts; the tiny Qwen3 from scratch with d's `tok`, or
    `model` (a [model] section's lines); `train`, `grpo`: more lines for those sections."""
    config = "\n".join(f"{k} = {v}" for k, v in MODEL_CONFIG.items())
    model = model or f'family = "qwen3"\ntask = "causal-lm"\ntokenizer = "tok"\n[model.config]\n{config}'
    cfg = d / f"{name}.toml"
    cfg.write_text(f"""
[model]
{model}
[data]
train = "prompts.jsonl"
max_length = 256
[train]
out_dir = "{d / name}"
steps = {steps}
batch_size = 2
lr = 1e-2
weight_decay = 0.0
schedule = "constant"
progress = false
{train}
[grpo]
num_generations = 2
max_new_tokens = {max_new_tokens}
max_turns = 3
max_episode_tokens = 200
{grpo}
""")
    return cfg


class GuessEnv:
    """kiln's protocol: guess the row's number; each wrong guess gets a user message saying higher / lower."""

    def __init__(self):
        self.target = None

    def reset(self, row, seed):
        self.target = int(row["answer"])
        return {"messages": [{"role": "user", "content": row["prompt"]}], "tools": [ADD]}

    def step(self, message):
        text = message.get("content", "")
        digits = "".join(ch for ch in text if ch.isdigit())
        if digits and int(digits) == self.target:
            return {"done": True, "reward": 1.0}
        hint = "higher" if not digits or int(digits) < self.target else "lower"
        return {"messages": [{"role": "user", "content": hint}], "reward": 0.0}


class Calculator:
    """TRL's environment_factory shape: reset(**row), a public method as the tool, get_reward()."""

    def reset(self, **row):
        self.answer, self.calls = int(row["answer"]), 0
        return None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: first
            b: second
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.calls)


def adder(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first
        b: second
    """
    return a + b


def undocumented(a, b):
    return a + b
