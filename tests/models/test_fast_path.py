"""The fast training path against the exact one, for every causal-LM family: the task loss (logits only
at labelled positions, fused chunked head + cross entropy, fast scans/rules) within 1e-6 relative and
every gradient within 1e-5 relative; set_fast reaches every switch; exact mode stays the old path."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kiln.constants import IGNORE_INDEX
from kiln.interop.tiny import TINY
from kiln.models.auto import REGISTRY, AutoConfig, from_config
from kiln.models.common.fast import fast_state, set_fast
from kiln.models.common.loss import fast_lm_loss_sum, linear_cross_entropy, lm_loss_sum, shift_labels
from kiln.models.tasks import CAUSAL_LM
from kiln.train.recipes.pretrain import lm_step

CAUSAL = [mt for mt in TINY if CAUSAL_LM in REGISTRY[mt].tasks]


def _model(model_type: str):
    return from_config(AutoConfig.for_model(model_type, **TINY[model_type]), task=CAUSAL_LM, seed=0).train()


def _batch(vocab: int, B: int = 2, T: int = 24) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, min(vocab, 99), (B, T), generator=g)
    labels = ids.clone()
    labels[:, : T // 2] = IGNORE_INDEX  # loss on the second half only
    labels[1, -3:] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


def _loss_and_grads(model, batch):
    model.zero_grad(set_to_none=True)
    loss_sum, count, _ = CAUSAL_LM.loss(model, batch)
    loss_sum.backward()
    return loss_sum.detach(), int(count), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _close_rel(fast: torch.Tensor, exact: torch.Tensor, rel: float, what: str) -> None:
    scale = float(exact.abs().max())
    err = float((fast - exact).abs().max())
    assert err <= rel * max(scale, 1e-30), f"{what}: max abs diff {err:.3g} vs max {scale:.3g} (> {rel} relative)"


def _fast_head_only(model, on: bool):
    """The LM head + loss piece alone (the Gated DeltaNet rule has its own tests in test_qwen3_next.py)."""
    set_fast(model, False)
    model.fast = on
    if model.config.model_type == "mamba":  # the fast scan is checked here too, at the same tolerance
        set_fast(model, on)
    return model


@pytest.mark.parametrize("model_type", CAUSAL)
def test_fast_loss_and_gradients_match_the_exact_path(model_type):
    torch.manual_seed(0)
    model = _model(model_type)
    batch = _batch(model.config.vocab_size)
    exact = _loss_and_grads(_fast_head_only(model, False), batch)
    fast = _loss_and_grads(_fast_head_only(model, True), batch)
    assert fast[1] == exact[1] == int((shift_labels(batch["labels"]) != IGNORE_INDEX).sum())
    _close_rel(fast[0], exact[0], 1e-6, f"{model_type} loss")
    assert fast[2].keys() == exact[2].keys()
    for name in exact[2]:
        _close_rel(fast[2][name], exact[2][name], 1e-5, f"{model_type} grad {name}")
    # the labels= mean (what a hand-written loop reads as .loss) too, and no logits on the fast path
    out = model(**batch)
    assert out.logits is None
    ref = _fast_head_only(model, False)(**batch)
    _close_rel(out.loss.detach(), ref.loss.detach(), 1e-6, f"{model_type} .loss")


def test_exact_mode_is_the_old_logits_path_bit_for_bit():
    model = set_fast(_model("qwen3"), False)
    batch = _batch(model.config.vocab_size)
    loss_sum, count, out = CAUSAL_LM.loss(model, batch)
    want, n = lm_loss_sum(model(input_ids=batch["input_ids"]).logits, shift_labels(batch["labels"]))
    assert torch.equal(loss_sum, want) and int(count) == int(n) and out.logits is not None
    # a control that can fail: the fast path differs somewhere in the last bits or at least returns no logits
    assert set_fast(model, True)(**batch).logits is None


def test_lm_step_uses_the_fused_loss_for_token_windows():
    model = _model("llama")  # tied embeddings: the head's gradient lands on the input embedding
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(4, 99, (2, 16), generator=g)
    batch = {"input_ids": ids, "targets": torch.roll(ids, -1, 1)}
    batch["targets"][:, -1] = IGNORE_INDEX
    exact_sum, exact_n = lm_step(set_fast(model, False), batch)
    exact_sum.backward()
    want = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    fast_sum, fast_n = lm_step(set_fast(model, True), batch)
    fast_sum.backward()
    assert int(fast_n) == int(exact_n) == 30
    _close_rel(fast_sum.detach(), exact_sum.detach(), 1e-6, "lm_step loss")
    _close_rel(model.model.embed_tokens.weight.grad, want, 1e-5, "tied embedding grad")


@pytest.mark.parametrize("rows", [1, 5, 1000])
def test_linear_cross_entropy_chunks_match_full_logits(rows):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    b = torch.randn(50, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (37,), generator=g)
    want = F.cross_entropy(F.linear(h, w, b), t, reduction="sum")
    grads = torch.autograd.grad(want * 0.5, (h, w, b))
    got = linear_cross_entropy(h, w, t, b, chunk_rows=rows)
    for x, y, what in zip(torch.autograd.grad(got * 0.5, (h, w, b)), grads, ("h", "w", "b")):
        _close_rel(x, y, 1e-5, f"grad {what}")  # the incoming gradient (0.5) scales what the forward kept
    _close_rel(got.detach(), want.detach(), 1e-6, "loss")


def test_fast_loss_with_no_targets_is_zero_and_reaches_the_graph():
    h = torch.randn(1, 4, 8, requires_grad=True)
    w = torch.randn(11, 8, requires_grad=True)
    loss, n = fast_lm_loss_sum(h, w, torch.full((1, 4), IGNORE_INDEX))
    loss.backward()
    assert float(loss.detach()) == 0.0 and int(n) == 0 and torch.equal(w.grad, torch.zeros_like(w))


def test_fast_loss_under_bf16_autocast_is_within_bf16_rounding():
    g = torch.Generator().manual_seed(4)
    h, w = torch.randn(2, 9, 16, generator=g), torch.randn(40, 16, generator=g)
    t = torch.randint(0, 40, (2, 9), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = fast_lm_loss_sum(h, w, t)
        want, _ = lm_loss_sum(F.linear(h, w), t)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=0)  # the same bf16 logits, summed in another order


def test_set_fast_reaches_every_switch():
    for model_type in ("mamba", "qwen3_next", "qwen3"):
        model = _model(model_type)
        assert fast_state(model) and not any(fast_state(model).values()), model_type  # exact by default
        assert all(fast_state(set_fast(model, True)).values())
        assert not any(fast_state(set_fast(model, False)).values())
    mamba = set_fast(_model("mamba"), True)
    assert {layer.mixer.scan for layer in mamba.model.layers} == {"fast"}


def test_every_family_but_mamba_keeps_packed_samples_apart():
    keeps = {mt: _model(mt).packs_samples() for mt in CAUSAL}
    # and DeepSeek-V4, whose compressors pool windows of tokens across sample boundaries (as in transformers)
    assert sorted(mt for mt, ok in keeps.items() if not ok) == ["deepseek_v4", "mamba"], keeps


@pytest.mark.parametrize("loss", ["ce", "cosine"])
@pytest.mark.parametrize("model_type", ["mamba", "qwen3"])
def test_prototype_head_fast_losses_match_the_exact_path(model_type, loss):
    from kiln.models.hpn import PrototypeModel

    model = PrototypeModel(_model(model_type), TINY[model_type]["vocab_size"], proto_dim=16, loss=loss,
                           mode="learnable", spread_steps=5)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(4, 99, (2, 12), generator=g)
    targets = torch.roll(ids, -1, 1)
    targets[:, -1] = IGNORE_INDEX
    targets[0, :4] = IGNORE_INDEX

    def run(on: bool):
        set_fast(model, on)
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, targets=targets)
        sum(out.losses.values()).backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (exact, eg), (fast, fg) = run(False), run(True)
    assert exact.logits is not None and fast.logits is None and fast.losses.keys() == exact.losses.keys() == {"prototype", "lm"}
    for k in exact.losses:
        _close_rel(fast.losses[k].detach(), exact.losses[k].detach(), 1e-6, f"{k} loss")
    assert fg.keys() == eg.keys()
    for name in eg:
        _close_rel(fg[name], eg[name], 1e-5, f"grad {name}")
