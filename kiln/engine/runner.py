"""The engine's forward over kiln's pre-norm attention decoders (Llama, Qwen2, Qwen3, Qwen3-MoE), token-packed,
and the registry of runners (one class per model kind, each in its own module: kiln.engine.mla latent
attention, kiln.engine.dsa its sparse kind, kiln.engine.hybrid Gated DeltaNet hybrids, kiln.engine.mamba Mamba;
kiln.engine's __init__ imports them all).

A step feeds a flat list of tokens from many sequences (decode tokens and prefill chunks side by side, no
padding to a common length). Everything row-wise runs on fixed tiles (`exact.tiled`); attention runs per
sequence over its blocks of the paged cache (`exact.attend`). The same layer code serves `dense`: one whole
sequence with its keys in a private buffer instead of the pool (the scoring forward, kiln.engine.score), so the
engine's log-probs and the scoring forward's are the same bits.

The runner reads the model's own modules (projections, norms, MLPs, LoRA-wrapped or not) and calls them on
tiles. `unsupported(model)` names what no runner runs exactly: the registered runner classes are matched by the
classes of the model's modules (`accepts`), never by the family's name, and refuse what they cannot run exactly
(`refuse`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.engine.cache import BlockPool
from kiln.engine.exact import (
    attend,
    head_tiles,
    lanewise,
    pack_head,
    packed_product,
    rope_table,
    tiled,
    tiled_menu,
    vocab_product,
)
from kiln.errors import KilnError
from kiln.models.common.causal_lm import ForCausalLM
from kiln.models.common.decoder import Attention, Decoder, DecoderLayer
from kiln.models.common.mlp import GatedMLP
from kiln.models.common.rope import rotate_half


@dataclass
class Piece:
    """The tokens one sequence feeds in a step: ids at positions start.., its block table (covering them all)."""
    ids: list[int]
    start: int
    table: list[int]
    logits: bool  # whether its last token's logits are wanted
    state: int | None = None  # its recurrent-state slot in the pool (families with state)
    images: Any = None  # engvis: its request's kiln.engine.vision.ImagePrompt (image-text prompts)


RUNNERS: list[type[DecoderRunner]] = []  # every runner class, by the model kind it runs (`register`)


def register(cls: type[DecoderRunner]) -> type[DecoderRunner]:
    """Add a runner class to the registry (its module is imported by kiln.engine's __init__)."""
    RUNNERS.append(cls)
    return cls


def runner_class(model: nn.Module) -> type[DecoderRunner] | None:
    """The registered runner whose model kind `model` is (by the classes of its modules), or None."""
    return next((cls for cls in RUNNERS if cls.accepts(model)), None)


def families() -> str:
    """The families the engine runs, for messages."""
    return ", ".join(f for cls in RUNNERS for f in cls.families)


def unsupported(model: nn.Module) -> str | None:
    """Why the engine cannot run `model` exactly (naming the family), or None when it can."""
    name = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    cls = runner_class(model)
    if cls is None:
        backbone = getattr(model, "model", model)
        return (f"the generation engine does not run {name!r} yet (it runs {families()}): its "
                f"{type(model).__name__} over {type(backbone).__name__} is no kind a runner is registered for")
    return cls.refuse(model, name)


def _mlp_fn(mlp: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """x (TILE, C) -> (TILE, C) through the layer's MLP with fixed shapes."""
    if type(mlp) is GatedMLP:
        return lambda h: mlp.down_proj(lanewise(mlp.act_fn, mlp.gate_proj(h)) * mlp.up_proj(h))
    # any other MLP (MoE routing sends a varying number of rows to each expert): one row per call
    return lambda h: torch.cat([mlp(h[i:i + 1].unsqueeze(0)).reshape(1, -1) for i in range(h.shape[0])])


@register
class DecoderRunner:
    """Runs `model` over packed pieces, its per-token cache in `pool`. `DecoderRunner(model, n)` makes the
    registered runner of the model's kind (this class runs the pre-norm attention decoders: Llama, Qwen2,
    Qwen3, Qwen3-MoE; a subclass overrides `accepts`, `refuse`, `_setup`, `new_pool` and `_layer`)."""

    families: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3_moe")

    def __new__(cls, model: nn.Module, max_positions: int):
        picked = runner_class(model) if cls is DecoderRunner else None
        return super().__new__(picked or cls)  # __init__ refuses a model no runner takes

    @classmethod
    def accepts(cls, model: nn.Module) -> bool:
        backbone = getattr(model, "model", None)
        return (isinstance(model, ForCausalLM) and type(model).forward is ForCausalLM.forward
                and type(backbone) is Decoder
                and all(type(layer) is DecoderLayer and type(layer.self_attn) is Attention
                        for layer in backbone.layers))

    @classmethod
    def refuse(cls, model: nn.Module, name: str) -> str | None:
        """Why this runner cannot run `model` (of its kind) exactly, or None."""
        if any(layer.self_attn.core is not None for layer in model.model.layers):
            return f"the generation engine does not run {name!r} with a parallel attention core (context parallelism)"
        return None

    def __init__(self, model: ForCausalLM, max_positions: int):
        why = unsupported(model)
        if why:
            raise KilnError(why)
        self.model, self.backbone = model, model.model
        # the layers the main forward runs (multi-token-prediction layers sit past them, common/mtp.py)
        self.num_layers = int(getattr(self.backbone, "num_main_layers", len(self.backbone.layers)))
        self.max_positions = max_positions
        weight = self.backbone.embed_tokens.weight
        self.dtype, self.device = weight.dtype, weight.device
        rotary = getattr(self.backbone, "rotary_emb", None)  # none in a state-space model (kiln.engine.mamba)
        self.cos = self.sin = None
        if rotary is not None:
            with torch.no_grad():
                self.cos, self.sin = rope_table(rotary, max_positions,
                                                torch.zeros((), dtype=self.dtype, device=self.device))
        self.mlps = [_mlp_fn(layer.mlp) if hasattr(layer, "mlp") else None  # Mamba's blocks have none
                     for layer in list(self.backbone.layers)[:self.num_layers]]
        # (row limit, head kind: "product" or "module") -> LM-head call sizes proven equal (exact.py)
        self._menus: dict[tuple[int, str], tuple[int, ...]] = {}
        # the LM head's weight packed for oneDNN (exact.pack_head) and what it was made from: the weight's address,
        # its in-place version counter (an optimizer step bumps it) and shape; remade when any of them moves
        self._pack_key: tuple | None = None
        self._pack: torch.Tensor | None = None
        self._setup()

    def _setup(self) -> None:
        """The kind's own dimensions."""
        attn = self.backbone.layers[0].self_attn
        self.head_dim, self.groups, self.scale = attn.head_dim, attn.groups, attn.scaling
        self.kv_heads = attn.k_proj.out_features // attn.head_dim

    def new_pool(self, num_blocks: int, block_size: int, seqs: int = 1) -> BlockPool:
        """The paged cache (and, for a family with recurrent state, a state slot per seat: `seqs`)."""
        slot = (self.kv_heads, self.head_dim)
        return BlockPool(num_blocks, block_size, [(slot, slot)] * self.num_layers, self.dtype, self.device)

    # ---- one layer ------------------------------------------------------------------------------
    def _qkv(self, layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        a, D = layer.self_attn, self.head_dim
        h = layer.input_layernorm(x)
        q, k, v = a.q_proj(h).view(h.shape[0], -1, D), a.k_proj(h).view(h.shape[0], -1, D), \
            a.v_proj(h).view(h.shape[0], -1, D)
        if a.q_norm is not None:
            q, k = a.q_norm(q), a.k_norm(k)
        c, s = cos[:, None], sin[:, None]  # (R, 1, D): over heads
        q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
        return torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], 1)

    def _layer(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kv: Callable[[int, torch.Tensor, torch.Tensor], list[tuple[int, int, torch.Tensor, torch.Tensor,
                                                                          torch.Tensor]]]) -> torch.Tensor:
        """x (N, C) -> (N, C). `kv(i, k, v)` stores this step's k, v (N, KVH, D) and returns the attention
        groups: (row start, row end, positions, keys, values) with keys/values as `exact.attend` takes them."""
        layer, D, KVH, G = self.backbone.layers[i], self.head_dim, self.kv_heads, self.groups
        qkv = tiled(lambda t, c, s: self._qkv(layer, t, c, s), x, cos, sin)  # (N, (H + 2 KVH) D)
        H = KVH * G
        q = qkv[:, :H * D].view(-1, KVH, G, D)
        k = qkv[:, H * D:(H + KVH) * D].view(-1, KVH, D)
        v = qkv[:, (H + KVH) * D:].view(-1, KVH, D)
        y = q.new_empty((x.shape[0], H * D))
        for s, e, pos, kb, vb in kv(i, k, v):
            y[s:e] = attend(q[s:e], kb, vb, pos, self.scale).flatten(1)
        mlp = self.mlps[i]

        def post(xt: torch.Tensor, yt: torch.Tensor) -> torch.Tensor:
            xt = xt + layer.self_attn.o_proj(yt)
            return xt + mlp(layer.post_attention_layernorm(xt))

        return tiled(post, x, y)

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, kv) -> torch.Tensor:
        x = self.backbone.embed_tokens(ids)  # (N, C)
        cos, sin = self.cos[positions], self.sin[positions]
        for i in range(self.num_layers):
            x = self._layer(i, x, cos, sin, kv)
        return x

    # ---- the engine's step ----------------------------------------------------------------------
    @torch.no_grad()
    def step(self, pieces: list[Piece], pool: BlockPool, limit: int = 64) -> torch.Tensor:
        """Feed every piece's tokens (their keys/values go into the pool); float32 logits (P, V) of the last
        token of each piece with `logits`, in order. Decode pieces (one token) come first in `pieces`' order
        of rows and attend in one call, each over its own blocks (the block lists padded to the longest: the
        padding adds exact zeros); a prefill chunk attends alone."""
        bs, dev = pool.block_size, self.device
        order = sorted(range(len(pieces)), key=lambda j: len(pieces[j].ids) > 1)  # decodes first, stable
        ids, positions, slots, rows = [], [], [], {}
        for j in order:
            p = pieces[j]
            rows[j] = (len(ids), len(ids) + len(p.ids))
            pos = range(p.start, p.start + len(p.ids))
            ids += p.ids
            positions += pos
            slots += [p.table[t // bs] * bs + t % bs for t in pos]
        decodes = [j for j in order if len(pieces[j].ids) == 1]
        chunks = [j for j in order if len(pieces[j].ids) > 1]
        pos_t = torch.tensor(positions, device=dev)
        slot_t = torch.tensor(slots, device=dev)
        nb = max((pieces[j].start // bs + 1 for j in decodes), default=0)
        dec_tables = torch.tensor([pieces[j].table[:nb] + [0] * (nb - min(nb, len(pieces[j].table)))
                                   for j in decodes], dtype=torch.long, device=dev).view(len(decodes), nb)
        chunk_tables = [torch.tensor(pieces[j].table[:(pieces[j].start + len(pieces[j].ids) + bs - 1) // bs],
                                     device=dev) for j in chunks]

        def kv(i: int, k: torch.Tensor, v: torch.Tensor):
            pool.write(i, slot_t, k, v)
            groups = []
            if decodes:
                kb, vb = pool.gather(i, dec_tables.view(-1))
                groups.append((0, len(decodes), pos_t[:len(decodes)], kb.view(len(decodes), nb, *kb.shape[1:]),
                               vb.view(len(decodes), nb, *vb.shape[1:])))
            for j, table in zip(chunks, chunk_tables):
                s, e = rows[j]
                kb, vb = pool.gather(i, table)
                groups.append((s, e, pos_t[s:e], kb[None], vb[None]))
            return groups

        x = self._run(torch.tensor(ids, device=dev), pos_t, kv, *self._step_extras(pieces, rows, pool))
        last = [rows[j][1] - 1 for j in range(len(pieces)) if pieces[j].logits]
        if not last:
            return x.new_zeros((0, self.model.config.vocab_size), dtype=torch.float32)
        return self.logits(x[last], limit)

    def logits(self, x: torch.Tensor, limit: int = 64) -> torch.Tensor:
        """float32 logits (N, V) of last-layer hidden states (N, C): the final norm on TILE-row tiles, then the
        head (`head_product` when it is a plain product of its weight, else the module with the norm on
        whole tiles), in calls of row counts proven to give the same bits (up to about `limit` rows a call: the
        caller's usual count)."""
        weight = self.head_weight()
        if weight is None:
            return self._menu_call(self._head, x, limit, "module")
        return self.product_logits(self.head_input(x, weight), weight, limit)

    def head_input(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The final norm of hidden states (N, C) on TILE-row tiles, in the head weight's dtype (ForCausalLM.head's
        cast under fp32_logits): what `product_logits` takes. Differentiable."""
        return tiled(self._final_norm, x).to(weight.dtype)

    def product_logits(self, h: torch.Tensor, weight: torch.Tensor, limit: int = 64) -> torch.Tensor:
        """float32 logits (N, V) of normed rows h (N, C) through `head_product` on proven row counts."""
        fn, kind = self.head_product(weight)
        return self._menu_call(fn, h, limit, kind)

    def head_product(self, weight: torch.Tensor) -> tuple[Callable[[torch.Tensor], torch.Tensor], str]:
        """h (M, C) -> h @ weight^T (M, V) and its kind for the proven row counts: oneDNN on the weight packed
        once (`exact.pack_head`; "packed"), remade when the weight changed (a new tensor, or the same one updated
        in place: its version counter), else `exact.vocab_product` ("product")."""
        key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype, weight.device)
        if key != self._pack_key:
            self._pack, self._pack_key = None, None  # the old copy freed before the new one is made
            self._pack, self._pack_key = pack_head(weight), key
        if self._pack is None:
            return partial(vocab_product, weight=weight), "product"
        return partial(packed_product, packed=self._pack), "packed"

    def forget_weights(self) -> None:
        """Drop the packed head (the caller changed weights in a way the version counter may not see, e.g.
        through `.data`): the next call packs the weight again."""
        self._pack, self._pack_key = None, None

    def _menu_call(self, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, limit: int,
                   kind: str) -> torch.Tensor:
        if (limit, kind) not in self._menus:
            self._menus[limit, kind] = head_tiles(fn, x.shape[1], x.dtype, self.device, limit)
        return tiled_menu(fn, x, self._menus[limit, kind]).float()

    def head_weight(self) -> torch.Tensor | None:
        """The LM head's weight (V, C) when the head is that product alone (kiln's ForCausalLM.head over a plain
        bias-free Linear or the tied embedding, not split between ranks), else None."""
        m = self.model
        lm = getattr(m, "lm_head", None)
        if getattr(type(m), "head", None) is not ForCausalLM.head or (
                lm is not None and (type(lm) is not nn.Linear or lm.bias is not None)):
            return None
        weight = m.output_weight
        return None if isinstance(weight, DTensor) else weight

    def _final_norm(self, t: torch.Tensor) -> torch.Tensor:
        return self.backbone.norm(t)

    def _head(self, t: torch.Tensor) -> torch.Tensor:
        return self.model.head(self._final_norm(t))

    # ---- the scoring forward's ------------------------------------------------------------------
    def dense(self, ids: list[int], block_size: int) -> torch.Tensor:
        """Last-layer hidden states (S, C) of one whole sequence, its keys in a private buffer laid out as the
        pool's blocks. Differentiable when grad is on."""
        return self.dense_many([ids], block_size)

    def _step_extras(self, pieces: list[Piece], rows: dict[int, tuple[int, int]], pool: BlockPool) -> tuple:
        """What `_run` takes after kv in a step beyond the attention decoders' (recurrent state: kiln.engine.hybrid)."""
        return ()

    def _dense_extras(self, length: int) -> tuple:
        """What `_run` takes after kv for one whole sequence from its start."""
        return self._packed_extras([(0, length)])

    def _packed_extras(self, bounds: list[tuple[int, int]]) -> tuple:
        """What `_run` takes after kv for whole sequences packed at row ranges `bounds`, each from its start."""
        return ()

    def dense_many(self, sequences: list[list[int]], block_size: int) -> torch.Tensor:
        """Last-layer hidden states (sum of lengths, C) of several whole sequences in one pass, sequence i's rows
        right after sequence i - 1's. The row-wise work runs on the packed rows' 16-row tiles (a row's bits depend
        on its own row and the tile's fixed shape, never on the tile's other rows, as in a step that packs many
        requests); attention runs per sequence over its own keys laid out as the pool's blocks, as in `dense`.
        So each sequence's rows are `dense`'s bits. Differentiable when grad is on."""
        bs = block_size
        bounds, flat, pos = [], [], []
        for ids in sequences:
            if len(ids) > self.max_positions:
                raise KilnError(f"a sequence of {len(ids)} tokens is longer than the model's {self.max_positions} "
                                "positions")
            bounds.append((len(flat), len(flat) + len(ids)))
            flat += ids
            pos += range(len(ids))
        pos_t = torch.tensor(pos, device=self.device)

        def kv(i: int, k: torch.Tensor, v: torch.Tensor):
            groups = []
            for s, e in bounds:
                if s == e:
                    continue
                nb, pad = (e - s + bs - 1) // bs, -(e - s) % bs
                kb = torch.cat([k[s:e], k.new_zeros((pad,) + tuple(k.shape[1:]))]).view(1, nb, bs, *k.shape[1:])
                vb = torch.cat([v[s:e], v.new_zeros((pad,) + tuple(v.shape[1:]))]).view(1, nb, bs, *v.shape[1:])
                groups.append((s, e, pos_t[s:e], kb, vb))
            return groups

        return self._run(torch.tensor(flat, device=self.device), pos_t, kv, *self._packed_extras(bounds))
