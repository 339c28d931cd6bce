"""A reward model's tail (kiln.models.common.scored_tail): the last decoder layer run only at the read positions
gives the full forward's scores and gradients within float32 rounding (estimated per tensor against the full
forward in float64, tests/models/rounding.py), padded and packed, with grouped and plain attention; the read
position is the last non-pad token in both layouts (a tokenizer whose pad is its EOS); where the tail does not
apply (an MoE last layer) the full forward runs. Controls: a read one token early, and the packed rows' keys
unmasked across sequences, are off by far more than the bound."""

from __future__ import annotations

import copy

import pytest
import torch

from kiln.models.auto import AutoConfig, from_config
from kiln.models.common import scored_tail
from kiln.train.recipes.reward_model import pair_batch as reward_layout
from kiln.train.recipes.reward_model import read_positions
from tests.models.rounding import assert_all_within, assert_within, rounding_error
from tests.train.test_pair_packing import VOCAB, pair_batch

SHAPES = {"qwen3": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8),  # grouped, q/k norms
          "llama": dict(num_attention_heads=4, num_key_value_heads=4, head_dim=8)}


def tiny(family: str, **more):
    cfg = AutoConfig.for_model(family, vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               max_position_embeddings=64, pad_token_id=0, num_labels=1,
                               **{**SHAPES.get(family, {}), **more})
    return from_config(cfg, task="sequence-classification", seed=0)


def _scores(model, layout, read, tail: bool) -> torch.Tensor:
    """(n,) scores at `read` (2, n): through the tail, or the full forward's hidden state read there."""
    kw = dict(input_ids=layout.input_ids, attention_mask=layout.attention_mask, position_ids=layout.position_ids)
    if tail:
        return model(**kw, read_at=read).logits[:, 0]
    return model.score(model.model(**kw)[read[0], read[1]])[:, 0]


def _run(model, layout, read, tail: bool):
    model.zero_grad(set_to_none=True)
    s = _scores(model, layout, read, tail)
    (s * torch.linspace(-1.0, 1.0, s.shape[0], dtype=s.dtype)).sum().backward()  # every score's gradient differs
    return s.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_tail_equals_the_full_forward(family, pack):
    model = tiny(family).train()
    assert scored_tail.applies(model.model, True)
    batch = pair_batch(seed=2)
    layout = reward_layout(batch, 0, pack)
    read = read_positions(layout, 0)
    tokens = int(batch["chosen_len"].sum() + batch["rejected_len"].sum())
    got, got_g = _run(model, layout, read, tail=True)
    want, want_g = _run(model, layout, read, tail=False)
    want64, want64_g = _run(copy.deepcopy(model).double(), layout, read, tail=False)
    e = rounding_error(want, want64, tokens)
    assert_within(got, want, e, f"{family} scores")
    assert_all_within(got_g, want_g, want64_g, tokens, f"{family} gradient")
    # controls: one token earlier is another score; packed keys seen across sequences are another attention
    early = torch.stack([read[0], read[1] - 1])
    assert float((_run(model, layout, early, tail=True)[0] - want).abs().max()) > 1e3 * e
    if pack:
        blind = copy.copy(layout)
        blind.position_ids = torch.arange(layout.input_ids.shape[1])[None].expand_as(layout.input_ids)
        assert float((_run(model, blind, read, tail=True)[0] - want).abs().max()) > 1e3 * e


def test_a_pad_that_is_the_eos_is_read_past_in_both_layouts():
    """Every side ends with the pad id (a tokenizer padding with its EOS): both layouts read the token before
    it, transformers' rule for the padded row, so packing does not change which token scores."""
    batch = pair_batch(seed=3)
    for side in ("chosen", "rejected"):
        ids, n = batch[f"{side}_ids"], batch[f"{side}_len"]
        ids[torch.arange(ids.shape[0]), n - 1] = 0  # the last real token of each side is the pad id
    padded, packed = reward_layout(batch, 0, False), reward_layout(batch, 0, True)
    want = padded.input_ids.ne(0).long().cumsum(-1).argmax(-1)  # rightmost non-pad column of each padded row
    assert read_positions(padded, 0)[1].tolist() == want.tolist()
    model = tiny("qwen3").eval()
    with torch.no_grad():
        a = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits[:, 0]
        b = model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                  read_at=read_positions(packed, 0)).logits[:, 0]
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_an_moe_last_layer_runs_the_full_forward():
    model = tiny("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=8,
                 num_attention_heads=4, num_key_value_heads=2)
    assert not scored_tail.applies(model.model, True)
    layout = reward_layout(pair_batch(seed=4), 0, True)
    read = read_positions(layout, 0)
    with torch.no_grad():
        out = model(input_ids=layout.input_ids, position_ids=layout.position_ids, read_at=read)
    assert out.last_hidden_state is not None  # the full forward ran
    torch.testing.assert_close(out.logits[:, 0], _scores(model, layout, read, tail=False), rtol=0, atol=0)
