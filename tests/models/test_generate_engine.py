"""A kiln causal LM's `generate` runs on the generation engine (kiln.engine.padded, registered in
kiln.models.common.generation; kiln's earlier loop is gone): greedy rows equal a by-hand greedy decode, sampled
calls are seeded, and what the engine does not do is refused by name."""

from __future__ import annotations

import pytest
import torch

import kiln.engine  # noqa: F401  (registers the engine's generator)
from kiln.engine import padded
from kiln.errors import KilnError
from kiln.models.auto import AutoConfig, from_config
from kiln.models.common import generation
from tests.train.dpo_helpers import QWEN3


@pytest.fixture(scope="module")
def model():
    return from_config(AutoConfig.for_model("qwen3", **QWEN3), task="causal-lm", seed=0)


def _reference(model, ids, mask, n, eos):
    """Greedy by hand: each row alone, its whole sequence through the model's forward every step, the argmax."""
    rows = []
    for row, m in zip(ids.tolist(), mask.tolist()):
        seq = [t for t, k in zip(row, m) if k]
        new = []
        with torch.no_grad():
            for _ in range(n):
                logits = model(torch.tensor([seq + new])).logits[0, -1]
                new.append(int(logits.argmax()))
                if new[-1] in eos:
                    break
        rows.append(new)
    return rows


def _counting(monkeypatch) -> list[int]:
    """Counts the engine's runs of a whole call (Engine.generate)."""
    calls: list[int] = []
    real = padded.Engine.generate

    def counted(self, prompts, params, prompt_inputs=None):
        calls.append(len(prompts))
        return real(self, prompts, params, prompt_inputs)

    monkeypatch.setattr(padded.Engine, "generate", counted)
    return calls


def test_greedy_generate_runs_on_the_engine(model, monkeypatch):
    calls = _counting(monkeypatch)
    ids = torch.tensor([[0, 0, 0, 5, 6, 7], [8, 9, 10, 11, 12, 13], [0, 14, 15, 16, 17, 18]])
    mask = (torch.arange(6)[None, :] >= torch.tensor([[3], [0], [1]])).long()  # left padding
    stops = list(range(40, 300))  # most tokens end a row: rows end at different steps
    for kw, eos in (({"eos_token_id": []}, []), ({"eos_token_id": stops, "pad_token_id": 0}, stops)):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=9, **kw)
        want = _reference(model, ids, mask, 9, eos)
        assert got.shape == (3, 6 + max(len(w) for w in want)) and torch.equal(got[:, :6], ids)
        for row, w in zip(got[:, 6:].tolist(), want):
            assert row == w + [0] * (len(row) - len(w)), (row, w)  # padded after its end token
    assert calls == [3, 3]
    assert model.training  # the caller's mode back (the engine ran in eval)


def test_sampled_generate_is_seeded_on_the_engine(model, monkeypatch):
    calls = _counting(monkeypatch)
    ids = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8]])
    kw = dict(max_new_tokens=8, do_sample=True, temperature=1.5, top_k=50, eos_token_id=[])
    a, b = model.generate(ids, seed=3, **kw), model.generate(ids, seed=3, **kw)
    assert torch.equal(a, b) and not torch.equal(a[0], a[1])  # a seed a call; each row its own draws
    assert not torch.equal(a, model.generate(ids, seed=4, **kw))
    assert calls == [2, 2, 2]


def test_what_the_engine_does_not_do_is_refused_by_name(model):
    ids = torch.tensor([[5, 6, 7, 8]])
    with pytest.raises(KilnError, match="draw"):
        model.generate(ids, do_sample=True, draw=lambda logits: logits.argmax(-1))
    with pytest.raises(KilnError, match="on_token"):
        model.generate(ids, on_token=print)
    with pytest.raises(KilnError, match="left padding"):
        model.generate(ids, attention_mask=torch.tensor([[1, 0, 1, 1]]))
    with pytest.raises(KilnError, match="not loaded"):
        saved = list(generation.GENERATORS)
        generation.GENERATORS.clear()
        try:
            model.generate(ids)
        finally:
            generation.GENERATORS[:] = saved
