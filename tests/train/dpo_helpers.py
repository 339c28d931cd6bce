"""Helpers for the dpo tests: a byte-level BPE with a ChatML template, preference rows, tiny Qwen3 configs."""

from __future__ import annotations

import json
import random
from pathlib import Path

QWEN3 = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=96, pad_token_id=0, eos_token_id=2)


def model_section(d) -> str:
    """A run TOML's [model] and [model.config]: the tiny QWEN3 from its config, with `d`/tok's tokenizer."""
    config = "\n".join(f"{k} = {v}" for k, v in QWEN3.items())
    return f'[model]\nfamily = "qwen3"\ntask = "causal-lm"\ntokenizer = "{d / "tok"}"\n[model.config]\n{config}\n'



def arithmetic_pairs(n: int, seed: int = 0) -> list[dict]:
    """Conversational pairs: the right sum is chosen, a wrong one rejected (varied lengths)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 30), rng.randint(0, 30)
        wrong = a + b + rng.choice([-7, -3, 2, 5, 11])
        rows.append({"prompt": [{"role": "user", "content": f"what is {a} plus {b}?"}],
                     "chosen": [{"role": "assistant", "content": f"It is {a + b}."}],
                     "rejected": [{"role": "assistant", "content": f"I think {wrong}, maybe."}]})
    return rows


def standard_pairs(n: int, seed: int = 1) -> list[dict]:
    """The same pairs as plain strings."""
    return [{"prompt": r["prompt"][0]["content"], "chosen": " " + r["chosen"][0]["content"],
             "rejected": " " + r["rejected"][0]["content"]} for r in arithmetic_pairs(n, seed)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_tokenizer(d: Path, rows: list[dict]) -> Path:
    from kiln.data.bpe import train_bpe

    text = write_jsonl(d / "tok_text.jsonl", [{"messages": r["prompt"] + r["chosen"] + r["rejected"]}
                                              for r in rows])
    train_bpe([text], d / "tok", vocab_size=300, min_frequency=1)
    return d / "tok"


def hf_model_dir(d: Path, tok: Path, seed: int) -> Path:
    """A transformers Qwen3ForCausalLM with random weights (seed) and the tokenizer, saved as an HF directory."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3))
    model.save_pretrained(d)
    transformers.AutoTokenizer.from_pretrained(tok).save_pretrained(d)
    return d


def chatterbot_pairs(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, held-out) conversational pairs from chatterbot-corpus: the prompt is a dialog's first turn, chosen
    its real reply, rejected the reply of a dialog from another category; held-out = every fifth dialog."""
    import chatterbot_corpus
    import yaml

    src = Path(chatterbot_corpus.__file__).parent / "data" / "english"
    dialogs = []  # (category, prompt, reply)
    for f in sorted(src.glob("*.yml")):
        for conv in yaml.safe_load(f.read_text(encoding="utf-8")).get("conversations") or []:
            turns = [str(t).strip() for t in conv if t is not None and str(t).strip()]
            if len(turns) >= 2:
                dialogs.append((f.stem, turns[0], turns[1]))
    rng = random.Random(seed)
    rows = []
    for cat, prompt, reply in dialogs:
        other = rng.choice([d for d in dialogs if d[0] != cat])
        rows.append({"prompt": [{"role": "user", "content": prompt}],
                     "chosen": [{"role": "assistant", "content": reply}],
                     "rejected": [{"role": "assistant", "content": other[2]}]})
    return [r for i, r in enumerate(rows) if i % 5], rows[::5]
