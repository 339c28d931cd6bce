"""The MoE fast path (`Experts.fast`, the group-limited router's `_pick`) against the exact path: outputs and
every gradient within 1e-5 relative, the same experts picked, and the reused gradient buffer never
overwriting a gradient someone still holds."""

from __future__ import annotations

import pytest
import torch

from kiln.interop.tiny import TINY
from kiln.models.auto import AutoConfig, from_config
from kiln.models.common.fast import fast_state, set_fast
from kiln.models.common.moe import MoEBlock, SharedExpertMoEBlock
from kiln.models.common.moe_routing import GroupLimitedRouter, SharedExpertMoE
from kiln.models.tasks import CAUSAL_LM


def _close_rel(fast: torch.Tensor, exact: torch.Tensor, rel: float, what: str) -> None:
    fast, exact = fast.detach(), exact.detach()
    scale = float(exact.abs().max())
    err = float((fast - exact).abs().max())
    assert err <= rel * max(scale, 1e-30), f"{what}: max abs diff {err:.3g} vs max {scale:.3g} (> {rel} relative)"


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


# 16-byte-aligned sizes take grouped_mm; odd ones the per-expert loop; 64 experts on 10 tokens leave many empty
@pytest.mark.parametrize("kind", ["deepseek", "qwen3_moe", "shared_gate"])
@pytest.mark.parametrize("dim,hidden,experts,tokens", [(64, 32, 16, 40), (36, 20, 16, 25), (32, 16, 64, 10)])
def test_fast_block_matches_the_exact_one(kind, dim, hidden, experts, tokens):
    block = _block(kind, dim, hidden, experts)
    x = torch.randn(2, tokens, dim, generator=torch.Generator().manual_seed(1))
    exact = _run(block, x, False)
    fast = _run(block, x, True)
    _close_rel(fast[0], exact[0], 1e-5, "output")
    _close_rel(fast[1], exact[1], 1e-5, "input gradient")
    assert fast[2].keys() == exact[2].keys()
    for name in exact[2]:
        _close_rel(fast[2][name], exact[2][name], 1e-5, f"grad {name}")
    # a control that can fail: the paths really differ (another rounding order), so the test compares two computations
    assert not all(torch.equal(fast[2][n], exact[2][n]) for n in exact[2])


def test_fast_router_picks_the_same_experts():
    router = GroupLimitedRouter(64, 64, 6, 8, 4, True, 2.5)
    torch.nn.init.normal_(router.weight, 0.0, 0.3)
    router.e_score_correction_bias.normal_(0.0, 0.05)
    x = torch.randn(3000, 64, generator=torch.Generator().manual_seed(2))
    logits, weights, index = router(x)
    router.fast = True
    f_logits, f_weights, f_index = router(x)
    assert torch.equal(f_logits, logits)
    picked, order = index.sort(dim=-1)
    f_picked, f_order = f_index.sort(dim=-1)
    assert torch.equal(f_picked, picked)  # the same set per token; the order within k may differ
    _close_rel(f_weights.gather(1, f_order), weights.gather(1, order), 1e-6, "routing weights")
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
    step()  # accumulation without zeroing adds up
    _close_rel(block.experts.gate_up_proj.grad, 2 * want, 1e-6, "accumulated gradient")


def test_frozen_experts_still_pass_the_input_gradient():
    block = _block("qwen3_moe", 64, 32, 16)
    block.experts.requires_grad_(False)
    x = torch.randn(1, 30, 64, generator=torch.Generator().manual_seed(4))
    exact = _run(block, x, False)
    fast = _run(block, x, True)
    _close_rel(fast[1], exact[1], 1e-5, "input gradient")
    assert block.experts.gate_up_proj.grad is None and block.experts.down_proj.grad is None


def test_fast_block_under_bf16_autocast():
    block = _block("deepseek", 64, 32, 16)
    x = torch.randn(2, 20, 64, generator=torch.Generator().manual_seed(5))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        exact = _run(block, x, False)
        fast = _run(block, x, True)
    assert fast[2]["experts.gate_up_proj"].dtype == torch.float32
    _close_rel(fast[0].float(), exact[0].float(), 2e-2, "bf16 output")
    _close_rel(fast[1].float(), exact[1].float(), 5e-2, "bf16 input gradient")


def test_deepseek_model_fast_step_matches_exact():
    model = from_config(AutoConfig.for_model("deepseek_v3", **TINY["deepseek_v3"]), task=CAUSAL_LM, seed=0).train()
    assert any(name.endswith("mlp.experts") for name in fast_state(model))
    assert any(name.endswith("mlp.gate") for name in fast_state(model))
    ids = torch.randint(4, 99, (2, 24), generator=torch.Generator().manual_seed(6))
    out = {}
    for fast in (False, True):
        set_fast(model, fast)
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out[fast] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    _close_rel(out[True][0], out[False][0], 1e-6, "loss")
    assert out[True][1].keys() == out[False][1].keys()
    for name, g in out[False][1].items():
        _close_rel(out[True][1][name], g, 1e-5, f"grad {name}")
