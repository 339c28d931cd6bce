"""The MoE fast path (`Experts.fast`, the group-limited router's `_pick`) against the exact path: outputs and
every gradient within the exact path's own rounding (estimated per tensor against float64,
tests/models/rounding.py; with 1 and 2 threads), the same experts picked, and the reused gradient buffer
never overwriting a gradient someone still holds."""

from __future__ import annotations

import copy

import pytest
import torch

from kiln.interop.tiny import TINY
from kiln.models.auto import AutoConfig, from_config
from kiln.models.common.fast import fast_state, set_fast
from kiln.models.common.moe import MoEBlock, SharedExpertMoEBlock
from kiln.models.common.moe_routing import GroupLimitedRouter, SharedExpertMoE
from kiln.models.tasks import CAUSAL_LM
from tests.models.rounding import (  # noqa: F401
    U_BF16,
    assert_all_within,
    assert_within,
    rounding_error,
    threads,  # (threads: a fixture)
)


def _block(kind: str, dim: int, hidden: int, experts: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "deepseek":
        block = SharedExpertMoE(dim, hidden, experts, 6, 8, 4, True, 2.5, 2)
    elif kind == "qwen3_moe":
        block = MoEBlock(dim, hidden, experts, 4, True)
    else:
        block = SharedExpertMoEBlock(dim, hidden, experts, 4, False, 2 * hidden)
    for p in block.parameters():
        torch.nn.init.normal_(p, 0.0, 0.1)
    if kind == "deepseek":
        block.gate.e_score_correction_bias.normal_(0.0, 0.05)
    return block.train()


def _run(block, x: torch.Tensor, fast: bool):
    set_fast(block, fast)
    block.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = block(x)
    (y * torch.linspace(-1, 1, y.shape[-1])).pow(2).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in block.named_parameters() if p.grad is not None}


def _tensors(run) -> dict:
    y, dx, grads = run
    return {"output": y, "input gradient": dx, **{f"grad {n}": g for n, g in grads.items()}}


def _exact64(block, x: torch.Tensor) -> dict:
    """The exact path on a float64 copy (taken before the block's first forward, which keeps router logits
    that cannot be copied): where its float32 rounding is measured."""
    return _tensors(_run(copy.deepcopy(block).double(), x.double(), False))


# 16-byte-aligned sizes take grouped_mm; odd ones the per-expert loop; 64 experts on 10 tokens leave many empty
@pytest.mark.parametrize("kind", ["deepseek", "qwen3_moe", "shared_gate"])
@pytest.mark.parametrize("dim,hidden,experts,tokens", [(64, 32, 16, 40), (36, 20, 16, 25), (32, 16, 64, 10)])
def test_fast_block_matches_the_exact_one(kind, dim, hidden, experts, tokens, threads):
    block = _block(kind, dim, hidden, experts)
    x = torch.randn(2, tokens, dim, generator=torch.Generator().manual_seed(1))
    ref64 = _exact64(block, x)
    exact = _run(block, x, False)
    fast = _run(block, x, True)
    assert_all_within(_tensors(fast), _tensors(exact), ref64, 2 * tokens, f"{kind}")
    # a control that can fail: the paths really differ (another rounding order), so the test compares two computations
    assert not all(torch.equal(fast[2][n], exact[2][n]) for n in exact[2])


def test_fast_router_picks_the_same_experts():
    router = GroupLimitedRouter(64, 64, 6, 8, 4, True, 2.5)
    torch.nn.init.normal_(router.weight, 0.0, 0.3)
    router.e_score_correction_bias.normal_(0.0, 0.05)
    x = torch.randn(3000, 64, generator=torch.Generator().manual_seed(2))
    logits, weights, index = router(x)
    _, weights64, index64 = copy.deepcopy(router).double()(x.double())
    router.fast = True
    f_logits, f_weights, f_index = router(x)
    assert torch.equal(f_logits, logits)
    picked, order = index.sort(dim=-1)
    f_picked, f_order = f_index.sort(dim=-1)
    assert torch.equal(f_picked, picked)  # the same set per token; the order within k may differ
    # the float64 router picks the same experts except where two scores tie within float32 rounding
    agree = (index64.sort(dim=-1)[0] == picked).all(-1)
    assert agree.float().mean() > 0.99
    want, want64 = weights.gather(1, order)[agree], weights64.gather(1, index64.sort(dim=-1)[1])[agree]
    e = rounding_error(want, want64, 64)  # the longest sum behind a weight: a router row over 64 inputs
    assert_within(f_weights.gather(1, f_order)[agree], want, e, "routing weights")
    assert max(len(set(row.tolist())) for row in f_index // 8) <= 4  # within topk_group groups of 8


def test_weight_gradient_buffer_is_reused_but_never_overwrites_a_held_gradient():
    block = _block("qwen3_moe", 64, 32, 16)
    set_fast(block, True)
    x = torch.randn(1, 40, 64, generator=torch.Generator().manual_seed(3))

    def step():
        block(x).pow(2).sum().backward()

    step()
    first = block.experts.gate_up_proj.grad
    want = first.clone()
    ptr = first.data_ptr()
    block.zero_grad(set_to_none=True)
    step()  # `first` is still held here: the second gradient must go elsewhere
    assert block.experts.gate_up_proj.grad.data_ptr() != ptr
    assert torch.equal(first, want)
    del first
    ptr = block.experts.gate_up_proj.grad.data_ptr()
    block.zero_grad(set_to_none=True)
    step()  # nothing holds the last buffer now: it is written again, no fresh pages
    assert block.experts.gate_up_proj.grad.data_ptr() == ptr
    step()  # accumulation without zeroing adds up: the same gradient twice, so exactly twice it
    assert torch.equal(block.experts.gate_up_proj.grad, 2 * want)


def test_frozen_experts_still_pass_the_input_gradient():
    block = _block("qwen3_moe", 64, 32, 16)
    block.experts.requires_grad_(False)
    x = torch.randn(1, 30, 64, generator=torch.Generator().manual_seed(4))
    ref64 = _exact64(block, x)
    exact = _run(block, x, False)
    fast = _run(block, x, True)
    e = rounding_error(exact[1], ref64["input gradient"], 30)
    assert_within(fast[1], exact[1], e, "input gradient")
    assert block.experts.gate_up_proj.grad is None and block.experts.down_proj.grad is None


def test_fast_block_under_bf16_autocast():
    block = _block("deepseek", 64, 32, 16)
    x = torch.randn(2, 20, 64, generator=torch.Generator().manual_seed(5))
    block64 = copy.deepcopy(block).double()
    ref64 = _tensors(_run(block64, x.double(), False))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        exact = _run(block, x, False)
        picked = block.router_index.sort(-1)[0]
        fast = _run(block, x, True)
    assert fast[2]["experts.gate_up_proj"].dtype == torch.float32
    # bf16 router scores pick other experts than float64 for a few tokens; the rest (each token's output
    # and input gradient depend on its own routing only) measure the exact path's bf16 rounding
    agree = (block64.router_index.sort(-1)[0] == picked).all(-1).view(2, 20)
    assert agree.float().mean() > 0.75, agree
    for i, what in enumerate(("output", "input gradient")):
        # n: bf16 rounds each op's result (matmuls accumulate in float32), ~6 ops along the block's chain
        e = rounding_error(exact[i][agree], ref64[what][agree], 6, u=U_BF16)
        assert_within(fast[i], exact[i], e, f"bf16 {what}")


def test_deepseek_model_fast_step_matches_exact():
    model = from_config(AutoConfig.for_model("deepseek_v3", **TINY["deepseek_v3"]), task=CAUSAL_LM, seed=0).train()
    assert any(name.endswith("mlp.experts") for name in fast_state(model))
    assert any(name.endswith("mlp.gate") for name in fast_state(model))
    ids = torch.randint(4, 99, (2, 24), generator=torch.Generator().manual_seed(6))
    ref64 = copy.deepcopy(set_fast(model, False)).double()
    loss64 = ref64(input_ids=ids, labels=ids).loss
    loss64.backward()
    out = {}
    for fast in (False, True):
        set_fast(model, fast)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out[fast] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads64 = {n: p.grad for n, p in ref64.named_parameters() if p.grad is not None}
    assert_all_within({"loss": out[True][0], **out[True][1]}, {"loss": out[False][0], **out[False][1]},
                      {"loss": loss64, **grads64}, ids.numel(), "deepseek_v3")
