"""The packed scoring forward (kiln.engine.score.token_logps over DecoderRunner.dense_many): several sequences in
one pass give each sequence's one-at-a-time bits (forward and gradient), log-probs at a temperature equal the
engine's when its logits are divided by the same temperature (kiln.train.grpo_engine.TemperedRunner), and the
training forward's to fp32 rounding."""

from __future__ import annotations

import types

import pytest
import torch

from kiln.engine.score import runner_for, token_logps
from kiln.errors import KilnError
from kiln.train.grpo_engine import BLOCK, EngineRollouts
from tests.engine.tiny import prompts, tiny_model


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_packed_pass_gives_each_sequences_own_bits(model_type):
    model = tiny_model(model_type)
    seqs = prompts(5, 3, 40, seed=7)
    runner = runner_for(model)
    with torch.no_grad():
        packed = runner.dense_many(seqs, 4)
        alone = torch.cat([runner.dense(s, 4) for s in seqs])
    assert torch.equal(packed, alone)
    together = token_logps(model, seqs, [1, 2, 1, 3, 2], block_size=4, temperature=0.7)
    for s, start, lp in zip(seqs, [1, 2, 1, 3, 2], together):
        assert torch.equal(lp, token_logps(model, [s], [start], block_size=4, temperature=0.7)[0])


def test_packed_gradient_is_the_sum_of_the_sequences_gradients():
    """The backward through the packed pass (the LM head's chunks recomputed) gives the gradient of the
    sequences scored one at a time, to fp32 summation order (the head's and projections' weight gradients add
    the rows in another grouping)."""
    model = tiny_model(max_position_embeddings=128).train()
    seqs = prompts(3, 5, 90, seed=8)  # over 64 scored rows: several head chunks
    packed = torch.cat(list(token_logps(model, seqs, [2, 2, 2], temperature=0.9))).sum()
    packed.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    for s in seqs:
        token_logps(model, [s], [2], temperature=0.9)[0].sum().backward()
    for n, p in model.named_parameters():
        if p.grad is not None:
            # a few hundred fp32 terms per element summed in another grouping: ~1e-6 relative to their scale
            torch.testing.assert_close(got[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)
    assert got and any(float(g.abs().max()) > 0 for g in got.values())


def test_engine_logps_at_a_temperature_equal_the_scorers_and_near_the_training_forward():
    """Sampling at temperature 0.6 with top-k / min-p / a repetition penalty: the log-probs the rollout keeps
    are log_softmax(logits / 0.6) of the drawn tokens, bit for bit the scorer's at 0.6, and the training
    forward's (ForCausalLM.token_logps, temperature 0.6) to fp32 rounding; at another temperature they differ."""
    model = tiny_model(eos_token_id=2)
    g = types.SimpleNamespace(temperature=0.6, top_k=30, top_p=0.95, min_p=0.01, repetition_penalty=1.2)
    ps = prompts(3, 4, 20, seed=9)
    groups = EngineRollouts(g).run(model, ps, [10, 7, 12], 4, torch.Generator().manual_seed(0), [2])
    assert [len(group) for group in groups] == [4, 4, 4]
    for p, group, budget in zip(ps, groups, [10, 7, 12]):
        for toks, lps, ended in group:
            assert len(toks) == len(lps) and 1 <= len(toks) <= budget and ended == (toks[-1] == 2)
            scored = token_logps(model, [p + toks], [len(p)], block_size=BLOCK, temperature=0.6)[0]
            assert torch.equal(torch.tensor(lps), scored)
            ids = torch.tensor([p + toks])
            targets = torch.full_like(ids, -100)
            targets[0, len(p) - 1:-1] = ids[0, len(p):]
            with torch.no_grad():
                train = model.token_logps(ids, None, targets, temperature=0.6)[0, len(p) - 1:-1]
            assert float((train - scored).abs().max()) < 1e-4  # fp32 rounding through 2 layers of width 32
            assert not torch.equal(scored, token_logps(model, [p + toks], [len(p)], block_size=BLOCK)[0])


def test_bad_starts_and_temperatures_are_named():
    model = tiny_model()
    with pytest.raises(KilnError, match="start 0 is outside"):
        token_logps(model, [[4, 5, 6]], [0])
    with pytest.raises(KilnError, match="temperature must be > 0"):
        token_logps(model, [[4, 5, 6]], [1], temperature=0.0)
