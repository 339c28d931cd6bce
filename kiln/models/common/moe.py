"""Sparse mixture-of-experts MLP (Qwen3-MoE style) and its load-balancing loss.

Choices, as transformers 5.23 computes them (default `grouped_mm` experts path):
- router: logits = x W^T; softmax in float32; top-k; optionally renormalised (`norm_topk_prob`);
- experts held stacked, gate_up_proj (E, 2I, C) and down_proj (E, C, I); the (token, slot) pairs
  are sorted by expert and run as two grouped matmuls (no Python loop over tokens);
- each pair's output is scaled by its routing weight, put back in token order and summed over the
  k slots (a reshape + sum, not index_add_), which fixes the accumulation order.
`Experts.fast` (set_fast) swaps this op sequence for one autograd node with a written-out backward
(moe_fast.py): the same function within fp32 rounding, for training.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kiln.models.common.activations import activation
from kiln.models.common.grouped import grouped_linear
from kiln.models.common.mlp import GatedMLP
from kiln.models.common.moe_fast import GradBuffer, routed_experts


class Router(nn.Module):
    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, dim))
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob

    def stacked(self, name: str) -> torch.Tensor:
        """The (E, out, in) weight `name` as the matmuls use it (Fp8Experts: dequantized from the stored FP8). The
        attribute itself stays the stored parameter: FSDP2 and `nn.Module._apply` find parameters by it."""
        return getattr(self, name)

    def reset_parameters_hf(self, std: float) -> None:
        nn.init.normal_(self.weight, 0.0, std)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x, self.weight)  # (N, E)
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        top, index = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        if self.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), index


class Experts(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, act: str = "silu", limit: float | None = None):
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, dim))  # (E, 2I, C): [gate; up]
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))         # (E, C, I)
        self.act_fn = activation(act)
        self.limit = limit  # DeepSeek-V4: gate clamped above, up clamped both ways (swiglu_limit)
        self.fast = False  # on (set_fast): SiLU experts run as one autograd node (moe_fast.py)
        self.grad_buffers = (GradBuffer(), GradBuffer())  # the fast path's gate_up_proj / down_proj gradients

    def glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate) * up for the fused (S, 2I) projection."""
        gate, up = gate_up.chunk(2, dim=-1)
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(min=-self.limit, max=self.limit)
        return self.act_fn(gate) * up

    def stacked(self, name: str) -> torch.Tensor:
        """The (E, out, in) weight `name` as the matmuls use it (Fp8Experts: dequantized from the stored FP8). The
        attribute itself stays the stored parameter: FSDP2 and `nn.Module._apply` find parameters by it."""
        return getattr(self, name)

    def reset_parameters_hf(self, std: float) -> None:
        nn.init.normal_(self.gate_up_proj, 0.0, std)
        nn.init.normal_(self.down_proj, 0.0, std)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.fast and type(self.act_fn) is nn.SiLU and self.limit is None and x.size(0):
            return routed_experts(x, index, weights, self.stacked("gate_up_proj"), self.stacked("down_proj"),
                                  self.grad_buffers)
        N, k = index.shape  # x (N, C); index, weights (N, k)
        expert_of, order = torch.sort(index.reshape(-1))  # (S,) pairs grouped by expert
        xs = x[order // k]  # (S, C)
        ws = weights.reshape(-1)[order]
        # histc counts per expert (float on CPU/MPS, int on CUDA, as transformers does for determinism)
        counts_in = expert_of.float() if x.device.type in ("cpu", "mps") else expert_of.int()
        counts = torch.histc(counts_in, bins=self.num_experts, min=0, max=self.num_experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = self.glu(grouped_linear(xs, self.stacked("gate_up_proj"), offsets))  # (S, I)
        ys = grouped_linear(h, self.stacked("down_proj"), offsets)  # (S, C)
        ys = ys * ws.unsqueeze(-1)
        back = torch.empty_like(order)
        back[order] = torch.arange(order.size(0), device=x.device)
        return ys[back].view(N, k, -1).sum(dim=1).to(x.dtype)  # (N, C)


class KeepsRouting(nn.Module):
    """A block that keeps its last forward's routing (`router_logits`, `router_index`) for the aux loss.

    Copies and pickles leave that routing behind: it belongs to one forward (holding its graph in training),
    and a tensor inside a graph cannot be deep-copied.
    """

    _ROUTING = ("router_logits", "router_index")

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        for name in self._ROUTING:
            if name in state:
                state[name] = None
        return state


class MoEBlock(KeepsRouting):
    """Router (`gate`) + stacked `experts`. Keeps the last router logits for the aux loss."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool, act: str = "silu"):
        super().__init__()
        self.gate = Router(dim, num_experts, top_k, norm_topk_prob)
        self.experts = Experts(dim, hidden, num_experts, act)
        self.router_logits: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.view(-1, C)  # (N, C)
        logits, weights, index = self.gate(flat)
        self.router_logits = logits  # (N, E)
        return self.experts(flat, index, weights).reshape(B, T, C)


def load_balancing_loss(router_logits: tuple[torch.Tensor, ...], num_experts: int, top_k: int,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Switch-Transformer balance loss: E * sum_e (share of top-k picks to e) * (mean router prob of e).

    Counts and probabilities are summed over layers, then divided by the (unpadded) token count.
    """
    device = router_logits[0].device
    picks = torch.zeros(num_experts, dtype=torch.float32, device=device)
    probs_sum = torch.zeros(num_experts, dtype=torch.float32, device=device)
    rows: float | torch.Tensor = 0.0  # a count, or the mask's sum (a tensor)
    flat_mask = None if attention_mask is None else attention_mask.reshape(-1).to(device=device, dtype=torch.float32)
    count_dtype = torch.float32 if device.type in ("cpu", "mps") else torch.int32
    for logits in router_logits:
        probs = F.softmax(logits.to(device), dim=-1)  # (N, E)
        _, chosen = torch.topk(probs, top_k, dim=-1)
        if flat_mask is None:
            picks = picks + torch.histc(chosen.reshape(-1).to(count_dtype), bins=num_experts, min=0, max=num_experts)
            probs_sum = probs_sum + probs.float().sum(dim=0)
            rows = rows + probs.shape[0]
        else:
            picks = picks + torch.zeros(num_experts, dtype=torch.float32, device=device).scatter_add_(
                0, chosen.reshape(-1), flat_mask.repeat_interleave(top_k))
            probs_sum = probs_sum + (probs.float() * flat_mask.unsqueeze(-1)).sum(dim=0)
            rows = rows + flat_mask.sum()
    return torch.sum((picks / rows) * (probs_sum / rows).unsqueeze(0)) * num_experts


class SharedExpertMoEBlock(MoEBlock):
    """MoEBlock plus a dense `shared_expert` every token takes, scaled by sigmoid(`shared_expert_gate`(x)).

    Qwen2-MoE / Qwen3-Next / Qwen3.5-MoE: out = routed(x) + sigmoid(x w_g) * shared(x).
    """

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 shared_hidden: int, act: str = "silu"):
        super().__init__(dim, hidden, num_experts, top_k, norm_topk_prob, act)
        self.shared_expert = GatedMLP(dim, shared_hidden, act)
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.view(-1, C)  # (N, C)
        shared = self.shared_expert(flat)
        # one view of x feeds every branch, so its gradient adds up in transformers' order
        logits, weights, index = self.gate(flat)
        self.router_logits = logits  # (N, E)
        routed = self.experts(flat, index, weights)
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared  # (N, 1) gate per token
        return (routed + shared).reshape(B, T, C)
