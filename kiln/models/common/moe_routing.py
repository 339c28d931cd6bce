"""DeepSeek-V3-style MoE: sigmoid routing with a balancing bias, group-limited top-k, shared experts.

As transformers 5 computes it (DeepseekV3TopkRouter / DeepseekV3MoE):
- logits = x W^T in float32, scores = sigmoid(logits) (N, E);
- choice = scores + `e_score_correction_bias` (a float32 buffer: it steers which experts are
  picked, never the weight they get);
- the E experts form `n_group` groups; a group scores the sum of its best two choices; only the
  best `topk_group` groups stay eligible; the top k experts among them are picked (unsorted);
- weights = the picked experts' plain scores, renormalised (+1e-20) when `norm_topk_prob`, times
  `routed_scaling_factor`;
- output = routed experts (stacked, `moe.Experts`, grouped matmuls) + always-on shared experts
  (one gated MLP of n_shared_experts * moe_intermediate_size).

In training mode the router also counts tokens per expert (`expert_load`) for aux-loss-free
balancing (`kiln.train.moe_balance`); the count never changes an output. The MoE block keeps the
last forward's router logits and picks (`router_logits`, `router_index`) for the sequence-wise
auxiliary loss (`kiln.train.moe_balance.sequence_aux_loss`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kiln.models.common.mlp import GatedMLP
from kiln.models.common.moe import Experts, KeepsRouting


class GroupLimitedRouter(nn.Module):
    e_score_correction_bias: torch.Tensor  # (a float32 buffer)

    def __init__(self, dim: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, dim))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))
        self.num_experts, self.top_k, self.n_group, self.topk_group = num_experts, top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.fast = False  # on (set_fast): `_pick`, fewer ops, the same experts
        self.expert_load: torch.Tensor | None = None  # (E,) tokens routed per expert since the last take_load()

    def reset_parameters_hf(self, std: float) -> None:
        nn.init.normal_(self.weight, 0.0, std)
        nn.init.zeros_(self.e_score_correction_bias)

    def _apply(self, fn, recurse: bool = True):
        # The bias stays float32 under model.to(bf16), as transformers keeps it (_keep_in_fp32_modules_strict):
        # in half precision the small steps of aux-loss-free balancing would round away.
        bias = self.e_score_correction_bias
        super()._apply(fn, recurse)
        moved = self.e_score_correction_bias
        if bias.dtype == torch.float32 and moved.dtype != torch.float32 and moved.is_floating_point():
            self.e_score_correction_bias = bias.to(device=moved.device)
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, C) -> router logits (N, E) float32, weights (N, k) float32, expert ids (N, k)."""
        E, G = self.num_experts, self.n_group
        logits = F.linear(x.float(), self.weight.float())  # (N, E)
        if self.fast:
            index = self._pick(logits.detach())
            weights = logits.gather(1, index).sigmoid()  # the same numbers; sigmoid's backward on (N, k) only
            return self._finish(logits, weights, index)
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)  # (N, G)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        eligible = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)  # (N, E)
        choice = choice.masked_fill(~eligible.bool(), float("-inf"))
        index = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]  # (N, k)
        return self._finish(logits, scores.gather(1, index), index)

    def _finish(self, logits: torch.Tensor, weights: torch.Tensor, index: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * self.routed_scaling_factor
        if self.training:
            self._count(index)
        return logits, weights, index

    @torch.no_grad()
    def _pick(self, logits: torch.Tensor) -> torch.Tensor:
        """The fast path's group-limited top-k (N, k): the same experts as the exact path (ties apart), found
        by gathering the kept groups' candidates instead of masking every other expert to -inf."""
        G, n = self.n_group, self.num_experts // self.n_group
        choice = (logits.sigmoid() + self.e_score_correction_bias).view(-1, G, n)  # (N, G, n)
        groups = choice.topk(2, dim=-1)[0].sum(dim=-1).topk(self.topk_group, dim=-1, sorted=False)[1]  # (N, g)
        kept = choice.gather(1, groups.unsqueeze(-1).expand(-1, -1, n)).flatten(1)  # (N, g * n)
        at = kept.topk(self.top_k, dim=-1, sorted=False)[1]  # (N, k) positions among the kept
        return groups.gather(1, at.div(n, rounding_mode="floor")) * n + at % n

    @torch.no_grad()
    def _count(self, index: torch.Tensor) -> None:
        counts = torch.bincount(index.reshape(-1), minlength=self.num_experts)  # (E,) int64
        self.expert_load = counts if self.expert_load is None else self.expert_load + counts

    def take_load(self) -> torch.Tensor:
        """Tokens per expert counted since the last call (zeros if none), and reset the count."""
        load = self.expert_load
        self.expert_load = None
        if load is None:
            load = torch.zeros(self.num_experts, dtype=torch.int64, device=self.weight.device)
        return load


class SharedExpertMoE(KeepsRouting):
    """Router (`gate`), stacked routed `experts` and `shared_experts`. Keeps the last router logits."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float, n_shared_experts: int, act: str = "silu"):
        super().__init__()
        self.experts = Experts(dim, hidden, num_experts, act)
        self.gate = GroupLimitedRouter(dim, num_experts, top_k, n_group, topk_group, norm_topk_prob,
                                       routed_scaling_factor)
        self.shared_experts = GatedMLP(dim, hidden * n_shared_experts, act)
        self.router_logits: torch.Tensor | None = None  # (N, E) float32, with gradients in training
        self.router_index: torch.Tensor | None = None   # (N, k) the experts picked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # Router and experts each take their own view of x, as transformers does: x's gradient then sums
        # the same three parts (router, experts, shared experts) in the same order, bit for bit.
        logits, weights, index = self.gate(x.view(-1, C))
        self.router_logits, self.router_index = logits, index  # (N, E), (N, k)
        routed = self.experts(x.view(-1, C), index, weights).view(B, T, C)
        return routed + self.shared_experts(x)
