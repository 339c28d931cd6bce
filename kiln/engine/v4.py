"""The engine's forward over DeepSeek-V4 (kiln.models.deepseek_v4), token-packed: hyper-connected streams, sink
attention over a sliding window plus compressed entries (HCA, CSA with its lightning indexer), hash / top-k MoE.

What a sequence holds, per layer (nothing else):
- its sliding window: the last sliding_window - 1 keys (= values), in its state slot as a ring (the key of
  position p at row p % (window - 1)). A key that falls out of the window is overwritten in place by a later
  one: no per-token block ever holds a window key, so nothing is kept past the window;
- on a layer with a compressor (and again for CSA's indexer, at index_head_dim), in its state slot: the raw
  kv / gate projections of the tokens of the unfinished window (rate rows), CSA's previous window (the Ca half
  its next entry pools) and the last completed entry whole;
- in the paged pool, the completed entries: entry w (head_dim numbers) is cut in `rate` pieces of
  ceil(head_dim / rate) and piece j is written in the slot of token (w + 1) * rate + j, as the tokens of the
  next window are fed. A token only ever writes its own slot (a sequence owns the blocks of the tokens it
  feeds; the prompt blocks a fork shares are never written), and a layer costs ceil(head_dim / rate) numbers
  per token: the compression the model has. The key slot carries the compressor's pieces, the value slot the
  indexer's (CSA); a sliding-only layer has zero-width slots.
A state is not kept at block boundaries, so no prefix is remembered and a preempted request recomputes from
its first token (the recurrent families' rules, kiln.engine.state).

Each row's attention reads a window tensor of fixed shape (sliding_window keys at positions p - W + 1 .. p)
and its sequence's entries in blocks of ENTRY_BLOCK (kiln.engine.v4_ops.sink_attend); CSA rows keep the
indexer's top index_topk visible entries (`exact.top_keys`: equal scores go to the earlier entry, where the
model's torch.topk leaves their order unstated). Projections, norms and hyper-connections run on fixed tiles;
the MoE one row per call. A step's one-token sequences run their state, ring, entries and attention together
(kiln.engine.v4_decode), each row's products of the shapes the per-sequence path uses. So a decode step, a prefill chunk and the scoring forward (`dense_many`: each
sequence from zeroed state, its entries computed from the whole sequence) give the same bits, and the model's
own forward agrees to fp32 rounding. Rope (YaRN included) comes from tables of the model's own rotary modules.
The multi-token-prediction block (V4ForCausalLM.enable_mtp) is a training head: generation never runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from kiln.engine.cache import BlockPool
from kiln.engine.exact import tiled, top_keys
from kiln.engine.runner import Piece, register
from kiln.engine.state import StateRunner
from kiln.engine.v4_decode import Group, series, window
from kiln.engine.v4_ops import (
    ENTRY_BLOCK,
    hc_head,
    hc_merge,
    hc_read,
    hc_split,
    moe_rows,
    pool_entries,
    rotate,
    sink_attend,
)
from kiln.models.common.causal_lm import ForCausalLM
from kiln.models.common.compressor import CSACompressor, HCACompressor, Indexer, WindowPool
from kiln.models.common.hash_moe import HashOrTopKMoE
from kiln.models.common.sink_attention import SinkAttention
from kiln.models.deepseek_v4 import V4Decoder, V4DecoderLayer


@dataclass
class Seq:
    """One sequence of a call: its rows [s, e), the position of its first row, and (in a step) its blocks and
    state slot."""
    s: int
    e: int
    start: int
    table: list[int] | None = None
    slot: int | None = None


class Call:
    """What a call reads and writes per sequence: the pool's state slot and entries in a step; in the scoring
    forward (pool None) zeroed state, no past entries, nothing written."""

    def __init__(self, runner: V4Runner, seqs: list[Seq], pool: BlockPool | None):
        self.runner, self.pool = runner, pool
        live = [q for q in seqs if q.e > q.s]
        # a step's one-token sequences run together (kiln.engine.v4_decode); the others one at a time
        ones = [q for q in live if q.e - q.s == 1] if pool is not None else []
        self.seqs = [q for q in live if pool is None or q.e - q.s > 1]
        self.group = Group.of(ones, runner.dev) if ones else None
        self.group_starts = [q.start for q in ones]

    def state(self, i: int, q: Seq) -> list[torch.Tensor]:
        if self.pool is None:
            return [torch.zeros(shape, dtype=dt, device=self.runner.dev)
                    for shape, dt in self.runner.state_shapes(i)]
        return [t[q.slot].clone() for t in self.pool.states[i]]

    def past(self, i: int, k: int, q: Seq, wp: WindowPool) -> torch.Tensor:
        """Series k's entries (K, d) wholly in the pool before the call: those whose next window is complete."""
        r, d = wp.rate, wp.head_dim
        K = max(0, q.start // r - 1)
        if self.pool is None or K == 0:
            return torch.zeros((0, d), dtype=self.runner.dt, device=self.runner.dev)
        assert q.table is not None
        store = (self.pool.keys, self.pool.values)[k][i]
        bs = self.pool.block_size
        blocks = torch.tensor(q.table[:((K + 1) * r + bs - 1) // bs], device=store.device)
        pieces = store.index_select(0, blocks).view(-1, store.shape[-1])[r:(K + 1) * r]
        return pieces.reshape(K, -1)[:, :d]

    def save(self, i: int, q: Seq, state: list[torch.Tensor], entries: list[torch.Tensor]) -> None:
        """The state after the call's last token into the slot; each fed token's piece of the entry before its
        window into its own slot."""
        if self.pool is None:
            return
        assert q.table is not None and q.slot is not None
        for t, v in zip(self.pool.states[i], state):
            t[q.slot].copy_(v)
        bs = self.pool.block_size
        for k, (wp, ents) in enumerate(zip(self.runner.series[i], entries)):
            r, d = wp.rate, wp.head_dim
            fed = list(range(max(q.start, r), q.start + q.e - q.s))
            if not fed:
                continue
            store = (self.pool.keys, self.pool.values)[k][i]
            P = store.shape[-1]
            cut = F.pad(ents, (0, r * P - d)).view(-1, r, P)
            rows = torch.tensor([p // r - 1 for p in fed], device=store.device)
            cols = torch.tensor([p % r for p in fed], device=store.device)
            slots = torch.tensor([q.table[p // bs] * bs + p % bs for p in fed], device=store.device)
            store.view(-1, P)[slots] = cut[rows, cols].to(store.dtype)


@register
class V4Runner(StateRunner):
    """Runs V4ForCausalLM (a ForCausalLM over `V4Decoder`)."""

    families = ("deepseek_v4",)

    @classmethod
    def accepts(cls, model: nn.Module) -> bool:
        backbone = getattr(model, "model", None)
        return (isinstance(model, ForCausalLM) and type(backbone) is V4Decoder
                and all(type(layer) is V4DecoderLayer and type(layer.self_attn) is SinkAttention
                        and type(layer.self_attn.compressor) in (type(None), HCACompressor, CSACompressor)
                        and type(layer.mlp) is HashOrTopKMoE for layer in backbone.layers))

    @classmethod
    def refuse(cls, model: nn.Module, name: str) -> str | None:
        if any(isinstance(p, DTensor) for p in model.parameters()):
            return (f"the generation engine does not run {name!r} under tensor parallelism (its heads and sinks "
                    "are split over ranks)")
        return None

    def _setup(self) -> None:
        b = self.v4 = cast(V4Decoder, self.backbone)
        self.dt, self.dev = cast(torch.dtype, self.dtype), cast(torch.device, self.device)
        self.window, self.hc = int(b.window), int(b.hc_mult)
        self.layers = [cast(V4DecoderLayer, layer) for layer in list(b.layers)[:self.num_layers]]
        like = torch.zeros((), dtype=self.dt, device=self.dev)
        pos = torch.arange(self.max_positions, device=self.dev)[None]
        tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

        def table(rotary: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
            # one table per distinct rope (every compressor shares the "compress" one: a release has 1M positions),
            # built once: a position's angles never depend on the call
            key = (tuple(torch.as_tensor(rotary.inv_freq).tolist()), float(cast(float, rotary.attention_scaling)))
            if key not in tables:
                cos, sin = rotary(like, pos)
                tables[key] = (cos[0].contiguous(), sin[0].contiguous())
            return tables[key]

        self.ropes = {name: table(rotary) for name, rotary in b.rotary.items()}
        # per layer, its compressor series: [compressor] (HCA) or [compressor, indexer] (CSA), with their rope
        self.series: list[list[WindowPool]] = []
        for layer in self.layers:
            c = layer.self_attn.compressor
            self.series.append([] if not isinstance(c, WindowPool) else
                               [c, c.indexer] if isinstance(c, CSACompressor) else [c])
        self.wp_ropes = {id(wp): table(wp.rotary_emb) for ser in self.series for wp in ser}

    def state_shapes(self, i: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        dt = self.dt
        shapes: list[tuple[tuple[int, ...], torch.dtype]] = [((self.window - 1, self.layers[i].self_attn.head_dim), dt)]
        for wp in self.series[i]:
            r, d = wp.rate, wp.head_dim
            width = 2 * d if wp.overlap else d
            shapes += [((r, width), dt)] * 2  # the unfinished window's kv, gate
            if wp.overlap:
                shapes += [((r, d), dt)] * 2  # the previous window's Ca kv, gate (CSA)
            shapes.append(((d,), dt))  # the last completed entry
        return shapes

    def new_pool(self, num_blocks: int, block_size: int, seqs: int = 1) -> BlockPool:
        slots: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        for ser in self.series:
            cut: list[tuple[int, ...]] = [(1, math.ceil(wp.head_dim / wp.rate)) for wp in ser] + [(0,), (0,)]
            slots.append((cut[0], cut[1]))
        return self.state_pool(num_blocks, block_size, seqs, slots)

    def _step_extras(self, pieces: list[Piece], rows: dict[int, tuple[int, int]], pool: BlockPool) -> tuple:
        return (Call(self, [Seq(*rows[j], p.start, p.table, p.state) for j, p in enumerate(pieces)], pool),)

    def _packed_extras(self, bounds: list[tuple[int, int]]) -> tuple:
        return (Call(self, [Seq(s, e, 0) for s, e in bounds], None),)

    # ---- the forward ----------------------------------------------------------------------------
    def _run(self, ids: torch.Tensor, positions: torch.Tensor, kv, call: Call | None = None) -> torch.Tensor:
        """`kv` (the attention runner's pool writer) goes unused: `call` says what each sequence reads and writes."""
        b, n = self.v4, self.hc
        assert call is not None, "V4Runner._run needs its Call (from _step_extras or _packed_extras)"
        x = b.embed_tokens(ids)  # (N, C)
        streams = x[:, None].expand(-1, n, -1).contiguous()  # (N, n, C)
        for i, layer in enumerate(self.layers):
            post, comb, h = hc_split(hc_read(layer.attn_hc, streams), n, x.dtype)
            streams = hc_merge(streams, self._attention(i, h, positions, call), post, comb)
            post, comb, h = hc_split(hc_read(layer.ffn_hc, streams), n, x.dtype)
            h = tiled(layer.post_attention_layernorm, h)
            streams = hc_merge(streams, moe_rows(layer.mlp, h, ids), post, comb)
        return hc_head(b.hc_head, streams)

    def _attention(self, i: int, x: torch.Tensor, positions: torch.Tensor, call: Call) -> torch.Tensor:
        """The attention block's output (N, C) for its input x (N, C)."""
        layer = self.layers[i]
        a, ser = layer.self_attn, self.series[i]
        H, D = a.num_heads, a.head_dim
        cos, sin = (t[positions] for t in self.ropes[a.rope_kind])
        ix = cast(Indexer, ser[1]) if len(ser) > 1 else None
        icos, isin = (t[positions] for t in self.wp_ropes[id(ix)]) if ix is not None else (cos, sin)

        def project(t: torch.Tensor, c: torch.Tensor, s: torch.Tensor, ic: torch.Tensor, is_: torch.Tensor):
            T = t.shape[0]
            h = layer.input_layernorm(t)
            q_resid = a.q_a_norm(a.q_a_proj(h))
            q = rotate(a.q_b_norm(a.q_b_proj(q_resid).view(T, H, D)), c, s)
            outs = [q.flatten(1), rotate(a.kv_norm(a.kv_proj(h)), c, s)]
            for wp in ser:
                outs += [wp.kv_proj(h), wp.gate_proj(h)]
            if ix is not None:
                iq = ix.q_b_proj(q_resid).view(T, ix.heads, ix.head_dim)
                outs += [rotate(iq, ic, is_).flatten(1), ix.scorer.weights_proj(h)]
            return torch.cat(outs, 1)

        widths = [H * D, D] + [2 * wp.head_dim if wp.overlap else wp.head_dim for wp in ser for _ in (0, 1)]
        if ix is not None:
            widths += [ix.heads * ix.head_dim, ix.heads]
        parts = tiled(project, x, cos, sin, icos, isin).split(widths, 1)
        q_all, kv_all = parts[0].view(-1, H, D), parts[1]
        y = q_all.new_empty((x.shape[0], H, D))
        if call.group is not None:
            y[call.group.rows] = self._decode(i, parts, q_all, call)
        for seq in call.seqs:
            rows = slice(seq.s, seq.e)
            start = seq.start
            state = call.state(i, seq)
            new_state = []
            windows, win_ok, ring = self._window(state[0], kv_all[rows], start)
            new_state.append(ring)
            entries, at = [], 1
            for k, wp in enumerate(ser):
                n_state = 5 if wp.overlap else 3
                ents, after = self._series(i, k, wp, seq, parts[2 + 2 * k][rows], parts[3 + 2 * k][rows],
                                           state[at:at + n_state], call)
                entries.append(ents)
                new_state += after
                at += n_state
            pos = positions[rows]
            if ser:
                r = ser[0].rate
                NB = max(1, math.ceil(entries[0].shape[0] / ENTRY_BLOCK))
                last = (pos + 1) // r - 1  # the last entry each row may read
                keep = torch.arange(NB * ENTRY_BLOCK, device=x.device)[None] <= last[:, None]
                if ix is not None:
                    keep = keep & self._index(ix, parts[-2][rows], parts[-1][rows], entries[1], NB, last)
                blocks = F.pad(entries[0], (0, 0, 0, NB * ENTRY_BLOCK - entries[0].shape[0]))
                y[rows] = sink_attend(q_all[rows], windows, win_ok, blocks.view(1, NB, ENTRY_BLOCK, D), keep,
                                      a.sinks, a.scaling)
            else:
                y[rows] = sink_attend(q_all[rows], windows, win_ok, None, None, a.sinks, a.scaling)
            call.save(i, seq, new_state, entries)

        def out(t: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
            t = rotate(t, c, -s)  # the values carried rope: turned back
            return a.o_b_proj(a.o_a_proj(t.reshape(t.shape[0], -1, a.group_width)).flatten(1))

        return tiled(out, y, cos, sin)

    def _decode(self, i: int, parts: tuple[torch.Tensor, ...], q_all: torch.Tensor, call: Call) -> torch.Tensor:
        """The attention of the step's one-token sequences (B, H, D), all at once; their state and pieces written."""
        g, pool = call.group, call.pool
        assert g is not None and pool is not None
        a, ser = self.layers[i].self_attn, self.series[i]
        D = a.head_dim
        q = q_all[g.rows]
        windows, win_ok = window(pool, i, g, parts[1][g.rows], self.window)
        if not ser:
            return sink_attend(q, windows, win_ok, None, None, a.sinks, a.scaling)
        r = ser[0].rate
        NB = max(1, math.ceil(max((p + 1) // r for p in call.group_starts) / ENTRY_BLOCK))
        entries, at = [], 1
        for k, wp in enumerate(ser):
            entries.append(series(pool, i, k, at, g, wp, parts[2 + 2 * k][g.rows], parts[3 + 2 * k][g.rows],
                                  self.wp_ropes[id(wp)], NB))
            at += 5 if wp.overlap else 3
        last = (g.pos + 1) // r - 1
        keep = torch.arange(NB * ENTRY_BLOCK, device=q.device)[None] <= last[:, None]
        if len(ser) > 1:
            ix = cast(Indexer, ser[1])
            keep = keep & self._index(ix, parts[-2][g.rows], parts[-1][g.rows], entries[1], NB, last)
        B = q.shape[0]
        return sink_attend(q, windows, win_ok, entries[0].view(B, NB, ENTRY_BLOCK, D), keep, a.sinks, a.scaling)

    def _window(self, ring: torch.Tensor, kv: torch.Tensor, start: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row's window keys (L, W, D) at positions p - W + 1 .. p, which exist (L, W), and the ring after."""
        W, L = self.window, kv.shape[0]
        past = torch.arange(start - (W - 1), start, device=kv.device)  # the positions the ring holds
        held = ring[past.remainder(max(W - 1, 1))] if W > 1 else ring
        held = held.masked_fill((past < 0)[:, None], 0.0)
        lin = torch.cat([held.to(kv.dtype), kv])  # positions start - W + 1 .. start + L - 1
        windows = lin.unfold(0, W, 1).transpose(1, 2)  # (L, W, D)
        ok = (torch.arange(W, device=kv.device)[None] + torch.arange(L, device=kv.device)[:, None]
              >= W - 1 - start)
        if W == 1:
            return windows, ok, ring
        tail = torch.arange(start + L - (W - 1), start + L, device=kv.device)
        new = ring.clone()
        new[tail[tail >= 0].remainder(W - 1)] = lin[(tail - start + W - 1)[tail >= 0]].to(ring.dtype)
        return windows, ok, new

    def _series(self, i: int, k: int, wp: WindowPool, seq: Seq, kv: torch.Tensor, gate: torch.Tensor,
                state: list[torch.Tensor], call: Call) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A compressor series over a sequence's rows: all its entries so far (E, d) (the pool's, the state's
        last one, this call's) and its state after the call."""
        r, d, start = wp.rate, wp.head_dim, seq.start
        cur_kv, cur_gate = state[0], state[1]
        u0, buf = start // r, start % r
        all_kv, all_gate = torch.cat([cur_kv[:buf], kv]), torch.cat([cur_gate[:buf], gate])
        nw = (start + kv.shape[0]) // r - u0
        new = kv.new_zeros((0, d))
        if nw:
            kvw = all_kv[:nw * r].view(nw, r, -1)
            gw = all_gate[:nw * r].view(nw, r, -1) + wp.position_bias
            if wp.overlap:  # slots [0, r): Ca of the window before (none before the first); [r, 2r): Cb
                prev_kv = torch.cat([state[2][None], kvw[:-1, :, :d]])
                prev_gate = torch.cat([(state[3] + wp.position_bias[:, :d])[None], gw[:-1, :, :d]])
                first = (torch.arange(nw, device=kv.device) + u0 == 0).view(nw, 1, 1)
                prev_kv = prev_kv.masked_fill(first, 0.0)
                prev_gate = prev_gate.masked_fill(first, float("-inf"))
                kvw, gw = torch.cat([prev_kv, kvw[..., d:]], 1), torch.cat([prev_gate, gw[..., d:]], 1)
            at = (torch.arange(nw, device=kv.device) + u0) * r
            cos, sin = self.wp_ropes[id(wp)]
            new = pool_entries(wp, kvw, gw, cos[at], sin[at])
        held = [call.past(i, k, seq, wp)] + ([state[-1][None]] if u0 >= 1 else [])
        entries = torch.cat([*held, new.to(held[0].dtype)])
        if call.pool is None:
            return entries, []
        rest = all_kv.shape[0] - nw * r
        after = [F.pad(all_kv[nw * r:], (0, 0, 0, r - rest)), F.pad(all_gate[nw * r:], (0, 0, 0, r - rest))]
        if wp.overlap:
            after += [all_kv[(nw - 1) * r:nw * r, :d], all_gate[(nw - 1) * r:nw * r, :d]] if nw else state[2:4]
        after.append(new[-1] if nw else state[-1])
        return entries, after

    def _index(self, ix: Indexer, iq: torch.Tensor, iw: torch.Tensor, keys: torch.Tensor, NB: int,
               last: torch.Tensor) -> torch.Tensor:
        """The entries (L, NB * ENTRY_BLOCK) the lightning indexer keeps for each row: its top index_topk
        among those the row may read (sum_h w_h relu(q_h . k) / sqrt(d), float32)."""
        L, Hi, di = iq.shape[0], ix.heads, ix.head_dim
        with torch.no_grad():  # a choice: nothing differentiable leaves it (the model's indexer runs so too)
            if keys.dim() == 2:  # one sequence's entries, read by every row
                keys = F.pad(keys, (0, 0, 0, NB * ENTRY_BLOCK - keys.shape[0]))[None]
            k = keys.float().view(-1, NB, ENTRY_BLOCK, di)  # (1 or L, NB, EB, di)
            scores = F.relu(torch.matmul(iq.view(L, 1, Hi, di).float(), k.transpose(-1, -2)))
            scores = scores * ix.scorer.softmax_scale  # (L, NB, Hi, EB)
            w = iw.float() * ix.scorer.weights_scaling  # (L, Hi)
            index = torch.matmul(w.view(L, 1, 1, Hi), scores).view(L, NB * ENTRY_BLOCK)  # summed over heads
            return top_keys(index, last, ix.topk)
