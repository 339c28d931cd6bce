"""DeepSeek-V4's pieces for the engine (kiln.engine.v4) with shapes that depend on nothing but the model.

Each function computes what its model module computes (common/hyper.py, common/compressor.py,
common/sink_attention.py), with the same ops where they are row-wise and on fixed tiles (`exact.tiled`), but
every sum over a small axis taken in index order (`exact.seqsum`), every softmax written out (max, `lanewise`
exp, an ordered sum) and every transcendental through `exact.lanewise`: a token's numbers never depend on the
rows beside it, so a decode step, a prefill chunk and the scoring forward give the same bits. Against the
model's own forward they agree to fp32 rounding (its sums run in other orders).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from kiln.engine.exact import lanewise, seqsum, tiled
from kiln.models.common.compressor import WindowPool
from kiln.models.common.hash_moe import HashOrTopKMoE, HashRouter, ScoredTopKRouter
from kiln.models.common.hyper import HyperConnection, HyperHead
from kiln.models.common.rope import apply_rope_tail

ENTRY_BLOCK = 16  # compressed entries per attention block: a fixed split, so a row's sums never see the count
EXPERT_TILE = 4   # rows per routed-expert call: fixed (a row's bits see only its own row), small (decode sends
                  # one or two rows to most experts)


def softmax_rows(z: torch.Tensor, dim: int) -> torch.Tensor:
    """float32 softmax over `dim`: max (exact in any order), lanewise exp, an ordered sum."""
    z = z.float()
    e = lanewise(torch.exp, z - z.amax(dim, keepdim=True))
    return e / seqsum(e, dim).unsqueeze(dim)


def hc_read(hc: HyperConnection, streams: torch.Tensor) -> torch.Tensor:
    """streams (N, n, C) -> [post (n) | comb (n * n) | the block input (C)] (N, n + n * n + C) float32, as
    HyperConnection.forward (Sinkhorn included), on tiles."""
    n = hc.n

    def tile(s: torch.Tensor) -> torch.Tensor:
        T = s.shape[0]
        mixes = F.linear(hc.input_norm(s.reshape(T, -1).float()), hc.fn.float())  # (T, (2 + n) n)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = hc.base.split([n, n, n * n])
        pre_s, post_s, comb_s = hc.scale.unbind(0)
        pre = lanewise(torch.sigmoid, pre_w * pre_s + pre_b) + hc.hc_eps
        post = 2 * lanewise(torch.sigmoid, post_w * post_s + post_b)
        comb = softmax_rows(comb_w.view(T, n, n) * comb_s + comb_b.view(n, n), -1) + hc.hc_eps
        comb = comb / (seqsum(comb, -2).unsqueeze(-2) + hc.hc_eps)
        for _ in range(hc.sinkhorn_iters - 1):
            comb = comb / (seqsum(comb, -1).unsqueeze(-1) + hc.hc_eps)
            comb = comb / (seqsum(comb, -2).unsqueeze(-2) + hc.hc_eps)
        collapsed = seqsum(pre.unsqueeze(-1) * s, 1).to(s.dtype)
        return torch.cat([post, comb.flatten(1), collapsed.float()], 1)

    return tiled(tile, streams)


def hc_split(read: torch.Tensor, n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    post, comb, x = read.split([n, n * n, read.shape[1] - n - n * n], 1)
    return post, comb.view(-1, n, n), x.to(dtype)


def hc_merge(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """HyperConnection.merge on tiles: post * out + comb^T @ streams (N, n, C)."""
    return tiled(HyperConnection.merge, streams, out, post, comb)


def hc_head(head: HyperHead, streams: torch.Tensor) -> torch.Tensor:
    """HyperHead.forward on tiles: (N, n, C) -> (N, C)."""

    def tile(s: torch.Tensor) -> torch.Tensor:
        mixes = F.linear(head.input_norm(s.flatten(1).float()), head.hc_fn.float())  # (T, n)
        pre = lanewise(torch.sigmoid, mixes * head.hc_scale.float() + head.hc_base.float()) + head.eps
        return seqsum(pre.unsqueeze(-1) * s, 1).to(s.dtype)

    return tiled(tile, streams)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, ..., D) with its trailing rope dims turned by each row's cos, sin (T, rope / 2) (elementwise)."""
    return apply_rope_tail(x.view(x.shape[0], -1, x.shape[-1]), cos, sin).view(x.shape)


def pool_entries(wp: WindowPool, kv: torch.Tensor, gate: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> torch.Tensor:
    """Compressed entries (W, d) from W windows' slots kv, gate (W, S, d) (gate with position_bias, -inf on
    an empty slot), rotated by cos, sin (W, rope / 2) of each entry's position: the softmax-weighted sum over
    the slots in slot order, kv_norm on tiles, rope (WindowPool.forward's ops)."""
    w = softmax_rows(gate, 1).to(kv.dtype)
    summed = seqsum(kv * w, 1)  # (W, d)
    return rotate(tiled(wp.kv_norm, summed), cos, sin)


def sink_attend(q: torch.Tensor, window: torch.Tensor, win_ok: torch.Tensor, entries: torch.Tensor | None,
                ent_ok: torch.Tensor | None, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Sink attention of query rows over their own window keys and their sequence's compressed entries.

    q (T, H, D); window (T, W, D) the keys (= values) at positions p - W + 1 .. p, win_ok (T, W) which of them
    exist; entries (1, NB, ENTRY_BLOCK, D) in entry order, ent_ok (T, NB * ENTRY_BLOCK) which each row reads
    (None for a sliding-only layer); sinks (H,). softmax([scores | sink]) without the sink column, times the
    values: the max is exact in any order, the sums run in index order, blocks a row cannot read add exact
    zeros. (T, H, D) in q's dtype."""
    T = q.shape[0]
    qf = q.float()
    sw = torch.matmul(qf, window.float().transpose(1, 2)) * scale  # (T, H, W): one (H x D) @ (D x W) per row
    sw = sw.masked_fill(~win_ok[:, None], float("-inf"))
    m = torch.maximum(sw.amax(-1), sinks.float()[None])  # (T, H)
    if entries is not None:
        assert ent_ok is not None
        NB = entries.shape[1]
        ke = entries.float()
        se = torch.matmul(qf[:, None], ke.transpose(-1, -2)) * scale  # (T, NB, H, EB)
        se = se.masked_fill(~ent_ok.view(T, NB, 1, -1), float("-inf"))
        m = torch.maximum(m, se.amax(dim=(1, 3)))
    pw = lanewise(torch.exp, sw - m[..., None])
    l = seqsum(pw, -1)  # (T, H)
    o = torch.matmul(pw, window.float())  # (T, H, D)
    if entries is not None:
        pe = lanewise(torch.exp, se - m[:, None, :, None])
        l = l + seqsum(seqsum(pe, 3), 1)
        o = o + seqsum(torch.matmul(pe, ke), 1)  # (H x EB) @ (EB x D) per block, summed in order
    l = l + lanewise(torch.exp, sinks.float()[None] - m)
    return (o / l[..., None]).to(q.dtype)


def moe_rows(moe: HashOrTopKMoE, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """HashOrTopKMoE.forward for normed rows x (N, C) of token ids (N,): the router on tiles (scores lanewise;
    top-k, or the hash table, per row); each expert runs the rows routed to it on tiles of fixed shape (as every
    row-wise product here: a row's bits depend on its own row alone); each row's k outputs are weighted and
    summed over its slots in expert order; then the shared expert on tiles. The model's forward (grouped
    products over every row's pairs) agrees to fp32 rounding."""
    gate, experts, shared = moe.gate, moe.experts, moe.shared_experts
    logits = tiled(lambda t: F.linear(t, gate.weight), x)  # (N, E)
    scores = lanewise(gate.score, logits)
    if isinstance(gate, HashRouter):
        index = gate.tid2eid[ids].long()
    else:
        assert isinstance(gate, ScoredTopKRouter)
        bias = gate.e_score_correction_bias
        index = torch.topk(scores + bias, gate.top_k, dim=-1).indices
        if gate.training:
            gate._count(index)  # the balancing callback's load, as the model's router counts it
    index = index.sort(-1).values  # the slots in expert order: a fixed summation order
    weights = scores.gather(1, index)
    weights = weights / (seqsum(weights, 1)[:, None] + 1e-20) * gate.routed_scaling_factor
    gate_up, down = experts.stacked("gate_up_proj"), experts.stacked("down_proj")
    limit = experts.limit

    def expert(t: torch.Tensor, e: int) -> torch.Tensor:
        g, u = F.linear(t, gate_up[e]).chunk(2, dim=-1)
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        return F.linear(lanewise(experts.act_fn, g) * u, down[e])

    N, k = index.shape
    outs = x.new_zeros((N, k, x.shape[1]))
    for e in torch.unique(index).tolist():
        rows, slots = (index == e).nonzero(as_tuple=True)
        outs = outs.index_put((rows, slots), tiled(lambda t, e=e: expert(t, e), x[rows], tile=EXPERT_TILE))
    routed = outs[:, 0] * weights[:, :1].to(x.dtype)
    for j in range(1, k):
        routed = routed + outs[:, j] * weights[:, j:j + 1].to(x.dtype)

    def shared_tile(t: torch.Tensor) -> torch.Tensor:
        g = shared.gate_proj(t).clamp(max=shared.limit)
        u = shared.up_proj(t).clamp(min=-shared.limit, max=shared.limit)
        return shared.down_proj(lanewise(shared.act_fn, g) * u)

    return routed + tiled(shared_tile, x)
