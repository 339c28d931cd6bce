"""The chunked distillation divergences against TRL 1.16's GKD `generalized_jsd_loss` on the same logits: loss and
the student's gradients (hidden states and head), for forward KL, reverse KL and the generalized JSD, at two
temperatures, chunked finer than the rows."""

from __future__ import annotations

import pytest
import torch

from kiln.train.divergence import divergence, linear_divergence

trl = pytest.importorskip("trl")


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    N, C, Ct, V = 13, 16, 24, 50
    h = torch.randn(N, C, generator=g)
    w = torch.randn(V, C, generator=g) * 0.5
    th = torch.randn(N, Ct, generator=g)
    tw = torch.randn(V, Ct, generator=g) * 0.5
    labels = torch.randint(0, V, (1, N), generator=g)
    labels[0, [0, 5, 6, 12]] = -100  # unscored positions
    return h, w, th, tw, labels


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.1, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_loss_and_gradients_equal_trl_generalized_jsd(beta, temperature):
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    h, w, th, tw, labels = _case()
    ha, wa = h.clone().requires_grad_(), w.clone().requires_grad_()
    want = GKDTrainer.generalized_jsd_loss((ha @ wa.T)[None], (th @ tw.T)[None], labels=labels, beta=beta,
                                           temperature=temperature)
    want.backward()

    keep = labels[0] != -100
    hb, wb = h.clone().requires_grad_(), w.clone().requires_grad_()
    got = linear_divergence(hb[keep], wb, th[keep], tw, beta=beta, temperature=temperature, chunk_rows=4) / keep.sum()
    got.backward()
    assert float(want) > 1e-3  # control: the two distributions differ
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want)), (float(got), float(want))
    for mine, theirs, name in ((hb.grad, ha.grad, "hidden"), (wb.grad, wa.grad, "head")):
        scale = float(theirs.abs().max())
        assert float((mine - theirs).abs().max()) <= 1e-5 * scale, name
    # the per-position form agrees too, and a chunk size is only a grouping
    per = divergence((h @ w.T)[keep], (th @ tw.T)[keep], beta, temperature)
    assert abs(float(per.sum() / keep.sum()) - float(want)) <= 1e-5 * abs(float(want))
    whole = linear_divergence(h[keep], w, th[keep], tw, beta=beta, temperature=temperature) / keep.sum()
    assert abs(float(whole) - float(got)) <= 1e-6 * abs(float(got))


def test_zero_when_student_is_teacher_and_bad_settings_named():
    h, w, _, _, _ = _case(1)
    for beta in (0.0, 0.5, 1.0):
        assert abs(float(linear_divergence(h, w, h, w, beta=beta))) < 1e-5
    with pytest.raises(ValueError, match="beta must lie in"):
        linear_divergence(h, w, h, w, beta=1.5)
    with pytest.raises(ValueError, match="vocabulary"):
        linear_divergence(h, w, h, w[:-1], beta=0.5)
