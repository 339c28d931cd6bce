"""Tiny causal LMs built from a family's tiny config in memory, and prompts, for the engine tests (not a test module)."""

from __future__ import annotations

import torch

from kiln.models.auto import REGISTRY
from kiln.models.tasks import CAUSAL_LM


def tiny_model(model_type: str = "qwen3", seed: int = 0, **overrides):
    """The family's tiny causal LM with seeded random weights, in eval mode, EOS off unless overridden (random
    tiny models emit the EOS id early, which would end the streams these tests compare)."""
    fam = REGISTRY[model_type]
    raw = dict(fam.tiny.config)
    raw.update(overrides)
    config = fam.config_cls.from_dict(raw, source=f"{model_type} tiny config")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = fam.build(config, CAUSAL_LM)
        model.init_weights()
    if "eos_token_id" not in overrides:
        model.config.eos_token_id = None
    return model.eval()


def prompts(count: int, low: int, high: int, seed: int = 1, vocab: int = 99) -> list[list[int]]:
    """`count` prompts of random lengths in [low, high) over ids 4..vocab-1."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g)
    return [torch.randint(4, vocab, (int(n),), generator=g).tolist() for n in lengths]
