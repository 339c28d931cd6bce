"""kiln.train.logps: chunked per-token log-probs equal the full-logits log_softmax, values and gradients."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kiln.errors import KilnError
from kiln.models.auto import AutoConfig, from_config
from kiln.models.common.fast import set_fast
from kiln.train.logps import linear_token_logps, sequence_logps, token_logps

VOCAB = 61


def tiny_lm(tied: bool = False, seed: int = 0):
    cfg = AutoConfig.for_model("qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                               tie_word_embeddings=tied)
    return from_config(cfg, task="causal-lm", seed=seed)


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 11), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 8:] = 0  # right padding
    attn[2, 5:] = 0
    scored = attn.clone()
    scored[:, :4] = 0  # a 4-token prompt
    return ids, attn, scored


def reference_logps(model, ids, attn, scored, temperature=1.0):
    """What TRL computes: full logits (divided by the temperature), log_softmax, gather the next token, mask."""
    logits = model(input_ids=ids, attention_mask=attn).logits.float()[:, :-1]
    if temperature != 1.0:
        logits = logits / temperature
    picked = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return F.pad(picked * scored[:, 1:], (0, 1))


@pytest.mark.parametrize("tied, temperature", [(False, 1.0), (True, 0.7)])
def test_chunked_values_and_gradients_equal_full_logits(tied, temperature):
    model = tiny_lm(tied)
    ids, attn, scored = batch()
    want = reference_logps(model, ids, attn, scored, temperature)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(5))  # a per-token upstream gradient
    (want * weights).sum().backward()
    want_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    set_fast(model)
    got = token_logps(model, ids, attn, scored, chunk=4, temperature=temperature)  # several chunks, a ragged last
    # fp32 rounding of a 61-way log-sum-exp and two tiny layers: ~1e-6; 1e-5 leaves headroom
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got[scored[:, 1:].bool().logical_not().nonzero(as_tuple=True)] == 0).all()
    (got * weights).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n], atol=1e-5, rtol=1e-4, msg=n)


def test_exact_path_is_bitwise_the_full_logits():
    model = tiny_lm()
    ids, attn, scored = batch(2)
    assert torch.equal(token_logps(model, ids, attn, scored), reference_logps(model, ids, attn, scored))
    hot = token_logps(model, ids, attn, scored, temperature=0.7)
    assert torch.equal(hot, reference_logps(model, ids, attn, scored, 0.7))
    assert not torch.equal(hot, reference_logps(model, ids, attn, scored))  # control: the temperature counts


def test_mask_controls_what_is_scored():
    model = set_fast(tiny_lm())
    ids, attn, scored = batch(3)
    full = token_logps(model, ids, attn, attn)
    part = token_logps(model, ids, attn, scored)
    assert not torch.equal(full, part)  # control: the prompt tokens change the sum
    total, count = sequence_logps(part, scored)
    torch.testing.assert_close(total, full[:, 3:].sum(-1) * (scored.sum(-1) > 0), atol=1e-5, rtol=1e-5)
    assert count.tolist() == scored[:, 1:].sum(-1).tolist() == [7, 4, 1]


def test_linear_token_logps_bias_and_bf16_autocast():
    g = torch.Generator().manual_seed(0)
    h, w, b = (torch.randn(9, 16, generator=g), torch.randn(40, 16, generator=g), torch.randn(40, generator=g))
    t = torch.randint(0, 40, (9,), generator=g)
    for x in (h, w, b):
        x.requires_grad_(True)
    got = linear_token_logps(h, w, t, b, chunk_rows=2)
    want = F.linear(h, w, b).log_softmax(-1).gather(1, t[:, None]).squeeze(1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    up = torch.randn(9, generator=g)
    grads = torch.autograd.grad((got * up).sum(), (h, w, b))
    wants = torch.autograd.grad((want * up).sum(), (h, w, b))
    for a, e in zip(grads, wants):
        torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = linear_token_logps(h, w, t, b, chunk_rows=4)
    assert low.dtype == torch.float32
    # bf16 matmul: logits off by ~|logit| * 2^-8 (|logit| <~ 15 here), so the log-probs by < 0.3
    assert (low - want).abs().max() < 0.3


def test_bad_shapes_name_them():
    model = tiny_lm()
    ids, attn, scored = batch()
    with pytest.raises(KilnError, match="targets_mask"):
        token_logps(model, ids, attn, scored[:, :5])
    with pytest.raises(KilnError, match="temperature must be > 0"):
        token_logps(model, ids, attn, scored, temperature=0.0)
    with pytest.raises(KilnError, match="weight"):
        linear_token_logps(torch.zeros(3, 4), torch.zeros(5, 6), torch.zeros(3, dtype=torch.long))


def test_a_second_backward_gives_the_same_gradient():
    """The forward keeps its last chunk's logits for the backward, which uses them up in place: a second
    backward through the same graph (retain_graph) recomputes them and gets the same gradients."""
    g = torch.Generator().manual_seed(7)
    h = torch.randn(10, 8, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, VOCAB, (10,), generator=g)
    upstream = torch.randn(10, generator=g)
    out = linear_token_logps(h, weight, targets, chunk_rows=4, temperature=0.7)  # chunks of 2, 4, 4 rows
    (out * upstream).sum().backward(retain_graph=True)
    first = (h.grad.clone(), weight.grad.clone())
    h.grad = weight.grad = None
    (out * upstream).sum().backward()
    assert torch.equal(h.grad, first[0]) and torch.equal(weight.grad, first[1])
