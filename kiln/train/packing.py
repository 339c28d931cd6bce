"""Sequences of a preference, KTO, reward-model or GRPO micro-batch laid out for one forward: padded (one per row) or
packed (several per row, positions restarting at each, so the model keeps them apart as SFT's packed rows).

A micro-batch's sequences (DPO's chosen and rejected, KTO's completions and its mismatched KL pairs, a reward
model's two sides, GRPO's prompt + completion) vary in length; padded to the longest, most of a batch of mixed lengths is padding. Packed,
they go first-fit-decreasing into rows no longer than the longest sequence, so no row is wider (and no row's
attention larger) than a padded one, and the tokens run are close to the real ones. The micro-batch is the same
either way: per-sequence results (summed log-probs, the last token's score) are equal within fp32 rounding, so
losses, gradients and which pairs a step sees do not change with `data.pack`.

`settle_pack` decides `data.pack` against the model (`ForCausalLM.packs_samples`), for SFT and these recipes
alike: kept where the model keeps packed samples apart, otherwise refused when asked for, else turned off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from kiln.constants import IGNORE_INDEX
from kiln.errors import ConfigError, KilnError
from kiln.models.common.tied_grad import deferred_head
from kiln.models.common.wrapped import unwrap

__all__ = ["Layout", "completion_logps", "lay_out", "layout_logps", "settle_pack"]


@dataclass
class Layout:
    """`n` sequences in rows: `input_ids` (R, W); `attention_mask` (R, W) when padded (else None);
    `position_ids` (R, W) when packed (else None); `seq` (R, W) the sequence each token belongs to (-1: padding);
    `scored[k]` (R, W) bool, true at position t where token t+1 (of the same sequence) is a target of mask `k`;
    `last` (2, n) the (row, column) of each sequence's last token."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    seq: torch.Tensor
    scored: dict[str, torch.Tensor]
    last: torch.Tensor
    n: int

    @property
    def packed(self) -> bool:
        return self.position_ids is not None

    def tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int((self.seq >= 0).sum())

    def per_sequence(self, values: torch.Tensor) -> torch.Tensor:
        """(n,) the sum of each sequence's values (R, W) (zero on padding). A padded layout sums its rows, so it
        is bitwise what the row sums were before packing existed."""
        if not self.packed:
            return values.sum(-1)
        keep = self.seq >= 0
        return values.new_zeros(self.n).index_add(0, self.seq[keep], values[keep])

    def count(self, key: str) -> torch.Tensor:
        """(n,) how many targets of mask `key` each sequence has."""
        return self.per_sequence(self.scored[key].long())


def _rows(lengths: list[int], pack: bool) -> list[list[int]]:
    """The sequences of each row: one per row, or first-fit decreasing into rows of the longest's length."""
    if not pack:
        return [[i] for i in range(len(lengths))]
    width = max(lengths)
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: equal lengths keep their order
        r = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if r is None:
            rows.append([])
            room.append(width)
            r = len(rows) - 1
        rows[r].append(i)
        room[r] -= lengths[i]
    return rows


def lay_out(ids: list[torch.Tensor], masks: dict[str, list[torch.Tensor]], pack: bool, pad_id: int = 0) -> Layout:
    """Sequences `ids` (1-D, on one device) in rows, padded (`pack` false) or packed. `masks[k][i]` marks the
    tokens of sequence i that mask k scores (aligned with ids[i]; its first token is never scored: nothing in
    the sequence predicts it)."""
    if not ids:
        raise KilnError("lay_out: no sequences")
    lengths = [int(x.shape[0]) for x in ids]
    if min(lengths) < 1:
        raise KilnError(f"lay_out: an empty sequence (lengths {lengths})")
    device = ids[0].device
    rows = _rows(lengths, pack)
    width = max(sum(lengths[i] for i in row) for row in rows)
    R = len(rows)
    # host-side index bookkeeping, then one gather per tensor: a few small copies however many sequences
    flat_ids = torch.cat(ids)
    offsets = torch.tensor([0] + lengths, device=device).cumsum(0)
    row_of, col_of = [0] * len(ids), [0] * len(ids)
    for r, row in enumerate(rows):
        at = 0
        for i in row:
            row_of[i], col_of[i] = r, at
            at += lengths[i]
    seq_of_token = torch.repeat_interleave(torch.arange(len(ids), device=device),
                                           torch.tensor(lengths, device=device))
    within = torch.arange(flat_ids.shape[0], device=device) - offsets[:-1][seq_of_token]
    r_idx = torch.tensor(row_of, device=device)[seq_of_token]
    c_idx = torch.tensor(col_of, device=device)[seq_of_token] + within
    input_ids = torch.full((R, width), pad_id, dtype=flat_ids.dtype, device=device)
    input_ids[r_idx, c_idx] = flat_ids
    seq = torch.full((R, width), -1, dtype=torch.long, device=device)
    seq[r_idx, c_idx] = seq_of_token
    scored = {}
    for key, ms in masks.items():
        # target at position t = token t+1 of the same sequence scored: each mask shifted within its sequence
        shifted = torch.cat([F.pad(m[1:].bool(), (0, 1)) for m in ms])
        s = torch.zeros((R, width), dtype=torch.bool, device=device)
        s[r_idx, c_idx] = shifted
        scored[key] = s
    attention_mask = position_ids = None
    if pack:
        # each sequence's positions count from 0; a row's padding tail counts 0, 1, ... as a sequence of its own
        position_ids = torch.arange(width, device=device).repeat(R, 1)
        tail = (seq < 0).long()
        fill = torch.arange(width, device=device)[None, :] - (width - tail.sum(-1, keepdim=True))
        position_ids = torch.where(seq < 0, fill, position_ids)
        position_ids[r_idx, c_idx] = within
    else:
        attention_mask = (seq >= 0).long()
    ends = offsets[1:] - 1
    last = torch.stack([r_idx[ends], c_idx[ends]])
    return Layout(input_ids, attention_mask, position_ids, seq, scored, last, len(ids))


def layout_logps(model: nn.Module, layout: Layout, key: str, temperature: float = 1.0) -> torch.Tensor:
    """(R, W) fp32 log-probs of the targets of mask `key` (0 elsewhere), one forward over the layout's rows:
    kiln.train.logps' chunked head, with the packed rows' positions. `model` is a kiln causal LM, or DDP / FSDP2
    around one."""
    core: Any = unwrap(model)  # duck-typed: any kiln ForCausalLM, checked just below
    if not hasattr(core, "hidden_token_logps"):
        raise KilnError(f"layout_logps needs a causal LM (kiln ForCausalLM); got {type(core).__name__}")
    ids = layout.input_ids
    targets = F.pad(ids[:, 1:], (0, 1)).masked_fill(~layout.scored[key], IGNORE_INDEX)
    attn, pos = layout.attention_mask, layout.position_ids
    plain = model is core  # a flag, not `if model is core`: that would narrow `core` to nn.Module for mypy
    if plain:  # plain, or FSDP2 (which hooks the model's token_logps as a forward)
        return core.token_logps(ids, attn, targets, temperature=temperature, position_ids=pos)
    head = deferred_head(core)  # DDP: through its forward (which readies the gradient sync), then the head
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=1)
    return core.hidden_token_logps(out.last_hidden_state, targets, temperature=temperature, head=head)


def completion_logps(model: nn.Module, micro: dict[str, Any], temperature: float = 1.0) -> torch.Tensor:
    """(N, C) fp32 log-probs of a GRPO micro-batch's completion tokens, its sequences packed: the rollout's layout
    (prompts left-padded to P, then completions right-padded to C; `attention_mask` (N, P + C) marks each one's
    tokens, contiguous; `completion_mask` (N, C) the scored ones) in and out, the forward over packed rows. Equal to
    the padded forward's within fp32 rounding: positions restart at 0 for each sequence where the padded rows run
    on from the left padding, and RoPE's scores depend only on the distance between positions."""
    ids, attn, cmask, p = micro["input_ids"], micro["attention_mask"], micro["completion_mask"], micro["prompt_len"]
    keep = attn.bool()
    lengths = keep.sum(1)
    first = keep.long().argmax(1)
    hole = (keep.long().cumsum(1) - 1 != torch.arange(keep.size(1), device=keep.device) - first[:, None]) & keep
    if bool(hole.any()) or bool((lengths == 0).any()):
        raise KilnError("completion_logps: each row's tokens must be one contiguous, non-empty run of the "
                        "attention mask")
    scored = torch.cat([torch.zeros_like(attn[:, :p]), cmask], 1).bool()
    rows = range(ids.size(0))
    layout = lay_out([ids[i][keep[i]] for i in rows], {"comp": [scored[i][keep[i]] for i in rows]}, True)
    packed = layout_logps(model, layout, "comp", temperature)  # (R, W): the target t+1 scored at t
    # each token's (row, column) in the packed rows: its sequence's start, plus its place in the sequence
    start = layout.last[1] - lengths + 1
    where = keep.long().cumsum(1) - 1 + start[:, None]
    full = packed.new_zeros(ids.shape)
    full[keep] = packed[layout.last[0][:, None].expand_as(where)[keep], where[keep]]
    return full[:, p - 1: p - 1 + cmask.size(1)]


def settle_pack(data: Any, model: nn.Module, name: str, log: Callable[[str], None] = print) -> None:
    """`data.pack` against the model: unchanged where it keeps packed samples apart (or pack is off); else, asked
    for explicitly, refused (a packed sample's output would change with what precedes it), or turned off with
    a message."""
    if not data.pack or getattr(model, "packs_samples", lambda: True)():
        return
    if "pack" in data.model_fields_set:
        raise ConfigError(f"data.pack = true: {name} does not keep packed samples apart (its output for a "
                          f"sample changes with what precedes it in the row); set data.pack = false")
    log(f"data.pack: {name} does not keep packed samples apart, so each row holds one sample")
    data.pack = False
