"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): a residual of n parallel streams.

The residual is (B, T, n, C) instead of (B, T, C). Around each block (attention, then MLP) a
`HyperConnection` reads the n streams, RMS-normalised and flattened, through one linear map to
three sets of weights, as transformers computes them:
  pre  = sigmoid(scale_pre  * w_pre  + b_pre) + eps      (n)   collapses the streams into the block's input
  post = 2 * sigmoid(scale_post * w_post + b_post)       (n)   spreads the block's output back over the streams
  comb = Sinkhorn(softmax(scale_comb * w_comb + b_comb) + eps)  (n, n)  mixes the old streams (doubly stochastic)
and the block's residual update is  streams = post * out + comb^T @ streams  (`HyperConnection.merge`).
The weights are computed in float32 whatever the model's dtype. `HyperHead` collapses the streams
once more, with its own pre weights, before the final norm.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kiln.models.common.norms import UnweightedRMSNorm


class HyperConnection(nn.Module):
    def __init__(self, hidden_size: int, n: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.n, self.sinkhorn_iters, self.hc_eps = n, sinkhorn_iters, hc_eps
        self.input_norm = UnweightedRMSNorm(norm_eps)
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden_size))  # rows: pre (n), post (n), comb (n * n)
        self.base = nn.Parameter(torch.empty((2 + n) * n))
        self.scale = nn.Parameter(torch.empty(3))  # one scale each for pre, post and comb

    def reset_parameters_hf(self, std: float) -> None:
        nn.init.normal_(self.fn, 0.0, std)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams (B, T, n, C) -> post (B, T, n), comb (B, T, n, n) in float32, the block input (B, T, C)."""
        B, T = streams.shape[:2]
        n = self.n
        mixes = F.linear(self.input_norm(streams.view(B, T, -1).float()), self.fn.float())  # (B, T, (2 + n) n)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        comb_w, comb_b = comb_w.view(*comb_w.shape[:-1], n, n), comb_b.view(n, n)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w * comb_s + comb_b, dim=-1) + self.hc_eps
        # Sinkhorn-Knopp: columns, then (rows, columns) t - 1 more times, so mixing cannot grow the streams
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """The new streams (B, T, n, C): the block output `out` (B, T, C) spread by post, plus comb^T @ streams."""
        dtype = streams.dtype
        # comb is read transposed: new stream k takes sum_j comb[j, k] * old stream j
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                streams)


class HyperHead(nn.Module):
    """The final collapse of the n streams into one hidden state (B, T, C), before the model's last norm."""

    def __init__(self, hidden_size: int, n: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.eps = hc_eps
        self.input_norm = UnweightedRMSNorm(norm_eps)
        self.hc_fn = nn.Parameter(torch.empty(n, n * hidden_size))
        self.hc_base = nn.Parameter(torch.empty(n))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def reset_parameters_hf(self, std: float) -> None:
        nn.init.normal_(self.hc_fn, 0.0, std)
        nn.init.zeros_(self.hc_base)
        nn.init.ones_(self.hc_scale)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(self.input_norm(streams.flatten(2).float()), self.hc_fn.float())  # (B, T, n)
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
