"""data.pack for GRPO's update (kiln.train.packing.completion_logps): a rollout's micro-batch (prompts left-padded,
completions right-padded, of mixed lengths, one empty) scored over packed rows gives the completions' log-probs,
each loss type's loss and every gradient of the padded rows within float32 rounding (estimated per tensor against
the padded rows in float64: tests/models/rounding.py); a model that cannot keep samples apart is refused by message
when pack = true was asked for; a [grpo] run packs by default and its first step's loss is the padded run's within
the same kind of bound."""

from __future__ import annotations

import pytest
import torch

from kiln.errors import KilnError
from kiln.train import load_run_config
from kiln.train.grpo_loss import LossSpec, loss_parts, token_loss
from kiln.train.logps import token_logps
from kiln.train.packing import completion_logps
from tests.train.test_grpo_recipe import _fit, _toml, grpo_dir  # noqa: F401 (grpo_dir: a fixture)
from tests.train.test_pair_packing import _compare, _ids, _len, tiny

PAD = 0


def rollout_micro(n: int = 8, seed: int = 0) -> dict:
    """A micro-batch as GRPORun.sample leaves it: N prompt + completion sequences in (N, P + C)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [_ids(g, _len(g, (1, 9))) for _ in range(n)]
    comps = [_ids(g, _len(g, (1, 30))) for _ in range(n)]
    comps[3] = comps[3][:0]  # a completion the sampler ended at once: its sequence is the prompt alone
    P, C = max(len(p) for p in prompts), max(len(c) for c in comps)
    ids = torch.full((n, P + C), PAD, dtype=torch.long)
    attn = torch.zeros((n, P + C), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, comps)):
        ids[i, P - len(p): P], ids[i, P: P + len(c)] = p, c
        attn[i, P - len(p): P + len(c)] = 1
    return {"input_ids": ids, "attention_mask": attn, "prompt_len": P, "completion_mask": attn[:, P:].clone()}


def padded_logps(model, micro: dict, temperature: float) -> torch.Tensor:
    """The rollout's own padded rows, as GRPORun.logps scores them through the training forward."""
    p, cmask = micro["prompt_len"], micro["completion_mask"]
    targets = torch.cat([torch.zeros_like(micro["input_ids"][:, :p]), cmask], 1)
    full = token_logps(model, micro["input_ids"], micro["attention_mask"], targets, temperature=temperature)
    return full[:, p - 1: p - 1 + cmask.size(1)]


@pytest.mark.parametrize("loss_type,beta,level", [("dapo", 0.0, "token"), ("grpo", 0.04, "token"),
                                                  ("dr_grpo", 0.0, "sequence"), ("cispo", 0.0, "token")])
def test_packed_update_equals_the_padded_rows(loss_type, beta, level):
    micro = rollout_micro()
    T = 0.7
    g = torch.Generator().manual_seed(1)
    adv = torch.randn(micro["input_ids"].size(0), generator=g)
    mask = micro["completion_mask"]
    with torch.no_grad():  # the old and reference log-probs: the padded ones moved a little, fixed for all three
        base = padded_logps(tiny(seed=2), micro, T)
        old = base + 0.05 * torch.randn(base.shape, generator=g) * mask
        ref = base + 0.05 * torch.randn(base.shape, generator=g) * mask
    spec = LossSpec(loss_type=loss_type, beta=beta, level=level)

    def run(model, _ref, pack):
        logps = completion_logps(model, micro, T) if pack else padded_logps(model, micro, T)
        dt = logps.dtype
        t = token_loss(logps, old.to(dt), adv.to(dt), spec, ref.to(dt) if beta else None, mask)
        per_seq = (t.loss * mask).sum(-1)  # each sequence's part: the loss the step sums, sequence by sequence
        part, _ = loss_parts(loss_type, t.loss, mask, 30)
        return per_seq, logps, part.reshape(1)

    _compare(run, tiny(), None, int(micro["attention_mask"].sum()), f"grpo {loss_type}")


def test_packed_rows_are_fewer_and_the_empty_completion_scores_nothing():
    micro = rollout_micro()
    with torch.no_grad():
        got = completion_logps(tiny(), micro, 1.0)
    assert got.shape == micro["completion_mask"].shape
    assert torch.equal(got != 0, micro["completion_mask"].bool())  # every completion token scored, nothing else
    assert not got[3].any()


def test_a_row_with_a_hole_in_its_attention_is_refused():
    micro = rollout_micro()
    micro["attention_mask"][0, micro["prompt_len"]] = 0  # the first completion token of a 1+ token completion
    micro["attention_mask"][0, micro["prompt_len"] + 1:] = 1
    with pytest.raises(KilnError, match="contiguous"):
        completion_logps(tiny(), micro, 1.0)


def test_a_grpo_run_packs_by_default_and_its_first_step_is_the_padded_one(grpo_dir, monkeypatch):
    """The same seed samples the same rollout either way (the engine does not see data.pack); the update's loss
    then differs by the log-probs' rounding only. Bound: |d loss| <= max |A| * max |d logp| (the dapo loss is a
    token mean of -w A with w = exp(logp - old) ~ 1 at the first update); |A| <= (G - 1) / sqrt(G) = 1.5 for
    groups of 4 standardised, and a 2-layer fp32 model's log-prob of a 300-token vocabulary (|logp| < 8) moves
    by < 16 ulp of it between two summation orders: 1.5 * 16 * 1.2e-7 * 8 = 2.3e-5."""
    import kiln.train.recipes.grpo as grpo_recipe

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return completion_logps(*args, **kwargs)

    monkeypatch.setattr(grpo_recipe, "completion_logps", counted)
    cfg = _toml(grpo_dir, "packed", steps=1)
    assert load_run_config(cfg).data.pack is True
    packed = _fit(cfg)
    assert calls  # the update went through the packed rows
    calls.clear()
    padded = _fit(_toml(grpo_dir, "padded", steps=1), [("data.pack", False)])
    assert not calls
    assert packed[0]["reward"] == padded[0]["reward"]
    assert abs(packed[0]["loss"] - padded[0]["loss"]) <= 2.3e-5, (packed[0]["loss"], padded[0]["loss"])
