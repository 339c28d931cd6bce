"""DeepSeek-V4's decode rows on the engine (kiln.engine.v4), all at once: every sequence that feeds one token in a
step reads and writes its state slot, window ring and entries through gathers and scatters over the whole group,
and its attention (the indexer's choice included) is one batched call.

Each row's numbers are those of kiln.engine.v4's per-sequence path: its window is the same (W, D) tensor, its
entries the same values in blocks of ENTRY_BLOCK (the group's block count is its longest row's: blocks a row cannot
read add exact zeros), and every product is one per row and block of the shape that path uses. So a row's bits do
not depend on which rows share the step, and a decode step equals the prefill chunk and the scoring forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from kiln.engine.cache import BlockPool
from kiln.engine.v4_ops import ENTRY_BLOCK, pool_entries
from kiln.models.common.compressor import WindowPool


@dataclass
class Group:
    """The decode rows of a step: their rows in the call, positions, state slots and block tables (padded with
    block 0, never read past a row's own tokens)."""
    rows: torch.Tensor    # (B,)
    pos: torch.Tensor     # (B,)
    slots: torch.Tensor   # (B,)
    tables: torch.Tensor  # (B, T)

    @classmethod
    def of(cls, seqs: list, device: torch.device) -> Group:
        width = max(len(q.table) for q in seqs)
        tables = [q.table + [0] * (width - len(q.table)) for q in seqs]
        return cls(torch.tensor([q.s for q in seqs], device=device),
                   torch.tensor([q.start for q in seqs], device=device),
                   torch.tensor([q.slot for q in seqs], device=device),
                   torch.tensor(tables, device=device).view(len(seqs), width))


def window(pool: BlockPool, i: int, g: Group, kv: torch.Tensor, W: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's window keys (B, W, D) at positions p - W + 1 .. p and which exist (B, W); the new key into the
    ring (the one row of it a token writes)."""
    ok = torch.arange(W, device=kv.device)[None] >= (W - 1 - g.pos)[:, None]
    if W == 1:
        return kv[:, None], ok
    ring = pool.states[i][0]
    past = g.pos[:, None] + torch.arange(-(W - 1), 0, device=kv.device)[None]  # (B, W - 1)
    held = ring[g.slots[:, None], past.remainder(W - 1)].masked_fill((past < 0)[..., None], 0.0)
    ring[g.slots, g.pos.remainder(W - 1)] = kv.to(ring.dtype)
    return torch.cat([held.to(kv.dtype), kv[:, None]], 1), ok


def series(pool: BlockPool, i: int, k: int, at: int, g: Group, wp: WindowPool, kv: torch.Tensor,
           gate: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], blocks: int) -> torch.Tensor:
    """A compressor series over the group's tokens: each row's entries (B, blocks * ENTRY_BLOCK, d) (the pool's,
    the state's last one, the one its token completes; zero past them), its state slot and entry piece written.
    `at`: the series' first tensor in the layer's state list."""
    r, d, bs = wp.rate, wp.head_dim, pool.block_size
    dev = kv.device
    st = pool.states[i][at:at + (5 if wp.overlap else 3)]
    cur_kv, cur_gate, last = st[0][g.slots], st[1][g.slots], st[-1][g.slots]
    buf, u0 = g.pos.remainder(r), g.pos // r
    slot_ix = torch.arange(r, device=dev)[None]
    at_buf = (slot_ix == buf[:, None])[..., None]
    win_kv = torch.where(at_buf, kv[:, None].to(cur_kv.dtype), cur_kv)  # (B, r, width): rows > buf unread
    win_gate = torch.where(at_buf, gate[:, None].to(cur_gate.dtype), cur_gate)
    done = buf == r - 1  # the token completes its window: entry u0
    # the state after: the unfinished window's rows (zero past the token; all zero once complete)
    keep_rows = ((slot_ix <= buf[:, None]) & ~done[:, None])[..., None]
    st[0][g.slots] = win_kv.masked_fill(~keep_rows, 0.0)
    st[1][g.slots] = win_gate.masked_fill(~keep_rows, 0.0)
    fin = done.nonzero().view(-1)
    new = kv.new_zeros((0, d))
    if fin.numel():
        kvw, gw = win_kv[fin], win_gate[fin] + wp.position_bias
        if wp.overlap:  # slots [0, r): Ca of the window before (none before the first); [r, 2r): Cb
            first = (u0[fin] == 0).view(-1, 1, 1)
            prev_kv = st[2][g.slots[fin]].masked_fill(first, 0.0)
            prev_gate = (st[3][g.slots[fin]] + wp.position_bias[:, :d]).masked_fill(first, float("-inf"))
            st[2][g.slots[fin]], st[3][g.slots[fin]] = win_kv[fin, :, :d], win_gate[fin, :, :d]
            kvw, gw = torch.cat([prev_kv, kvw[..., d:]], 1), torch.cat([prev_gate, gw[..., d:]], 1)
        cos, sin = rope
        ats = u0[fin] * r
        new = pool_entries(wp, kvw, gw, cos[ats], sin[ats])
        st[-1][g.slots[fin]] = new.to(st[-1].dtype)
    # the token's piece of entry u0 - 1 (the state's last) into its own slot
    store = (pool.keys, pool.values)[k][i]
    P = store.shape[-1]
    flat = store.view(-1, P)
    own = g.tables.gather(1, (g.pos // bs)[:, None]).view(-1) * bs + g.pos.remainder(bs)
    writes = (g.pos >= r).nonzero().view(-1)
    if writes.numel():
        pieces = F.pad(last[writes], (0, r * P - d)).view(-1, r, P)
        flat[own[writes]] = pieces[torch.arange(writes.numel(), device=dev), buf[writes]].to(store.dtype)
    # every row's entries: w < u0 - 1 from the pool (piece j of entry w in the slot of token (w + 1) r + j),
    # u0 - 1 the state's last, u0 the new one (if complete)
    E = blocks * ENTRY_BLOCK
    w = torch.arange(E, device=dev)
    tok = (w[:, None] + 1) * r + torch.arange(r, device=dev)[None]  # (E, r)
    col = (tok // bs).clamp(max=g.tables.shape[1] - 1)
    slot = g.tables[:, col.view(-1)].view(-1, E, r) * bs + (tok % bs)[None]
    ents = flat[slot].view(-1, E, r * P)[..., :d].to(kv.dtype)  # (B, E, d): unread slots may hold anything
    K = (u0 - 1).clamp(min=0)[:, None]
    ents = torch.where((w[None] < K)[..., None], ents, torch.zeros((), dtype=ents.dtype, device=dev))
    ents = torch.where(((w[None] == u0[:, None] - 1) & (u0[:, None] >= 1))[..., None], last[:, None].to(ents.dtype),
                       ents)
    if fin.numel():
        full = torch.zeros((fin.numel(), E, d), dtype=ents.dtype, device=dev)
        full[torch.arange(fin.numel(), device=dev), u0[fin]] = new.to(ents.dtype)
        is_new = torch.zeros((kv.shape[0], E, 1), dtype=torch.bool, device=dev)
        is_new[fin] = (w[None] == u0[fin][:, None])[..., None]
        spread = torch.zeros_like(ents)
        spread[fin] = full
        ents = torch.where(is_new, spread, ents)
    return ents
