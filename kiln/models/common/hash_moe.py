"""DeepSeek-V4's MoE: a hash router (experts fixed per token id) beside a scored top-k router, clamped SwiGLU.

As transformers computes it (DeepseekV4SparseMoeBlock):
- scores = score_fn(x W^T) (N, E), score_fn `sqrtsoftplus` (sqrt(softplus)) or `sigmoid`, in x's dtype;
- top-k layers pick the k best of scores + `e_score_correction_bias` (aux-loss-free balancing, as
  DeepSeek-V3's router: a subclass of `GroupLimitedRouter` with one group, so the balancing callback
  finds it); hash layers pick `tid2eid[token id]` (a frozen (vocab, k) table) and have no bias;
- weights = the picked scores / (their sum + 1e-20) * routed_scaling_factor (always renormalised);
- out = stacked routed experts + one shared expert, both SwiGLU with the gate clamped to <= limit and
  up to [-limit, limit] (swiglu_limit).
Only top-k layers keep `router_logits` (transformers records none for hash layers).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kiln.errors import ConfigError, KilnError
from kiln.models.common.activations import activation
from kiln.models.common.moe import Experts
from kiln.models.common.moe_routing import GroupLimitedRouter


def _sqrtsoftplus(x: torch.Tensor) -> torch.Tensor:
    return F.softplus(x).sqrt()


SCORE_FNS = {"sqrtsoftplus": _sqrtsoftplus, "sigmoid": torch.sigmoid}


def score_fn(name: str):
    if name not in SCORE_FNS:
        raise ConfigError(f"scoring_func {name!r} is not supported; choose one of: {', '.join(SCORE_FNS)}")
    return SCORE_FNS[name]


def _weights(scores: torch.Tensor, index: torch.Tensor, scale: float) -> torch.Tensor:
    w = scores.gather(1, index)
    return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * scale


class ScoredTopKRouter(GroupLimitedRouter):
    """Top-k over score_fn(logits) + bias; no expert groups. Counts expert load in training, as its base."""

    def __init__(self, dim: int, num_experts: int, top_k: int, routed_scaling_factor: float, scoring: str):
        super().__init__(dim, num_experts, top_k, 1, 1, True, routed_scaling_factor)
        self.score = score_fn(scoring)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (B, T, C) -> logits (N, E), weights (N, k), expert ids (N, k)."""
        logits = F.linear(x.reshape(-1, x.shape[-1]), self.weight)
        scores = self.score(logits)
        index = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        if self.training:
            self._count(index)
        return logits, _weights(scores, index, self.routed_scaling_factor), index


class HashRouter(nn.Module):
    """Experts chosen by token id (`tid2eid`, loaded from the checkpoint, never trained); weights as top-k's."""
    tid2eid: torch.Tensor  # (vocab, top_k) expert ids, a buffer

    def __init__(self, dim: int, num_experts: int, top_k: int, vocab_size: int, routed_scaling_factor: float,
                 scoring: str):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, dim))
        self.register_buffer("tid2eid", torch.zeros(vocab_size, top_k, dtype=torch.long))
        self.top_k, self.routed_scaling_factor = top_k, routed_scaling_factor
        self.score = score_fn(scoring)

    def reset_parameters_hf(self, std: float) -> None:
        nn.init.normal_(self.weight, 0.0, std)
        # A fresh table spreads token ids over the experts round robin, k distinct experts per token (transformers
        # leaves zeros, every token on expert 0, the checkpoint's table being what counts there)
        V, k = self.tid2eid.shape
        E = self.weight.shape[0]
        tokens, slots = torch.arange(V)[:, None], torch.arange(k)[None, :]
        self.tid2eid.copy_((tokens + slots * (E // k)) % E)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
        if input_ids is None:
            raise KilnError("a hash-routed MoE layer picks experts by token id: pass input_ids, not inputs_embeds")
        logits = F.linear(x.reshape(-1, x.shape[-1]), self.weight)
        index = self.tid2eid[input_ids.reshape(-1)].long()
        return logits, _weights(self.score(logits), index, self.routed_scaling_factor), index


class ClampedMLP(nn.Module):
    """The shared expert: down(act(min(gate(x), limit)) * clamp(up(x), -limit, limit))."""

    def __init__(self, dim: int, hidden: int, act: str, limit: float):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act_fn, self.limit = activation(act), limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(self.act_fn(gate) * up)


class HashOrTopKMoE(nn.Module):
    """Router (`gate`: HashRouter or ScoredTopKRouter), stacked clamped `experts`, one `shared_experts`."""

    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, routed_scaling_factor: float,
                 scoring: str, act: str, limit: float, hashed: bool, vocab_size: int):
        super().__init__()
        self.hashed = hashed
        self.gate = HashRouter(dim, num_experts, top_k, vocab_size, routed_scaling_factor, scoring) if hashed \
            else ScoredTopKRouter(dim, num_experts, top_k, routed_scaling_factor, scoring)
        self.experts = Experts(dim, hidden, num_experts, act, limit=limit)
        self.shared_experts = ClampedMLP(dim, hidden, act, limit)
        self.router_logits: torch.Tensor | None = None  # top-k layers only, as transformers records them
        self.router_index: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        # the router, the experts (a view taken first) and the shared expert each read x, in transformers'
        # order, so x's gradient adds their parts up the same way
        flat = x.view(-1, C)  # (N, C)
        if self.hashed:
            logits, weights, index = self.gate(x, input_ids)
        else:
            logits, weights, index = self.gate(x)
            self.router_logits, self.router_index = logits, index
        routed = self.experts(flat, index, weights).view(B, T, C)
        return routed + self.shared_experts(x)
