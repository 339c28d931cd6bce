"""The fast training path against the exact one, for every causal-LM family: the task loss (logits only
at labelled positions, fused chunked head + cross entropy, fast scans/rules) and every gradient within the
float32 rounding of the exact path (estimated per tensor against float64, tests/models/rounding.py; with 1
and 2 threads); set_fast reaches every switch; exact mode stays the old path."""

from __future__ import annotations

import copy

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
from tests.models.rounding import (  # noqa: F401
    U_FP32,
    assert_all_within,
    assert_within,
    rounding_error,
    threads,  # (threads: a fixture)
)

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


def _double(model):
    """The same model in float64: where the exact path's own float32 rounding is measured."""
    return copy.deepcopy(model).double()


def _fast_head_only(model, on: bool):
    """The LM head + loss piece alone (the Gated DeltaNet rule has its own tests in test_qwen3_next.py)."""
    set_fast(model, False)
    model.fast = on
    if model.config.model_type == "mamba":  # the fast scan is checked here too, at the same tolerance
        set_fast(model, on)
    return model


@pytest.mark.parametrize("model_type", CAUSAL)
def test_fast_loss_and_gradients_match_the_exact_path(model_type, threads):
    torch.manual_seed(0)
    model = _model(model_type)
    model64 = _fast_head_only(_double(model), False)
    batch = _batch(model.config.vocab_size)
    n = batch["input_ids"].numel()  # weight gradients sum over every token
    exact = _loss_and_grads(_fast_head_only(model, False), batch)
    exact64 = _loss_and_grads(model64, batch)
    fast = _loss_and_grads(_fast_head_only(model, True), batch)
    assert fast[1] == exact[1] == int((shift_labels(batch["labels"]) != IGNORE_INDEX).sum())
    assert_all_within({"loss": fast[0], **fast[2]}, {"loss": exact[0], **exact[2]},
                      {"loss": exact64[0], **exact64[2]}, n, model_type)
    # the labels= mean (what a hand-written loop reads as .loss) too, and no logits on the fast path
    out = model(**batch)
    assert out.logits is None
    ref = _fast_head_only(model, False)(**batch)
    e = rounding_error(ref.loss, model64(**batch).loss, n)
    assert_within(out.loss, ref.loss, e, f"{model_type} .loss")


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
    model64 = set_fast(_double(model), False)
    sum64, _ = lm_step(model64, batch)
    sum64.backward()
    exact_sum, exact_n = lm_step(set_fast(model, False), batch)
    exact_sum.backward()
    want = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    fast_sum, fast_n = lm_step(set_fast(model, True), batch)
    fast_sum.backward()
    assert int(fast_n) == int(exact_n) == 30
    assert_within(fast_sum, exact_sum, rounding_error(exact_sum, sum64, ids.numel()), "lm_step loss")
    e = rounding_error(want, model64.model.embed_tokens.weight.grad, ids.numel())
    assert_within(model.model.embed_tokens.weight.grad, want, e, "tied embedding grad")


@pytest.mark.parametrize("rows", [1, 5, 1000])
def test_linear_cross_entropy_chunks_match_full_logits(rows):
    g = torch.Generator().manual_seed(3)
    h = torch.randn(37, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    b = torch.randn(50, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (37,), generator=g)
    want = F.cross_entropy(F.linear(h, w, b), t, reduction="sum")
    grads = torch.autograd.grad(want * 0.5, (h, w, b))
    h64, w64, b64 = (x.detach().double().requires_grad_() for x in (h, w, b))
    want64 = F.cross_entropy(F.linear(h64, w64, b64), t, reduction="sum")
    grads64 = torch.autograd.grad(want64 * 0.5, (h64, w64, b64))
    got = linear_cross_entropy(h, w, t, b, chunk_rows=rows)
    for x, y, y64, what in zip(torch.autograd.grad(got * 0.5, (h, w, b)), grads, grads64, ("h", "w", "b")):
        # the incoming gradient (0.5) scales what the forward kept
        assert_within(x, y, rounding_error(y, y64, 37), f"grad {what}")
    assert_within(got, want, rounding_error(want, want64, 37), "loss")


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
        logits = F.linear(h, w)
    assert got.dtype == torch.float32 and logits.dtype == torch.bfloat16
    # the same bf16 logits, summed in float32 in another order: the float32 rounding of that sum
    want64 = F.cross_entropy(logits.double().flatten(0, 1), t.flatten(), reduction="sum")
    assert_within(got, want, rounding_error(want, want64, t.numel() * 40), "bf16-autocast loss")


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
    n = ids.numel()
    model64 = set_fast(_double(model), False)
    out64 = model64(input_ids=ids, targets=targets)
    sum(out64.losses.values()).backward()
    g64 = {name: p.grad for name, p in model64.named_parameters() if p.grad is not None}
    assert exact.logits is not None and fast.logits is None and fast.losses.keys() == exact.losses.keys() == {"prototype", "lm"}
    assert_all_within(fast.losses, exact.losses, out64.losses, n, "loss")
    assert_all_within(fg, eg, g64, n, "grad")
