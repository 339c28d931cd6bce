"""The engine's LM head (oneDNN on the weight packed once, kiln.engine.exact.pack_head, or else
kiln.engine.exact.vocab_product, on row counts `head_tiles` proved): a row's logits have the same bits whatever
rows share the call, at every row count and row limit; the packed weight follows the weight (an optimizer step,
a replaced tensor); a head that is not invariant is
caught by the same comparison (the control); and the scoring forward's head gradient (kiln.engine.score's
`_HeadLogps`, whole-chunk products) is the training forward's to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from kiln.engine.exact import HEAD_TILE, VOCAB_CHUNK, head_tiles, pack_head, tiled_menu, vocab_product
from kiln.engine.runner import DecoderRunner
from kiln.engine.score import runner_for, token_logps
from tests.engine.tiny import prompts, tiny_model

VOCAB = 2 * VOCAB_CHUNK + 77  # two whole column blocks of the weight and a short last one


def _mismatches(logits, x: torch.Tensor) -> list[str]:
    """Row counts / windows where `logits` of a slice of x differ from the same rows of the call on all of x."""
    whole = logits(x)
    bad = [f"first {n}" for n in range(1, x.shape[0]) if not torch.equal(logits(x[:n]), whole[:n])]
    bad += [f"rows {s}..{s + n}" for s in (1, 5, 17) for n in (1, 3, 9)
            if not torch.equal(logits(x[s:s + n]), whole[s:s + n])]
    return bad


@pytest.mark.parametrize("limit", [1, 8, 32, 64])
def test_a_rows_logits_do_not_depend_on_the_rows_beside_it(limit):
    model = tiny_model(vocab_size=VOCAB)
    runner = runner_for(model)
    assert runner.head_weight() is not None  # the product path, not the module's
    x = torch.randn(40, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert _mismatches(lambda t: runner.logits(t, limit), x) == []
        # and they are the head's numbers: the final norm, then the product, to fp32 rounding
        torch.testing.assert_close(runner.logits(x, limit), model.head(model.model.norm(x)).float())
    # a float32 CPU weight goes through the packed product wherever this torch has oneDNN's linear ops
    expected = "product" if pack_head(runner.head_weight()) is None else "packed"
    assert {kind for _, kind in runner._menus} == {expected}


def test_the_packed_head_is_remade_after_an_optimizer_step_and_a_replaced_weight():
    """The packed weight is a copy: after an optimizer step (in place) and after `.data` is replaced, the logits
    are a fresh runner's (made after the change, packing the new values), bit for bit."""
    model = tiny_model(vocab_size=VOCAB, tie_word_embeddings=False)
    runner = runner_for(model)
    x = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = runner.logits(x)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    model.lm_head.weight.grad = torch.randn_like(model.lm_head.weight)
    opt.step()
    with torch.no_grad():
        after = runner.logits(x)
        assert not torch.equal(before, after)
        assert torch.equal(after, DecoderRunner(model, runner.max_positions).logits(x))
        model.lm_head.weight.data = model.lm_head.weight.data * 0.5 + 0.01  # a new tensor, no version bump
        replaced = runner.logits(x)
        assert torch.equal(replaced, DecoderRunner(model, runner.max_positions).logits(x))
        torch.testing.assert_close(replaced, model.head(model.model.norm(x)).float())


def test_the_head_follows_a_weight_changed_in_place():
    """An optimizer step changes the weight in place: the next logits are the new weight's (the head reads the
    weight itself at every call, no copy)."""
    model = tiny_model(vocab_size=VOCAB)
    runner = runner_for(model)
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = runner.logits(x)
        runner.head_weight().mul_(-0.5)
        after = runner.logits(x)
        torch.testing.assert_close(after, model.head(model.model.norm(x)).float())
    assert not torch.allclose(before, after)


def test_the_control_a_head_that_splits_its_sum_by_row_count_is_caught():
    """A product whose sum over the hidden size is split in two when a call has more than HEAD_TILE rows (as a
    kernel chosen by row count may): the comparison above finds it when its row counts are taken unproven, and
    `head_tiles` proves none of its larger sizes."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(VOCAB, 64, generator=g)
    half = weight.shape[1] // 2

    def split(t: torch.Tensor) -> torch.Tensor:
        if t.shape[0] <= HEAD_TILE:
            return vocab_product(t, weight)
        return vocab_product(t[:, :half].contiguous(), weight[:, :half].contiguous()) + \
            vocab_product(t[:, half:].contiguous(), weight[:, half:].contiguous())

    x = torch.randn(40, 64, generator=g)
    assert _mismatches(lambda t: tiled_menu(split, t, (HEAD_TILE, 16, 32, 64)), x)
    proven = head_tiles(split, 64, torch.float32, torch.device("cpu"), 64)
    assert proven[0] == HEAD_TILE and all(m <= HEAD_TILE for m in proven)
    assert _mismatches(lambda t: tiled_menu(split, t, proven), x) == []


@pytest.mark.parametrize("tied", [True, False])
def test_the_scoring_gradient_is_the_training_forwards(tied):
    """token_logps' backward (the head's softmax recomputed per chunk with one product, its gradients from two
    more) against autograd through the training forward (ForCausalLM.token_logps), at a temperature."""
    model = tiny_model(vocab_size=VOCAB, tie_word_embeddings=tied, max_position_embeddings=128).train()
    seqs = prompts(2, 40, 60, seed=11, vocab=VOCAB)  # over 64 scored rows: two chunks
    weights = torch.rand(sum(len(s) - 3 for s in seqs), generator=torch.Generator().manual_seed(2))
    (torch.cat(token_logps(model, seqs, [3, 3], temperature=0.8)) * weights).sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    at = 0
    for s in seqs:
        ids = torch.tensor([s])
        targets = torch.full_like(ids, -100)
        targets[0, 2:-1] = ids[0, 3:]
        lp = model.token_logps(ids, None, targets, temperature=0.8)[0, 2:-1]
        (lp * weights[at:at + lp.shape[0]]).sum().backward()
        at += lp.shape[0]
    assert set(ours) == {n for n, p in model.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        if p.grad is not None:
            # fp32 rounding through 2 layers of width 32 and a 4,000-way softmax, summed over ~100 rows
            torch.testing.assert_close(ours[n], p.grad, rtol=1e-3, atol=1e-5, msg=n)
