"""A kiln causal LM's `generate` runs its greedy calls on the generation engine (kiln.engine.padded, registered
in kiln.models.common.generation) and gives the loop's tokens; the calls the engine does not take go to the loop."""

from __future__ import annotations

import pytest
import torch

import kiln.engine  # noqa: F401  (registers the engine's generator)
from kiln.engine import padded
from kiln.models.auto import AutoConfig, from_config
from kiln.models.common import generation
from tests.train.dpo_helpers import QWEN3


@pytest.fixture(scope="module")
def model():
    return from_config(AutoConfig.for_model("qwen3", **QWEN3), task="causal-lm", seed=0)


def _loop(model, ids, **kw):
    """The same call on the loop alone (no generator offered it)."""
    saved = list(generation.GENERATORS)
    generation.GENERATORS.clear()
    try:
        return model.generate(ids, **kw)
    finally:
        generation.GENERATORS[:] = saved


def _counting(monkeypatch) -> list[int]:
    """Counts the engine's runs of a whole call (Engine.generate)."""
    calls: list[int] = []
    real = padded.Engine.generate

    def counted(self, prompts, params):
        calls.append(len(prompts))
        return real(self, prompts, params)

    monkeypatch.setattr(padded.Engine, "generate", counted)
    return calls


def test_greedy_generate_runs_on_the_engine_with_the_loops_tokens(model, monkeypatch):
    calls = _counting(monkeypatch)
    ids = torch.tensor([[0, 0, 0, 5, 6, 7], [8, 9, 10, 11, 12, 13], [0, 14, 15, 16, 17, 18]])
    mask = (torch.arange(6)[None, :] >= torch.tensor([[3], [0], [1]])).long()  # left padding
    for kw in ({"max_new_tokens": 9}, {"max_new_tokens": 9, "eos_token_id": []},
               {"max_new_tokens": 9, "eos_token_id": [int(t) for t in range(40, 300)], "pad_token_id": 0}):
        got = model.generate(ids, attention_mask=mask, **kw)
        assert torch.equal(got, _loop(model, ids, attention_mask=mask, **kw)), kw
    assert calls == [3, 3, 3]
    assert model.training  # the caller's mode back (the engine ran in eval)


def test_calls_the_engine_does_not_take_go_to_the_loop(model, monkeypatch):
    calls = _counting(monkeypatch)
    ids = torch.tensor([[5, 6, 7, 8]])
    sampled = model.generate(ids, max_new_tokens=5, do_sample=True, seed=3)
    assert torch.equal(sampled, _loop(model, ids, max_new_tokens=5, do_sample=True, seed=3))  # the loop's draws
    seen: list[torch.Tensor] = []
    model.generate(ids, max_new_tokens=3, on_token=seen.append)  # per-step columns: the loop's lockstep
    assert len(seen) == 3
    holes = torch.tensor([[1, 0, 1, 1]])  # not left padding
    assert torch.equal(model.generate(ids, attention_mask=holes, max_new_tokens=4),
                       _loop(model, ids, attention_mask=holes, max_new_tokens=4))
    assert calls == []
