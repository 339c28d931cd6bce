"""The GRPO loss of each loss_type equals TRL 1.16's GRPOTrainer._compute_loss on the same completions, advantages
and log-probs (fed to both), gradients included; the advantages equal TRL's group normalisation; by hand on
fixed numbers; the (loss_sum, count) parts of several micro-batches aggregate as TRL's window does."""

from __future__ import annotations

import types

import pytest
import torch

from kiln.train.grpo_loss import (
    LOSS_TYPES,
    LossSpec,
    advantages,
    clipped,
    combine_rewards,
    is_correction,
    loss_parts,
    rloo_advantages,
    token_loss,
)

CLASSIC = ["grpo", "dr_grpo", "dapo", "bnpo"]
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


def _trl_loss(spec: LossSpec, logps, old, ref, adv, mask, is_ratio=None, sampler=None) -> torch.Tensor:
    """TRL's own _compute_loss on an instance holding just what it reads, its log-prob pass replaced by `logps`."""
    from trl import GRPOTrainer

    t = GRPOTrainer.__new__(GRPOTrainer)
    t.args = types.SimpleNamespace(
        use_bias_correction_kl=spec.bias_correction_kl, delta=spec.delta, steps_per_generation=1,
        sapo_temperature_pos=spec.sapo_temperature_pos, sapo_temperature_neg=spec.sapo_temperature_neg,
        vespo_k_pos=spec.vespo_k_pos, vespo_lambda_pos=spec.vespo_lambda_pos, vespo_k_neg=spec.vespo_k_neg,
        vespo_lambda_neg=spec.vespo_lambda_neg)
    t.accelerator = _Accelerator()
    t.model = torch.nn.Linear(1, 1)  # only .training is read: train mode
    t.loss_type, t.beta, t.epsilon_low, t.epsilon_high = spec.loss_type, spec.beta, spec.eps_low, spec.eps_high
    t.importance_sampling_level, t.top_entropy_quantile = spec.level, 1.0
    t.off_policy_mask_threshold = spec.off_policy_mask_threshold
    t.use_vllm = t.vllm_importance_sampling_correction = is_ratio is not None
    t.aux_loss_enabled = False
    t._entropy_bonus_enabled, t.max_completion_length, t.current_gradient_accumulation_steps = False, MAX_NEW, 1
    t._metrics = {"train": __import__("collections").defaultdict(list)}
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    b, c = mask.shape
    inputs = {"prompt_ids": torch.ones(b, 2, dtype=torch.long), "prompt_mask": torch.ones(b, 2, dtype=torch.long),
              "completion_ids": torch.ones(b, c, dtype=torch.long), "completion_mask": mask, "advantages": adv,
              "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    if spec.beta:
        inputs["ref_per_token_logps"] = ref
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    if sampler is not None:
        inputs["sampling_per_token_logps"] = sampler
    return t._compute_loss(t.model, inputs)


def _both(spec: LossSpec, seed: int = 0, is_ratio=None, sampler=None):
    """(kiln's loss, its gradient wrt logps, TRL's loss, its gradient) on one batch."""
    logps, old, ref, adv, mask = _batch(seed)
    mine_lp = logps.clone().requires_grad_(True)
    t = token_loss(mine_lp, old, adv, spec, ref, mask, is_ratio, sampler)
    s, n = loss_parts(spec.loss_type, t.loss, mask, MAX_NEW)
    mine = s / n
    mine.backward()
    trl_lp = logps.clone().requires_grad_(True)
    theirs = _trl_loss(spec, trl_lp, old, ref, adv, mask, is_ratio, sampler)
    theirs.backward()
    return mine, mine_lp.grad, theirs, trl_lp.grad, t


def _close(a, b):
    # float64 throughout, the same operations up to the order of the final sum/division: rounding only (the
    # issue's bound is relative 1e-5; float64 rounding over a few dozen terms is ~1e-15)
    torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.04], ids=["no-kl", "kl"])
@pytest.mark.parametrize("loss_type", CLASSIC)
def test_loss_and_gradient_equal_trls(loss_type, beta):
    spec = LossSpec(loss_type, 0.2, 0.28, beta=beta)
    mine, g_mine, theirs, g_theirs, t = _both(spec)
    _close(mine, theirs)
    _close(g_mine, g_theirs)
    # a control that can fail: another aggregation gives another value on this batch (bnpo and dapo coincide
    # on one micro-batch, so each is checked against grpo)
    mask = _batch()[4]
    other = "dapo" if loss_type == "grpo" else "grpo"
    s2, n2 = loss_parts(other, t.loss.detach(), mask, MAX_NEW)
    assert abs(float(s2 / n2) - float(theirs.detach())) > 1e-3


VARIANTS = {
    "gspo": dict(level="sequence"),
    "delta": dict(delta=1.1),
    "bias-kl": dict(beta=0.04, bias_correction_kl=True),
    "gspo-bias-kl": dict(level="sequence", beta=0.04, bias_correction_kl=True),
    "opsm": dict(off_policy_mask_threshold=0.05),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if t != "rloo"])  # rloo: RLOOTrainer's, below
def test_every_loss_type_and_option_equals_trls(loss_type, variant):
    """Each of TRL 1.16's loss types under sequence-level weights (GSPO), two-sided clipping (delta), the
    bias-corrected KL and the off-policy sequence mask: loss and gradient equal TRL's _compute_loss."""
    spec = LossSpec(loss_type, 0.2, 5.0 if loss_type == "cispo" else 0.28, **VARIANTS[variant])
    mine, g_mine, theirs, g_theirs, _ = _both(spec, seed=2)
    assert torch.isfinite(theirs) and float(theirs) != 0.0
    _close(mine, theirs)
    _close(g_mine, g_theirs)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "cispo", "vespo"])
def test_is_corrected_loss_equals_trls(loss_type, mode):
    """The IS ratio (trainer's old over the sampler's) multiplies the loss as TRL's vLLM correction does (vespo:
    inside its Gamma weight, token modes only)."""
    if loss_type == "vespo" and mode.startswith("sequence"):
        pytest.skip("TRL refuses vespo with a sequence-level correction, as kiln's config does")
    _logps, old, _, _, mask = _batch(4)
    sampler = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * 0.3
    ratio = is_correction(old, sampler, mask, mode, 0.5, 2.0)
    spec = LossSpec(loss_type, 0.2, 0.28)
    mine, g_mine, theirs, g_theirs, _ = _both(spec, seed=4, is_ratio=ratio)
    _close(mine, theirs)
    _close(g_mine, g_theirs)
    plain, *_ = _both(spec, seed=4)
    assert abs(float(plain) - float(mine)) > 1e-6  # the correction changed the loss: the check can fail


def test_is_correction_by_hand():
    """Four modes on fixed numbers: token ratios exp(old - sampler) = 2, 0.25, 1 (masked out: 1); the sequence's
    exp(sum) = 0.5."""
    old = torch.log(torch.tensor([[2.0, 0.25, 7.0]], dtype=torch.float64))
    sampler = torch.zeros(1, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    tt = is_correction(old, sampler, mask, "token_truncate", 0.5, 1.5)
    torch.testing.assert_close(tt, torch.tensor([[1.5, 0.5, 1.0]], dtype=torch.float64))
    tm = is_correction(old, sampler, mask, "token_mask", 0.5, 1.5)
    torch.testing.assert_close(tm, torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64))
    st = is_correction(old, sampler, mask, "sequence_truncate", 0.6, 3.0)
    torch.testing.assert_close(st, torch.tensor([[0.6]], dtype=torch.float64))
    sm = is_correction(old, sampler, mask, "sequence_mask", 0.4, 3.0)
    torch.testing.assert_close(sm, torch.tensor([[0.5]], dtype=torch.float64))
    assert float(is_correction(old, sampler, mask, "sequence_mask", 0.6, None)) == 0.0
    nan = sampler.clone()
    nan[0, 1] = torch.nan  # a token the sampler could not score: no correction from it
    torch.testing.assert_close(is_correction(old, nan, mask, "token_truncate", None, 9.0),
                               torch.tensor([[2.0, 1.0, 1.0]], dtype=torch.float64))


def test_rloo_advantages_equal_trls_definition():
    """RLOOTrainer's leave-one-out baseline over scorable siblings, by hand on a group with a None and a group
    with one scorable completion; then normalised."""
    r = torch.tensor([1.0, 2.0, 3.0, float("nan"), 5.0, float("nan"), float("nan"), float("nan")])
    mine = rloo_advantages(r, 4)
    want = torch.tensor([1 - 2.5, 2 - 2.0, 3 - 1.5, 0.0, 0.0, 0.0, 0.0, 0.0])  # the lone 5.0: 0/0 -> 0
    torch.testing.assert_close(mine, want)
    from trl.trainer.utils import nanstd

    raw = torch.tensor([1 - 2.5, 2 - 2.0, 3 - 1.5, float("nan"), float("nan"), float("nan"), float("nan"),
                        float("nan")])
    norm = torch.nan_to_num((raw - torch.nanmean(raw)) / (nanstd(raw) + 1e-4), nan=0.0)
    torch.testing.assert_close(rloo_advantages(r, 4, normalize=True), norm)
    assert not torch.equal(mine, advantages(r, 4, "group"))


def _trl_rloo_loss(logps, old, adv, mask, eps_low: float, eps_high: float) -> torch.Tensor:
    """TRL 1.16's RLOOTrainer._compute_loss on an instance holding just what it reads, its log-prob pass replaced
    by `logps`; the old log-probs summed per sequence as its rollout sums them."""
    from trl import RLOOTrainer

    t = RLOOTrainer.__new__(RLOOTrainer)
    t.accelerator = _Accelerator()
    t.model = torch.nn.Linear(1, 1)  # only .training is read: train mode
    t.epsilon_low, t.epsilon_high, t.aux_loss_enabled = eps_low, eps_high, False
    t._metrics = {"train": __import__("collections").defaultdict(list)}
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    b, c = mask.shape
    inputs = {"prompt_ids": torch.ones(b, 2, dtype=torch.long), "prompt_mask": torch.ones(b, 2, dtype=torch.long),
              "completion_ids": torch.ones(b, c, dtype=torch.long), "completion_mask": mask, "advantages": adv,
              "old_logps": (old * mask).sum(1)}
    return t._compute_loss(t.model, inputs)


@pytest.mark.parametrize("seed", [0, 3])
def test_rloo_loss_and_gradient_equal_rloo_trainers(seed):
    """loss_type = "rloo" (per sequence: the summed log-ratio's weight, clipped, the mean over sequences) equals
    RLOOTrainer._compute_loss, loss and gradient; on RLOO's advantages of a batch with clipped sequences both sides."""
    logps, old, _, _, mask = _batch(seed)
    rewards = torch.randn(logps.shape[0], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    adv = rloo_advantages(rewards, 3)
    spec = LossSpec("rloo", 0.2, 0.28)
    mine_lp = logps.clone().requires_grad_(True)
    t = token_loss(mine_lp, old, adv, spec, None, mask)
    s, n = loss_parts("rloo", t.loss, mask, MAX_NEW)
    (s / n).backward()
    trl_lp = logps.clone().requires_grad_(True)
    theirs = _trl_rloo_loss(trl_lp, old, adv, mask, 0.2, 0.28)
    theirs.backward()
    _close(s / n, theirs)
    _close(mine_lp.grad, trl_lp.grad)
    assert bool(clipped(t.ratio, adv, 0.2, 0.28).any()) and not bool(clipped(t.ratio, adv, 0.2, 0.28).all())
    # control: the token-level loss of the same batch (GRPO's) is another number
    g = token_loss(logps, old, adv, LossSpec("grpo", 0.2, 0.28), None, mask)
    s2, n2 = loss_parts("grpo", g.loss, mask, MAX_NEW)
    assert abs(float(s2 / n2) - float(theirs.detach())) > 1e-3


def test_the_loss_by_hand_on_fixed_numbers():
    """One token of each kind: ratio inside the clip, above it with A > 0, below it with A < 0."""
    logps = torch.tensor([[0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    old = torch.log(torch.tensor([[1.0, 1 / 1.5], [1 / 0.5, 1.0]], dtype=torch.float64))  # ratios 1, 1.5 | 0.5, 1
    adv = torch.tensor([2.0, -1.0], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [1, 0]])
    t = token_loss(logps, old, adv, LossSpec("grpo", 0.2, 0.2))
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
    logps, old, _ref, adv, mask = _batch(1)
    t = token_loss(logps, old, adv, LossSpec("dapo", 0.2, 0.2))
    halves = [(t.loss[:3], mask[:3]), (t.loss[3:], mask[3:])]
    for kind in CLASSIC:
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


@pytest.mark.parametrize("keys, message", [
    (dict(), "advantage_estimator"),
    (dict(advantage_estimator="rloo", beta=0.04), "penalty on the reward"),
    (dict(advantage_estimator="rloo", importance_sampling_correction=True, sampler="exact"), "no importance-sampling"),
    (dict(advantage_estimator="rloo", off_policy_mask_threshold=0.1), "off_policy_mask_threshold"),
])
def test_rloo_loss_settings_outside_trls_rloo_are_refused(keys, message):
    from kiln.train.grpo_config import GRPOSection

    with pytest.raises(ValueError, match=message):
        GRPOSection(loss_type="rloo", rewards=["m:f"], **keys)
    assert GRPOSection(loss_type="rloo", advantage_estimator="rloo", rewards=["m:f"]).loss_spec().loss_type == "rloo"
