"""Ring attention for context parallelism (`parallel.cp_method = "ring"`): keys and values travel rank to rank.

Each cp rank keeps its queries; the cp blocks of keys/values (one per rank, in the load-balanced
chunk layout of kiln.parallel.context) pass around the ring, one hop per step, while each rank attends
its queries to the block it holds and merges the partial results by their log-sum-exp (online
softmax). No rank ever holds the whole sequence's keys: per-rank memory for them is 1/cp of the
all-gather's, at the price of cp sequential hops (in the forward each overlaps a block's compute).

The backward runs the ring again: each block travels with the gradient of its keys/values, which
every rank adds its queries' share to, and one last hop brings it home. A block's gradient is the
flash-attention backward given the *merged* output and log-sum-exp, so nothing of size (queries x keys)
is kept. On CPU each block runs torch's fused CPU flash kernel and its backward (the ops SDPA itself
calls there); elsewhere a plain fp32 math version of the same. Partial results merge in fp32; no dropout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kiln.errors import KilnError


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """(B, H, L, S) fp32 scores of q (B, H, L, D) against k (B, H, S, D), -inf where `mask` is False."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    return s.masked_fill(~mask, float("-inf"))


def _probs(s: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(s - lse) with rows that see nothing (lse = -inf) at zero instead of NaN."""
    return torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse)[..., None])


def _fused(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")


def _additive(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A boolean mask as the additive one the fused CPU kernel takes (0 or -inf, in the queries' dtype)."""
    return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill_(~mask, float("-inf"))


def _block_forward(q, k, v, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 output (B, H, L, D), log-sum-exp (B, H, L)) of q against one block of keys (k, v have H heads);
    rows that see no key of the block get output 0 and log-sum-exp -inf."""
    if _fused(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=_additive(mask, q), scale=scale)
        sees = mask.any(-1).expand(lse.shape)  # the kernel reports 0, not -inf, for a row that sees nothing
        return out.float(), torch.where(sees, lse.float(), float("-inf"))
    s = _scores(q, k, mask, scale)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(_probs(s, lse), v.float()), lse


def _block_backward(g, q, k, v, out, lse, mask, scale) -> tuple[torch.Tensor, ...]:
    """This block's share of (dq, dk, dv) given the merged output and log-sum-exp of all blocks."""
    if _fused(q):
        lse = torch.where(torch.isneginf(lse), float("inf"), lse)  # a row that sees nothing: zero weights, not NaN
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g.to(q.dtype), q, k, v, out.to(q.dtype), lse, 0.0, False, attn_mask=_additive(mask, q), scale=scale)
    g = g.float()
    p = _probs(_scores(q, k, mask, scale), lse)  # (B, H, L, S)
    ds = p * (torch.matmul(g, v.float().transpose(-1, -2)) - (g * out).sum(-1, keepdim=True))
    return (torch.matmul(ds, k.float()) * scale, torch.matmul(ds.transpose(-1, -2), q.float()) * scale,
            torch.matmul(p.transpose(-1, -2), g))


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)  # kv head h serves query heads h*g..h*g+g-1


def _fold(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.unflatten(1, (-1, groups)).sum(2)  # query heads' shares back onto kv heads


class _Ring:
    """Point-to-point hops to the next cp rank and from the previous one."""

    def __init__(self, group):
        self.group = group
        n, r = dist.get_world_size(group), dist.get_rank(group)
        self.send_to = dist.get_global_rank(group, (r + 1) % n)
        self.recv_from = dist.get_global_rank(group, (r - 1) % n)

    def start(self, *tensors: torch.Tensor) -> tuple[list, list[torch.Tensor]]:
        bufs = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.send_to, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, self.recv_from, self.group) for b in bufs]
        return dist.batch_isend_irecv(ops), bufs


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask_blocks, scale, group):
        # q (B, H, L, D); k, v (B, KVH, L, D); mask_blocks[s]: (B', 1, L, L) mask against the block held at hop s
        cp, groups = len(mask_blocks), q.shape[1] // k.shape[1]
        ring = _Ring(group)
        out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)  # (B, H, L)
        kv = torch.stack([k, v])
        for hop in range(cp):
            pending = ring.start(kv) if hop < cp - 1 else None  # the next block is on its way while this one runs
            block_out, block_lse = _block_forward(q, _expand(kv[0], groups), _expand(kv[1], groups),
                                                  mask_blocks[hop], scale)
            new = torch.logaddexp(lse, block_lse)
            keep, add = (torch.where(torch.isneginf(new), 0.0, torch.exp(x - new))[..., None] for x in (lse, block_lse))
            out, lse = out * keep + block_out * add, new
            if pending is not None:
                for w in pending[0]:
                    w.wait()
                kv = pending[1][0]
        ctx.save_for_backward(q, k, v, out, lse, *mask_blocks)
        ctx.scale, ctx.group, ctx.cp = scale, group, cp
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, *mask_blocks = ctx.saved_tensors
        scale, cp, groups = ctx.scale, ctx.cp, q.shape[1] // k.shape[1]
        ring = _Ring(ctx.group)
        g = grad_out.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=q.device)  # travels with its block
        for hop in range(cp):
            bq, bk, bv = _block_backward(g, q, _expand(kv[0], groups), _expand(kv[1], groups), out, lse,
                                         mask_blocks[hop], scale)
            dq += bq
            dkv[0] += _fold(bk.float(), groups)
            dkv[1] += _fold(bv.float(), groups)
            # pass the block on with its gradient; after cp hops each gradient is one hop short of home
            works, bufs = ring.start(kv, dkv) if hop < cp - 1 else ring.start(dkv)
            for w in works:
                w.wait()
            if hop < cp - 1:
                kv, dkv = bufs
            else:
                dkv = bufs[0]
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, blocks: list[torch.Tensor],
                   scale: float, dropout_p: float, group) -> torch.Tensor:
    """q (B, H, L, D) against the whole row's keys, passed around the cp `group` as each rank's k, v (B, KVH, L, D).

    `mask` (B', 1, L, T) is this rank's global mask; `blocks[j]` the row positions rank j holds."""
    if dropout_p:
        raise KilnError("parallel.cp_method = 'ring' runs attention without dropout; set the model's "
                        "attention_dropout to 0 or use cp_method = 'allgather'")
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    # hop h holds rank (rank - h)'s block: its columns of the global mask
    mask_blocks = [mask[..., blocks[(rank - h) % cp]] for h in range(cp)]
    return _RingAttention.apply(q, k, v, mask_blocks, scale, group)
