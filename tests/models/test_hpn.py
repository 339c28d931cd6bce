"""Hyperspherical prototype head: loss and gradients against an independent float64 reference, the
spread reaching the simplex, the head on Mamba (LM + prototype objectives) and on BERT, user errors."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.errors import ConfigError
from kiln.models import AutoConfig
from kiln.models.auto import from_config
from kiln.models.common.prototypes import PrototypeHead, min_pairwise_angle, simplex_angle, spread_prototypes
from kiln.models.hpn import PrototypeModel
from tests.models.rounding import assert_all_within


def _reference_loss(h, W, P, labels, scale, kind):
    """float64, written from the definitions: cos = <Wh/|Wh|, p/|p|>; CE or (1 - cos_target)^2."""
    z = h @ W.T
    z = z / z.pow(2).sum(-1, keepdim=True).sqrt()
    p = P / P.pow(2).sum(-1, keepdim=True).sqrt()
    logits = (scale * z @ p.T).reshape(-1, P.shape[0])
    y = labels.reshape(-1)
    keep = y != -100
    logits, y = logits[keep], y[keep]
    picked = logits[torch.arange(len(y)), y]
    if kind == "ce":
        return (torch.logsumexp(logits, dim=1) - picked).mean()
    return ((1 - picked / scale) ** 2).mean()


@pytest.mark.parametrize("kind", ["ce", "cosine"])
def test_loss_and_gradients_match_float64_reference(kind):
    torch.manual_seed(0)
    head = PrototypeHead(24, 11, proto_dim=16, scale=7.5, mode="learnable", loss=kind, spread_steps=50)
    h = torch.randn(3, 5, 24, requires_grad=True)
    labels = torch.randint(0, 11, (3, 5))
    labels[0, :2] = -100
    loss = head.loss(head(h), labels)
    loss.backward()
    refs = {}
    for dtype in (torch.float32, torch.float64):  # the reference formula in float32 shows its own rounding
        h_, W_, P_ = (x.detach().to(dtype).requires_grad_() for x in (h, head.proj.weight, head.prototypes))
        ref = _reference_loss(h_, W_, P_, labels, 7.5, kind)
        ref.backward()
        refs[dtype] = {"loss": ref, "hidden": h_.grad, "proj": W_.grad, "prototypes": P_.grad}
    got = {"loss": loss, "hidden": h.grad, "proj": head.proj.weight.grad, "prototypes": head.prototypes.grad}
    assert_all_within(got, refs[torch.float32], refs[torch.float64], h.shape[0] * h.shape[1], kind,
                      against_float64=True)


@pytest.mark.parametrize("num,dim", [(10, 16), (17, 16), (4, 3)])
def test_fixed_prototypes_reach_the_simplex(num, dim):
    random_angle = min_pairwise_angle(spread_prototypes(num, dim, steps=0))
    angle = min_pairwise_angle(spread_prototypes(num, dim))
    print(f"K={num} D={dim}: min pairwise angle {angle:.4f} deg (simplex optimum {simplex_angle(num):.4f}, "
          f"random start {random_angle:.2f})")
    assert angle >= simplex_angle(num) - 0.05
    assert angle <= simplex_angle(num) + 1e-6  # nothing beats the simplex: guards the angle computation


def test_many_prototypes_spread_far_beyond_random():
    num, dim = 200, 16  # beyond 2*dim there is no closed form; the spread must still clear random by far
    random_angle = min_pairwise_angle(spread_prototypes(num, dim, steps=0))
    angle = min_pairwise_angle(spread_prototypes(num, dim))
    print(f"K={num} D={dim}: min pairwise angle {angle:.2f} deg (random start {random_angle:.2f})")
    assert angle > random_angle + 25 and angle < 90


def _mamba(**extra):
    cfg = AutoConfig.for_model("mamba", vocab_size=40, hidden_size=16, num_hidden_layers=2, state_size=4,
                               scan="fast", **extra)
    return cfg


def test_prototype_lm_on_mamba_returns_both_objectives():
    lm = from_config(_mamba(), task="causal-lm", seed=0)
    model = PrototypeModel(lm, num_classes=40, proto_dim=8, scale=10.0, mode="fixed", loss="cosine", spread_steps=20)
    assert "head.prototypes" in model.state_dict() and "head.prototypes" not in dict(model.named_parameters())
    ids = torch.randint(0, 40, (2, 9))
    out = model(input_ids=ids, labels=ids)
    assert set(out.losses) == {"prototype", "lm"} and out.logits.shape == (2, 9, 40)
    torch.testing.assert_close(out.loss, out.losses["prototype"] + out.losses["lm"])
    before = model.head.prototypes.clone()
    out.loss.backward()
    torch.optim.SGD(list(model.parameters()), lr=0.1).step()
    assert torch.equal(model.head.prototypes, before)
    # The prototype loss alone is the (1 - cos)^2 of position t against token t+1.
    cos = out.logits[:, :-1].gather(2, ids[:, 1:, None])[..., 0] / 10.0
    torch.testing.assert_close(out.losses["prototype"], ((1 - cos) ** 2).mean())


def test_prototype_classifier_on_bert_and_on_mamba_pooling():
    cfg = AutoConfig.for_model("bert", vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=20, max_position_embeddings=32)
    model = PrototypeModel(from_config(cfg, task="base", seed=0), num_classes=4, task="sequence-classification",
                           pooling="first", mode="learnable", spread_steps=20)
    out = model(input_ids=torch.randint(1, 50, (3, 7)), labels=torch.tensor([0, 3, 1]))
    assert out.logits.shape == (3, 4) and set(out.losses) == {"prototype"}
    out.loss.backward()
    assert model.head.prototypes.grad is not None
    mamba = PrototypeModel(from_config(_mamba(), task="base", seed=0), num_classes=3, task="sequence-classification",
                           spread_steps=0)
    ids = torch.randint(1, 40, (2, 6))
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        padded = mamba(input_ids=ids, attention_mask=mask).logits[0]
        alone = mamba(input_ids=ids[:1, :4]).logits[0]
    torch.testing.assert_close(padded, alone)  # pooled at the last real token


def test_user_errors_name_the_setting():
    with pytest.raises(ConfigError, match=r"prototype mode 'frozen' is not one of: fixed, learnable"):
        PrototypeHead(8, 4, mode="frozen")
    with pytest.raises(ConfigError, match=r"prototype loss 'mse' is not one of: ce, cosine"):
        PrototypeHead(8, 4, loss="mse")
    with pytest.raises(ConfigError, match=r"prototype scale must be > 0, got 0"):
        PrototypeHead(8, 4, scale=0)
    with pytest.raises(ConfigError, match=r"at least 2 classes and 2 dimensions, got 1 x 8"):
        spread_prototypes(1, 8)
    assert math.isclose(simplex_angle(2), 180.0)
