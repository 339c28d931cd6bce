"""The GRPO loss of each loss_type equals TRL 1.16's GRPOTrainer._compute_loss on the same completions, advantages
and log-probs (fed to both), gradients included; the advantages equal TRL's group normalisation; by hand on
fixed numbers; the (loss_sum, count) parts of several micro-batches aggregate as TRL's window does."""

from __future__ import annotations

import types

import pytest
import torch

from kiln.train.grpo_loss import advantages, clipped, combine_rewards, loss_parts, token_loss

LOSS_TYPES = ["grpo", "dr_grpo", "dapo", "bnpo"]
MAX_NEW = 7


def _batch(seed: int = 0, b: int = 6, c: int = MAX_NEW):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(b, c, generator=g, dtype=torch.float64) * 3
    old = logps + torch.randn(b, c, generator=g, dtype=torch.float64) * 0.3  # ratios on both sides of the clip
    ref = logps + torch.randn(b, c, generator=g, dtype=torch.float64) * 0.2
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    lengths = torch.tensor([c, 3, 1, c - 1, 5, 2])[:b]
    mask = (torch.arange(c)[None, :] < lengths[:, None]).long()
    return logps, old, ref, adv, mask


class _Accelerator:
    num_processes = 1

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x

    gather_for_metrics = gather


def _trl_loss(loss_type: str, logps, old, ref, adv, mask, beta: float, eps: float, eps_high: float) -> torch.Tensor:
    """TRL's own _compute_loss on an instance holding just what it reads, its log-prob pass replaced by `logps`."""
    from trl import GRPOTrainer

    t = GRPOTrainer.__new__(GRPOTrainer)
    t.args = types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1)
    t.accelerator = _Accelerator()
    t.model = torch.nn.Linear(1, 1)  # only .training is read: train mode
    t.loss_type, t.beta, t.epsilon_low, t.epsilon_high = loss_type, beta, eps, eps_high
    t.importance_sampling_level, t.top_entropy_quantile, t.off_policy_mask_threshold = "token", 1.0, None
    t.use_vllm, t.vllm_importance_sampling_correction, t.aux_loss_enabled = False, False, False
    t._entropy_bonus_enabled, t.max_completion_length, t.current_gradient_accumulation_steps = False, MAX_NEW, 1
    t._metrics = {"train": __import__("collections").defaultdict(list)}
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    b, c = mask.shape
    inputs = {"prompt_ids": torch.ones(b, 2, dtype=torch.long), "prompt_mask": torch.ones(b, 2, dtype=torch.long),
              "completion_ids": torch.ones(b, c, dtype=torch.long), "completion_mask": mask, "advantages": adv,
              "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    if beta:
        inputs["ref_per_token_logps"] = ref
    return t._compute_loss(t.model, inputs)


@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["no-kl", "kl"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_and_gradient_equal_trls(loss_type, beta):
    logps, old, ref, adv, mask = _batch()
    eps, eps_high = 0.2, 0.28
    mine_lp = logps.clone().requires_grad_(True)
    t = token_loss(mine_lp, old, adv, eps, eps_high, beta, ref)
    s, n = loss_parts(loss_type, t.loss, mask, MAX_NEW)
    mine = s / n
    mine.backward()
    trl_lp = logps.clone().requires_grad_(True)
    theirs = _trl_loss(loss_type, trl_lp, old, ref, adv, mask, beta, eps, eps_high)
    theirs.backward()
    # float64 throughout, the same operations up to the order of the final sum/division: rounding only
    torch.testing.assert_close(mine.detach(), theirs.detach(), rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(mine_lp.grad, trl_lp.grad, rtol=1e-12, atol=1e-14)
    # a control that can fail: another aggregation gives another value on this batch (bnpo and dapo coincide
    # on one micro-batch, so each is checked against grpo)
    other = "dapo" if loss_type == "grpo" else "grpo"
    s2, n2 = loss_parts(other, t.loss.detach(), mask, MAX_NEW)
    assert abs(float(s2 / n2) - float(theirs)) > 1e-3


def test_the_loss_by_hand_on_fixed_numbers():
    """One token of each kind: ratio inside the clip, above it with A > 0, below it with A < 0."""
    logps = torch.tensor([[0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    old = torch.log(torch.tensor([[1.0, 1 / 1.5], [1 / 0.5, 1.0]], dtype=torch.float64))  # ratios 1, 1.5 | 0.5, 1
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    t = token_loss(logps, old, adv, 0.2, 0.2)
    # row 0: -min(1*2, 1*2) = -2; -min(1.5*2, 1.2*2) = -2.4. row 1: -min(0.5*-1, 0.8*-1) = 0.8; (masked) -min(-1,-1) = 1
    torch.testing.assert_close(t.loss, torch.tensor([[-2.0, -2.4], [0.8, 1.0]], dtype=torch.float64))
    assert clipped(t.ratio, adv, 0.2, 0.2).tolist() == [[False, True], [True, False]]
    by_hand = {"grpo": ((-2 - 2.4) / 2 + 0.8) / 2, "dr_grpo": (-2 - 2.4 + 0.8) / (2 * 5), "dapo": (-2 - 2.4 + 0.8) / 3,
               "bnpo": (-2 - 2.4 + 0.8) / 3}
    for kind, want in by_hand.items():
        s, n = loss_parts(kind, t.loss, mask, 5)
        assert float(s / n) == pytest.approx(want, abs=1e-12), kind


def test_micro_batches_aggregate_as_trls_window():
    """Two micro-batches: dapo over every token of the window, bnpo the mean of per-micro-batch token means,
    grpo / dr_grpo over every sequence (what TRL's gradient accumulation adds up to)."""
    logps, old, ref, adv, mask = _batch(1)
    t = token_loss(logps, old, adv, 0.2, 0.2)
    halves = [(t.loss[:3], mask[:3]), (t.loss[3:], mask[3:])]
    for kind in LOSS_TYPES:
        parts = [loss_parts(kind, loss, m, MAX_NEW) for loss, m in halves]
        window = sum(float(s) for s, _ in parts) / sum(float(n) for _, n in parts)
        masked = (t.loss * mask).double()
        if kind == "dapo":
            want = float(masked.sum() / mask.sum())
        elif kind == "bnpo":
            want = sum(float((loss * m).sum() / m.sum()) for loss, m in halves) / 2
        elif kind == "grpo":
            want = float((masked.sum(-1) / mask.sum(-1)).mean())
        else:
            want = float(masked.sum() / (6 * MAX_NEW))
        assert window == pytest.approx(want, rel=1e-12), kind


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_equal_trls_normalisation(scale):
    """TRL's sum_then_normalize, written out from its _generate_and_score_completions on a batch with a None."""
    from trl.trainer.utils import nanstd

    g = torch.Generator().manual_seed(3)
    per_func = torch.randn(12, 2, generator=g)
    per_func[4, 1] = torch.nan   # one function did not apply
    per_func[7, :] = torch.nan   # no function applied: unscorable
    weights = torch.tensor([1.0, 0.5])
    rewards = combine_rewards(per_func, weights)
    mine = advantages(rewards, 4, scale)
    r = (per_func * weights[None]).nansum(1)
    r[torch.isnan(per_func).all(1)] = torch.nan
    mean = torch.nanmean(r.view(-1, 4), dim=1).repeat_interleave(4)
    std = nanstd(r.view(-1, 4), dim=1).repeat_interleave(4) if scale != "batch" else nanstd(r).expand_as(r)
    want = r - mean
    if scale != "none":
        want = want / (std + 1e-4)
    want = torch.nan_to_num(want, nan=0.0)
    torch.testing.assert_close(mine, want, rtol=1e-6, atol=1e-6)
    assert mine[7] == 0 and mine.abs().sum() > 0
