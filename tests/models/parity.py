"""The parity harness's parts (not a test module): which cases the registry asks for, the inputs a family
gets, and the exact comparisons of outputs and gradients between a kiln model and a transformers one."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kiln.interop.verify import realign
from kiln.models.auto import REGISTRY
from kiln.models.pretrained import Family, Tiny
from kiln.models.tasks import BASE, CAUSAL_LM, get_task
from tests.models import causal_cases, encoder_cases

OUTPUTS = ("last_hidden_state", "pooler_output", "logits", "start_logits", "end_logits", "loss", "aux_loss")
DEFAULT = "tiny"  # the variant that is the family's Tiny config itself


def variants(tiny: Tiny | None) -> dict[str, dict[str, Any]]:
    return {DEFAULT: {}, **(tiny.variants if tiny else {})}


def head_cases() -> list:
    """(model_type, variant, head) for every registered family, each of its variants and heads."""
    return [pytest.param(t, v, h, id=f"{t}-{v}-{h}") for t, f in REGISTRY.items() for v in variants(f.tiny)
            for h in f.tasks]


def causal_cases_() -> list:
    """(model_type, variant) for every registered family with a causal-LM head."""
    return [pytest.param(t, v, id=f"{t}-{v}") for t, f in REGISTRY.items() if CAUSAL_LM in f.tasks
            for v in variants(f.tiny)]


def is_causal(family: Family) -> bool:
    return CAUSAL_LM in family.tasks


def inputs(family: Family, tiny: Tiny, head: str, hf_config) -> list[dict]:
    """The batches a family x head is compared on: causal rows (one short, padded right and left, labels) for
    the causal families; for encoders short and right-padded rows (and long ones, and token types where the
    family has them), each without and with the head's labels; a family's own (`Tiny.inputs`) where it takes
    no token ids."""
    if tiny.inputs is not None:
        return tiny.inputs(head, hf_config)
    if is_causal(family):
        rows = causal_cases.batches()
        if head == CAUSAL_LM:
            return rows
        rows = [{k: v for k, v in b.items() if k != "labels"} for b in rows]
        if head == BASE:
            return rows
        # a decoder's sequence head reads each row at its last non-pad token: right padding as pad ids, and labels
        padded = dict(rows[2], input_ids=rows[2]["input_ids"].masked_fill(rows[2]["attention_mask"] == 0,
                                                                          hf_config.pad_token_id))
        g = torch.Generator().manual_seed(4)
        return rows + [padded] + [{**b, **get_task(head).verify_labels(b, hf_config, g)} for b in rows[1:] + [padded]]
    c = hf_config
    types = getattr(c, "type_vocab_size", 0) > 1
    out = []
    for batch in encoder_cases.batches(c.vocab_size, c.pad_token_id, types, tiny.long_rows):
        out += [batch, {**batch, **encoder_cases.labels_for(head, batch, getattr(c, "num_labels", 2), c.vocab_size)}]
    return out


def grad_batch(family: Family, tiny: Tiny, head: str, hf_config) -> dict:
    """One padded batch with the head's labels (the longest one an encoder family is tested on)."""
    if tiny.inputs is not None:
        return tiny.inputs(head, hf_config)[-1]
    if is_causal(family):  # the padded batch (with the head's labels: the last for a sequence head)
        return inputs(family, tiny, head, hf_config)[2 if head in (BASE, CAUSAL_LM) else -1]
    c = hf_config
    batch = encoder_cases.batches(c.vocab_size, c.pad_token_id, False, tiny.long_rows)[-1]
    return {**batch, **encoder_cases.labels_for(head, batch, getattr(c, "num_labels", 2), c.vocab_size)}


def same_outputs(a, b, what: str) -> int:
    """Every output transformers returns equals kiln's bit for bit (shape, dtype, values; a loss over only
    ignored positions is NaN on both sides); router logits layer by layer. Returns how many were compared."""
    compared = 0
    for name in OUTPUTS:
        y = getattr(b, name, None)
        if y is None:
            continue
        x = getattr(a, name, None)
        assert x is not None, f"{what}: kiln returned no {name}"
        assert x.shape == y.shape and x.dtype == y.dtype, (what, name, x.shape, y.shape, x.dtype, y.dtype)
        torch.testing.assert_close(x, y, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{what} {name}: {m}")
        compared += 1
    theirs = getattr(b, "router_logits", None)
    if theirs is not None:
        ours = getattr(a, "router_logits", None)
        assert ours is not None and len(ours) == len(theirs), f"{what}: router logits of {len(theirs)} layers"
        for i, (x, y) in enumerate(zip(ours, theirs)):
            causal_cases.same(x, y, f"{what} router logits {i}")
    assert compared >= 1, f"{what}: nothing compared"
    return compared


def run_both(ours, hf, batches: list[dict], router_layers: int, what: str) -> None:
    """Each batch through both models; with router_layers, again asking for router logits (and the aux loss).
    Both models' weights are realigned first (kiln.interop.verify.realign), for these and later gradients."""
    realign(ours, hf)
    with torch.no_grad():
        for i, batch in enumerate(batches):
            same_outputs(ours(**batch), hf(**batch), f"{what} batch {i}")
            if router_layers:
                a, b = ours(**batch, output_router_logits=True), hf(**batch, output_router_logits=True)
                assert len(b.router_logits) == router_layers, f"{what}: transformers reports {len(b.router_logits)}"
                same_outputs(a, b, f"{what} batch {i} with router logits")


def backward(model, batch: dict) -> None:
    """The loss (or, for a base model, a fixed random projection of the hidden states) backwards."""
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    loss = getattr(out, "loss", None)
    if loss is None:
        h = out.last_hidden_state
        loss = (h * torch.randn(h.shape, generator=torch.Generator().manual_seed(3))).sum()
    loss.backward()


def hf_param_name(kiln_name: str, family: Family, head: str, hf_names: set[str]) -> str:
    """kiln parameter name -> the transformers model's: the same (HF module names, stacked experts in memory
    alike), the backbone under HF's prefix (`backbone.`, `model.language_model.`), or the head's key map."""
    candidates = [kiln_name]
    if kiln_name.startswith("model."):  # kiln's backbone is `model.`; a base HF model has no prefix
        rest = kiln_name[len("model."):]
        candidates.append(f"{family.hf_prefix}.{rest}" if head != BASE else rest)
    try:
        candidates.append(family.keymap(head).hf_name(kiln_name))
    except Exception:  # noqa: BLE001 - a stacked tensor has no single on-disk name; the in-memory ones are tried above
        pass
    for name in candidates:
        if name in hf_names:
            return name
    raise AssertionError(f"kiln parameter {kiln_name!r} has no transformers parameter (tried {candidates})")


def same_gradients(ours, hf, family: Family, head: str, what: str) -> None:
    """Every kiln gradient equals transformers' for the same parameter bit for bit (or both are None), and
    every transformers parameter with a gradient is matched (tied ones through the tensor they share)."""
    theirs = dict(hf.named_parameters(remove_duplicate=False))
    names = set(theirs)
    matched = set()
    for name, p in ours.named_parameters():
        if p.grad is None and name.startswith("visual.") and not any(n.startswith("model.visual.") for n in names):
            continue  # an image-text checkpoint read by transformers' text-only class: no tower on its side
        q = theirs[hf_param_name(name, family, head, names)]
        matched.add(id(q))
        assert (p.grad is None) == (q.grad is None), f"{what}: grad of {name} is None on one side only"
        if p.grad is not None:
            causal_cases.same(p.grad, q.grad, f"{what}: grad {name}")
    unmatched = sorted(n for n, q in theirs.items() if q.grad is not None and id(q) not in matched)
    assert not unmatched, f"{what}: transformers gradients kiln has no parameter for: {unmatched}"
