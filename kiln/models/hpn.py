"""Prototype-head task models for any family: a kiln model that returns `last_hidden_state`, plus a
`PrototypeHead` (common/prototypes.py) over the vocabulary (causal LM) or the labels (classification).

Choices: the wrapped model is untouched (its HF round trip keeps working through `.inner`); causal
LM shifts labels as transformers does (token t predicts t+1, -100 ignored); classification pools
the first token (encoders) or the last real token (decoders, SSMs). When the wrapped model computes
a loss of its own from `labels` (e.g. MambaForCausalLM's LM loss) it is kept as a second objective:
`losses = {"prototype": ..., "lm": ...}` for a multi-objective step; `loss` is their sum. With `fast`
on (kiln.models.common.fast.set_fast) both losses come from hidden states at the labelled positions and
no (B, T, vocab) logits are made; within fp32 rounding of the exact path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypedDict, Unpack

import torch
from torch import nn
from torch.nn import functional as F

from kiln.errors import ConfigError
from kiln.models.common.loss import IGNORE_INDEX, linear_cross_entropy, shift_labels
from kiln.models.common.prototypes import PrototypeHead
from kiln.models.heads import ModelOutput
from kiln.models.tasks import CAUSAL_LM, SEQUENCE_CLASSIFICATION

POOLING = ("first", "last")


@dataclass
class PrototypeOutput(ModelOutput):
    losses: dict[str, torch.Tensor] = field(default_factory=dict)


def _hidden_size(inner: nn.Module) -> int:
    config = getattr(inner, "config", None)
    for key in ("hidden_size", "dim", "d_model"):
        if config is not None and isinstance(getattr(config, key, None), int):
            return getattr(config, key)
    raise ConfigError(f"cannot tell the hidden size of {type(inner).__name__}; pass hidden_size=")


class HeadOptions(TypedDict, total=False):
    """PrototypeHead's keyword arguments, passed through by PrototypeModel."""
    proto_dim: int | None
    scale: float
    mode: str
    loss: str
    spread_steps: int
    seed: int


def _total(losses: dict[str, torch.Tensor]) -> torch.Tensor:
    """The losses' sum, in order (as `sum` adds them, without its int 0 start)."""
    first, *rest = losses.values()
    for t in rest:
        first = first + t
    return first


class PrototypeModel(nn.Module):
    """inner model -> last_hidden_state (B, T, C) -> prototype logits; task causal-lm or sequence-classification."""

    def __init__(self, inner: nn.Module, num_classes: int, task: str = CAUSAL_LM, hidden_size: int | None = None,
                 pooling: str = "last", lm_loss: bool = True, **head: Unpack[HeadOptions]):
        super().__init__()
        if task not in (CAUSAL_LM, SEQUENCE_CLASSIFICATION):
            raise ConfigError(f"prototype task {task!r} is not {CAUSAL_LM!r} or {SEQUENCE_CLASSIFICATION!r}")
        if pooling not in POOLING:
            raise ConfigError(f"prototype pooling {pooling!r} is not one of: {', '.join(POOLING)}")
        self.inner = inner
        self.head = PrototypeHead(hidden_size or _hidden_size(inner), num_classes, **head)
        self.task, self.pooling, self.lm_loss = task, pooling, lm_loss
        self.config = getattr(inner, "config", None)
        self.fast = False  # set_fast: losses from hidden states, no (B, T, vocab) logits on either head

    def _pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        if self.pooling == "first":
            return hidden[:, 0]
        if attention_mask is None:
            return hidden[:, -1]
        last = attention_mask.long().cumsum(1).argmax(1)  # index of the last real token, also under left padding
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # (B, C)

    def _fast_prototype_loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The prototype loss from hidden states (B, T, C), scored only where a target is; `ce` through the
        fused chunked cross entropy, `cosine` from each target's own prototype. Within fp32 rounding of
        `head.loss(head(hidden), targets)`."""
        head, keep = self.head, targets != IGNORE_INDEX
        z = F.normalize(head.proj(hidden[keep]), dim=-1)  # (n, P)
        p = F.normalize(head.prototypes, dim=-1)  # (K, P)
        t = targets[keep]
        if head.loss_kind == "ce":
            return linear_cross_entropy(head.scale * z, p, t) / keep.sum()
        return ((1.0 - (z * p[t]).sum(-1)) ** 2).mean()

    def forward(self, input_ids=None, attention_mask=None, labels=None, targets=None, **inputs) -> PrototypeOutput:
        """`labels` as transformers takes them (shifted inside); `targets` already aligned (token-shard windows)."""
        if self.fast and self.task == CAUSAL_LM and (targets is not None or labels is not None):
            return self._fast_forward(input_ids, attention_mask, labels, targets, inputs)
        inner_labels = labels if (self.lm_loss and self.task == CAUSAL_LM) else None
        kwargs = {"labels": inner_labels} if inner_labels is not None else {}
        inputs = {k: v for k, v in inputs.items() if v is not None}
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, **inputs, **kwargs)
        hidden = out.last_hidden_state  # (B, T, C)
        if self.task == CAUSAL_LM:
            logits = self.head(hidden)  # (B, T, K)
            if targets is None and labels is not None:
                targets = shift_labels(labels)  # token t predicts t+1
        else:
            logits = self.head(self._pool(hidden, attention_mask))  # (B, K)
            targets = labels
        losses: dict[str, torch.Tensor] = {}
        if targets is not None:
            losses["prototype"] = self.head.loss(logits, targets)
            if getattr(out, "loss", None) is not None:
                losses["lm"] = out.loss
            elif self.lm_loss and labels is None and getattr(out, "logits", None) is not None:
                losses["lm"] = F.cross_entropy(out.logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)
        loss = _total(losses) if losses else None
        return PrototypeOutput(logits=logits, loss=loss, last_hidden_state=hidden, losses=losses)

    def _fast_forward(self, input_ids, attention_mask, labels, targets, inputs) -> PrototypeOutput:
        """Causal LM with targets on the fast path: no logits; the inner LM's loss fused too where it can."""
        if targets is None:
            targets = shift_labels(labels)  # token t predicts t+1
        inputs = {k: v for k, v in inputs.items() if v is not None}
        sums = self.lm_loss and getattr(self.inner, "sums_targets", False)
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, **inputs,
                         **({"targets": targets} if sums else {}))
        losses = {"prototype": self._fast_prototype_loss(out.last_hidden_state, targets)}
        if sums:
            losses["lm"] = out.loss_sum / out.loss_count
        elif self.lm_loss and getattr(out, "logits", None) is not None:
            losses["lm"] = F.cross_entropy(out.logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX)
        return PrototypeOutput(logits=None, loss=_total(losses), last_hidden_state=out.last_hidden_state,
                               losses=losses)
