"""Context parallelism ([parallel] cp): each sequence split over the cp ranks, attention over all of it.

The split is load-balanced for causal attention: a row of T tokens is cut into 2*cp chunks and cp
rank i keeps chunks i and 2cp-1-i, so every rank holds one early chunk (few keys to attend to) and
one late chunk (many), and all do the same work. It happens at the task model's entry, in a
forward pre-hook, so every step function and eval runs unchanged on the full batch: next-token
targets are shifted on the whole row *before* the split (the last token of a chunk still predicts
the first of the next), position ids stay global (rotary sees the true positions), and the padding
mask, packed-row segments and causal order become one (B, 1, T/cp, T) mask built once per forward.

Attention is the one place tokens meet across ranks: each decoder `Attention` gets this module's
`attention` as its core (`Attention.core`, the seam in models/common/decoder.py), which all-gathers
keys and values over the cp group (an autograd function whose backward is a reduce-scatter: every
rank's queries add to every key's gradient) and runs SDPA with the global mask; with
`parallel.cp_method = "ring"` the keys and values pass rank to rank instead (kiln.parallel.ring), so
no rank holds the whole sequence's keys. Latent attention (MLA: DeepSeek-V3/V3.2, GLM-5) gathers what it caches
instead, the normalised latent and the rotated rope key (kv_lora_rank + rope numbers per token, expanded to
per-head keys and values locally), and the DSA indexer its keys, so its top-k runs over the whole row (all-gather
only; a live MTP layer is refused: its input at a chunk's end is the next chunk's first token). A trained
indexer's KL loss (`[moe] indexer = "kl"`) is each rank's share of the mean over the whole rows' queries
(`group_sum`), weighted by the cp group's units in kiln.train.recipes.moe, so cp ranks add up to one process. The loss comes back as each rank's share: `loss_sum` /
`loss_count` over its chunks (they add up over the cp ranks), and for `labels=` a `.loss` of local
sum / the cp group's count, whose sum over the cp ranks is the mean.

torch's own `torch.distributed.tensor.experimental.context_parallel` is not used: in torch 2.13 it
has no sharding rule for the CPU SDPA kernel (`_scaled_dot_product_flash_attention_for_cpu`), so it
cannot run on gloo/CPU, and it takes only `is_causal` (no packed rows, no padding masks).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from kiln.constants import IGNORE_INDEX
from kiln.errors import ConfigError, KilnError
from kiln.models.common.decoder import Attention, Decoder, segment_ids
from kiln.models.common.dsa import Indexer
from kiln.models.common.loss import shift_labels
from kiln.models.common.mla import MLADecoder, MLAttention
from kiln.parallel.blocks import model_name
from kiln.parallel.ring import ring_attention

# Row-aligned (B, T, ...) inputs the split cuts (and pads to a multiple of 2*cp when they are padded or packed rows).
_ROW_KEYS = ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "targets")


def chunk_index(seq_len: int, cp: int, rank: int, device: torch.device | None = None) -> torch.Tensor:
    """The row positions cp rank `rank` keeps: chunks `rank` and `2cp-1-rank` of 2*cp equal chunks, (T/cp,)."""
    check_seq_len(seq_len, cp)
    c = seq_len // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return torch.cat([torch.arange(first, first + c, device=device), torch.arange(second, second + c, device=device)])


def check_seq_len(seq_len: int, cp: int) -> None:
    if seq_len % (2 * cp):
        raise KilnError(f"parallel.cp = {cp} splits each sequence into 2 * cp = {2 * cp} load-balanced chunks, so "
                        f"the sequence length must be a multiple of {2 * cp}; got a sequence of {seq_len} tokens "
                        f"(choose data.max_length as a multiple of {2 * cp}, or another parallel.cp)")


def check_model(model: nn.Module, cp: int, method: str = "allgather") -> None:
    """Refuse models whose sequence mixing is not the shared attention decoder or the MLA one (those CP splits)."""
    backbone = getattr(model, "model", None)
    if not isinstance(backbone, (Decoder, MLADecoder)):
        kind = type(backbone).__name__ if isinstance(backbone, nn.Module) else type(model).__name__
        raise ConfigError(f"parallel.cp = {cp}: {model_name(model)} ({kind}) cannot be split over the sequence; "
                          f"context parallelism serves decoders made only of softmax or latent (MLA, with or "
                          f"without the DSA indexer) attention layers (no recurrent Mamba / DeltaNet layers, no "
                          f"sliding/compressed DeepSeek-V4 attention, no encoders)")
    if isinstance(backbone, MLADecoder) and method == "ring":
        raise ConfigError(f"parallel.cp_method = 'ring': {model_name(model)} has latent (MLA) attention, whose "
                          f"latent keys are all-gathered (a few hundred numbers per token); use cp_method = "
                          f"'allgather'")
    config = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        raise ConfigError(f"parallel.cp = {cp} with output_router_logits: the MoE balance loss is a function of "
                          f"the whole sequence's routing, which no rank sees; turn output_router_logits off")


# torch 2.13 names them *_single (the *_into_tensor / *_tensor names warn as deprecated); older ones only those
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherSequence(torch.autograd.Function):
    """x (...) on each rank -> (cp, ...) stacked in rank order; the backward sums each slice over the ranks."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        n = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((n * x.shape[0], *x.shape[1:]))  # gloo wants the ranks' tensors concatenated on dim 0
        _ALL_GATHER(out, x, group=group)
        return out.unflatten(0, (n, -1))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(grad.shape[1:])
        _REDUCE_SCATTER(out, grad.flatten(0, 1).contiguous(), group=ctx.group)  # every rank's queries used my keys
        return out, None


def gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """Each rank's (..., T/cp, D) chunk pair -> the whole (..., T, D) in row order, autograd-aware."""
    g = _GatherSequence.apply(x, group)  # (cp, ..., 2c, D)
    g = g.unflatten(-2, (2, -1))         # (cp, ..., 2, c, D)
    first, second = g.select(-3, 0), g.select(-3, 1).flip(0)  # chunks 0..cp-1 and (reversed) cp..2cp-1
    whole = torch.cat([first, second])   # (2cp, ..., c, D) in row order
    return whole.movedim(0, -3).flatten(-3, -2)


class ContextParallel:
    """The cp group's split of each forward's inputs and the attention core over the gathered keys."""

    def __init__(self, group, cp: int, rank: int, method: str = "allgather"):
        self.group, self.cp, self.rank, self.method = group, cp, rank, method
        self.mask: torch.Tensor | None = None  # (B or 1, 1, T/cp, T) for the forward under way
        self.blocks: list[torch.Tensor] = []   # row positions each cp rank holds, for the ring
        self._bias: dict[torch.dtype, torch.Tensor] = {}  # self.mask as SDPA's additive mask, per dtype
        self._labels = False                   # that forward was given labels= (it reports .loss)

    # ---- the split -------------------------------------------------------------------------
    def split(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A forward pre-hook: full rows in (positional or keyword), this rank's chunks out (keywords)."""
        given = inspect.signature(module.forward).bind_partial(*args, **kwargs).arguments
        extra = given.pop("kwargs", {})
        given = {**given, **extra}
        if given.get("cache") is not None:
            raise KilnError("parallel.cp splits training sequences over ranks; decoding from a cache is not "
                            "supported under it")
        if getattr(module, "mtp", None) is not None:
            raise KilnError("parallel.cp with a live multi-token-prediction layer ([moe] mtp_weight): its input at a "
                            "chunk's last position is the next chunk's first token, held by another cp rank; "
                            "train MTP without cp")
        labels = given.pop("labels", None)
        self._labels = labels is not None
        if labels is not None and given.get("targets") is None:
            given["targets"] = shift_labels(labels)  # on the whole row: chunk ends predict the next chunk's start
        rows = {k: given[k] for k in _ROW_KEYS if given.get(k) is not None}
        ref = rows.get("input_ids", rows.get("inputs_embeds"))
        if ref is None:
            raise KilnError("parallel.cp needs input_ids or inputs_embeds to split")
        B, T = ref.shape[:2]
        device = ref.device
        if T % (2 * self.cp) and ("attention_mask" in rows or "position_ids" in rows):
            rows, T = _pad_rows(rows, T, 2 * self.cp), T + (-T) % (2 * self.cp)
        self.blocks = [chunk_index(T, self.cp, r, device) for r in range(self.cp)]
        idx = self.blocks[self.rank]  # (L,)
        positions = rows.get("position_ids")
        if positions is None:
            positions = torch.arange(T, device=device)[None]  # (1, T)
        self.mask = _global_mask(idx, T, rows.get("attention_mask"), rows.get("position_ids"), B)
        self._bias = {}
        for k, v in rows.items():
            if k not in ("attention_mask", "position_ids"):
                given[k] = v[:, idx]
        given["position_ids"] = positions[:, idx]  # global: rotary sees each token's true position
        given["attention_mask"] = None  # folded into self.mask
        return (), given

    def finish(self, module: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        """A forward hook: `.loss` for labels= as this rank's share of the cp group's mean."""
        # self.mask stays until the next forward: activation checkpointing recomputes attention in the backward
        if self._labels and getattr(out, "loss_sum", None) is not None:
            count = out.loss_count.detach().to(torch.float64).clone()
            dist.all_reduce(count, group=self.group)
            out.loss = out.loss_sum / count.clamp(min=1).to(out.loss_sum.dtype)
        return out

    def group_sum(self, x: torch.Tensor) -> torch.Tensor:
        """A count (no gradient) summed over the cp group: the whole rows' from each rank's chunks."""
        x = x.detach().clone()
        dist.all_reduce(x, group=self.group)
        return x

    # ---- latent (MLA) attention: the whole row's latent and rope keys, and the DSA indexer's keys -------
    def gather_latent(self, latent: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent (B, 1, T/cp, R), k_rot (B, 1, T/cp, rope) of this rank -> the whole row's, in row order."""
        whole = gather_sequence(torch.cat([latent, k_rot], dim=-1), self.group)  # (B, 1, T, R + rope)
        got_latent, got_rot = torch.split(whole, [latent.shape[-1], k_rot.shape[-1]], dim=-1)
        return got_latent, got_rot

    def gather_keys(self, k: torch.Tensor) -> torch.Tensor:
        """The DSA indexer's keys (B, T/cp, D) -> (B, T, D) in row order."""
        return gather_sequence(k, self.group)

    def _mask(self) -> torch.Tensor:
        """The row's mask of the forward under way (set by `split`, the model's forward pre-hook)."""
        if self.mask is None:
            raise KilnError("context-parallel attention outside the model's forward: no row mask split yet")
        return self.mask

    # ---- the attention core ----------------------------------------------------------------
    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  dropout_p: float) -> torch.Tensor:
        """q (B, H, T/cp, D) against the whole row's k, v (B, KVH, T, D) gathered from the cp ranks
        (or, method "ring", passed around them: kiln.parallel.ring)."""
        if self.method == "ring":
            return ring_attention(q, k, v, self._mask(), self.blocks, scale, dropout_p, self.group)
        kv = gather_sequence(torch.stack([k, v]), self.group)  # (2, B, KVH, T, D)
        k, v = kv[0], kv[1]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self._additive(q.dtype), dropout_p=dropout_p,
                                              scale=scale, enable_gqa=q.shape[1] != k.shape[1])

    def _additive(self, dtype: torch.dtype) -> torch.Tensor:
        """The mask as 0 / -inf in the queries' dtype, made once per forward: SDPA would convert a boolean one in
        every layer and keep each copy for its backward; one tensor shared by all layers is kept once."""
        if dtype not in self._bias:
            mask = self._mask()
            self._bias[dtype] = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
                ~mask, float("-inf"))
        return self._bias[dtype]


def _pad_rows(rows: dict[str, torch.Tensor], T: int, multiple: int) -> dict[str, torch.Tensor]:
    """Right-pad rows to a multiple of `multiple` the way pad_collate pads: masked keys, ignored targets,
    and positions counting 0, 1, ... as a sample of their own (packed rows)."""
    n = (-T) % multiple
    out = {}
    for k, v in rows.items():
        if k == "position_ids":
            tail = torch.arange(n, device=v.device, dtype=v.dtype).expand(v.shape[0], n)
            out[k] = torch.cat([v, tail], dim=1)
        elif k == "inputs_embeds":
            out[k] = F.pad(v, (0, 0, 0, n))
        else:
            out[k] = F.pad(v, (0, n), value=IGNORE_INDEX if k == "targets" else 0)
    return out


def _global_mask(idx: torch.Tensor, T: int, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None,
                 B: int) -> torch.Tensor:
    """(B or 1, 1, L, T) bool, True = attend: causal over row positions, within one packed sample
    (segments from position ids, as the decoder's causal_mask keeps them when no padding mask is given),
    and only to real keys."""
    keys = torch.arange(T, device=idx.device)
    mask = (keys[None, :] <= idx[:, None])[None]  # (1, L, T)
    seg = segment_ids(position_ids.expand(B, -1)) if position_ids is not None and attention_mask is None else None
    if seg is not None:
        mask = mask & (seg[:, idx, None] == seg[:, None, :])  # (B, L, T)
    if attention_mask is not None:
        mask = mask & attention_mask.bool()[:, None, :]
    return mask[:, None]


def apply_context_parallel(model: nn.Module, group, method: str = "allgather") -> ContextParallel:
    """Split `model`'s inputs over the cp `group` and swap its attention cores, in place (hooks, no new modules);
    `method` "allgather" or "ring" (parallel.cp_method)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    check_model(model, cp, method)
    ctx = ContextParallel(group, cp, rank, method)
    for module in model.modules():
        if isinstance(module, Attention):
            module.core = ctx.attention
        elif isinstance(module, (MLAttention, Indexer)):
            module.context = ctx
    model.register_forward_pre_hook(ctx.split, with_kwargs=True)
    model.register_forward_hook(ctx.finish, with_kwargs=True)
    return ctx
