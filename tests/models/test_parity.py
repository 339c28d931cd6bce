"""One parity harness over the registry: every family x variant x head (its Tiny in kiln/models/<family>.py)
against transformers, bit for bit in fp32 on CPU, both ways.

HF -> kiln: the tiny checkpoint transformers wrote loads with nothing ignored or initialised; every output
(hidden states, logits, loss, router logits and aux loss) equals transformers' on padded and unpadded rows.
kiln -> HF: kiln's export holds the source's tensors byte for byte and loads into transformers with no
missing, unexpected or mismatched key, giving the same outputs again. Gradients: every parameter's, against
transformers loaded from the source and from kiln's export. Causal LMs: greedy tokens, the cached steps, and
a forward over the generated rows. The verify matrix's cells (`kiln verify-matrix`): one test per family x head.

Family-specific behaviour (caches' contents, fast kernels, other config shapes) stays in the family's file.
"""

from __future__ import annotations

import pytest
import torch
import transformers

from kiln.interop.export import export_model
from kiln.interop.matrix import run_cell
from kiln.interop.tiny import tiny_of
from kiln.interop.verify import compare_weights
from kiln.models import load_pretrained
from kiln.models.auto import REGISTRY
from kiln.models.tasks import CAUSAL_LM, get_task
from tests.models import parity
from tests.models.causal_cases import model_pair, same, same_greedy_tokens

transformers.logging.set_verbosity_error()


@pytest.mark.parametrize("model_type, variant, head", parity.head_cases())
def test_outputs_and_gradients_both_ways(model_type, variant, head, tiny_factory, tmp_path):
    family, tiny = REGISTRY[model_type], tiny_of(model_type)
    src = tiny_factory(model_type, head, **tiny.variants.get(variant, {}))
    auto = getattr(transformers, get_task(head).hf_auto)
    hf = auto.from_pretrained(src).eval()
    ours = load_pretrained(src)
    assert ours.family.model_type == model_type and ours.task == head
    assert ours.load_report.ignored == [] and ours.load_report.initialized == [], ours.load_report.lines()
    batches = parity.inputs(family, tiny, head, hf.config)
    routers = tiny.router_layers if head == CAUSAL_LM else 0  # the causal-LM head reports them
    parity.run_both(ours, hf, batches, routers, "HF -> kiln")

    out = export_model(ours, tmp_path / "export")
    check = compare_weights(out, src)
    assert check.ok, check.detail  # every tensor: same name, dtype and bytes
    back, info = auto.from_pretrained(out, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    assert type(back).__name__ == type(hf).__name__
    parity.run_both(ours, back.eval(), batches, routers, "kiln -> HF")

    # gradients; causal families in training mode (routers also count expert load, which must change nothing),
    # encoders in eval mode (their dropout is on in training)
    train = parity.is_causal(family)
    batch = parity.grad_batch(family, tiny, head, hf.config)
    ours.train(train)
    parity.backward(ours, batch)
    for name, theirs in (("source", hf), ("export", back)):
        theirs.train(train)
        parity.backward(theirs, batch)
        parity.same_gradients(ours, theirs, family, head, f"{name} {head}")


@pytest.mark.parametrize("model_type, variant", parity.causal_cases_())
def test_greedy_generation_and_cached_steps(model_type, variant, tiny_factory):
    tiny = tiny_of(model_type)
    ours, hf = model_pair(tiny_factory(model_type, CAUSAL_LM, **tiny.variants.get(variant, {})), eos=False)
    ids = torch.randint(4, 99, (2, 11), generator=torch.Generator().manual_seed(5))  # longer than sliding windows
    attn = torch.ones_like(ids)
    attn[1, :3] = 0  # a left-padded row in the batch
    prompts = [{"input_ids": ids[:1]}, {"input_ids": ids[:1, :2]}, {"input_ids": ids}]  # 2 < a conv window
    if "left-padded generation" not in tiny.skips:
        prompts.append({"input_ids": ids, "attention_mask": attn})
    if "greedy tokens vs transformers" in tiny.skips:  # (the family's reason there); the logits below still hold
        generated = hf.generate(**prompts[-1], max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    else:
        generated = same_greedy_tokens(ours, hf, prompts)
    with torch.no_grad():  # and a plain forward over the last generated rows
        same(ours(generated).logits, hf(generated).logits, "logits over the generated rows")
    # the cached steps themselves are bit-identical, not only their argmax: a prefill, one token, then several
    cache = ours.new_cache()
    if cache is None:  # a family that keeps no decoding cache re-reads the rows each step (the tokens above)
        return
    from transformers import DynamicCache

    hf_cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        for s, e in [(0, 6), (6, 7), (7, 11)]:
            same(ours(ids[:, s:e], cache=cache).logits,
                 hf(ids[:, s:e], past_key_values=hf_cache, use_cache=True).logits, f"cached step {s}:{e} logits")


@pytest.mark.parametrize("model_type, head", [pytest.param(t, h, id=f"{t}-{h}") for t, f in REGISTRY.items()
                                              for h in f.tasks])
def test_verify_matrix_cell(model_type, head, tiny_factory, tmp_path):
    """The `kiln verify-matrix` cell: built by transformers (make_tiny, as the command builds it; here the
    session's copy), exported by kiln, verified in transformers."""
    cell = run_cell(model_type, head, str(tiny_factory(model_type, head)), tmp_path)
    assert cell.ok and cell.max_diff == 0.0, cell.detail
