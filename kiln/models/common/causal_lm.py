"""The causal-LM task models over any backbone: the bare base model and backbone + LM head.

A backbone (the transformer `Decoder`, `MambaBackbone`, ...) maps token ids to the last hidden
state (B, T, C) and takes `input_ids, attention_mask, position_ids, inputs_embeds, cache` by
keyword; one that decodes incrementally makes its cache with `new_cache()` (None: generation
re-reads the whole sequence each step). The head is HF's `lm_head`, or with tied embeddings the
input embedding matrix itself (no tensor of its own). What differs between families is data
given to the constructor: where the embedding sits, and whether logits come back in float32.

Training asks for the loss summed over next-token `targets` (`forward(..., targets=)`: `loss_sum`,
`loss_count`). With `fast` on (kiln.models.common.fast.set_fast; the Trainer's default) the head
runs only where a target is, fused with the cross entropy chunk by chunk (common/loss.py), and no
logits come back; off, it is the exact path, bit-identical to transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from kiln.models.common.decoder import KVCache
from kiln.models.common.loss import IGNORE_INDEX, causal_lm_loss, fast_lm_loss_sum, lm_loss_sum, shift_labels
from kiln.models.common.moe import load_balancing_loss
from kiln.models.common.pretrained import PreTrainedModel
from kiln.models.common.tied_grad import deferred_head
from kiln.models.common.token_logps import exact_token_logps, linear_token_logps

if TYPE_CHECKING:
    from kiln.models.pretrained import Family


class RoutedConfig(Protocol):
    """What the router's auxiliary loss reads of an MoE family's config."""
    num_experts: int
    num_experts_per_tok: int
    router_aux_loss_coef: float


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None
    cache: Any = None
    loss_sum: torch.Tensor | None = None     # for targets=: fp32 cross entropy summed over the real targets
    loss_count: torch.Tensor | None = None   # ... and how many there were


def _router_logits(backbone: nn.Module) -> tuple[torch.Tensor, ...]:
    """The router logits each MoE block kept from this forward, in layer order."""
    found = (getattr(m, "router_logits", None) for m in backbone.modules())
    return tuple(r for r in found if r is not None)


class DecoderModel(PreTrainedModel):
    """The backbone alone (HF's `{Arch}Model`): returns the last hidden state."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None,
                cache: Any = None) -> CausalLMOutput:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            inputs_embeds=inputs_embeds, cache=cache)  # (B, T, C)
        return CausalLMOutput(last_hidden_state=hidden, cache=cache)


class ForCausalLM(PreTrainedModel):
    """Backbone + LM head (HF's `{Arch}ForCausalLM`); `.loss` for `labels` is transformers' mean.

    `embedding` names the backbone's input embedding (the tied head); `fp32_logits` casts the
    hidden state to the head's dtype and returns float32 logits, as transformers' Mamba does.
    """
    sums_targets = True  # forward takes targets= and returns loss_sum / loss_count (kiln.models.tasks)
    # methods that run the forward and then the head: FSDP2 gathers the root's weights around them as around
    # forward (kiln.parallel.fsdp registers them), so the head is whole when they use it
    fsdp_forward_methods = ("token_logps",)

    def __init__(self, model: nn.Module, hidden_size: int, vocab_size: int, tied: bool,
                 embedding: str = "embed_tokens", fp32_logits: bool = False):
        super().__init__()
        self.model = model
        self.lm_head = None if tied else nn.Linear(hidden_size, vocab_size, bias=False)
        self.embedding, self.fp32_logits, self.vocab_size = embedding, fp32_logits, vocab_size
        self.fast = False  # the exact path until set_fast: verify-export and parity tests rely on it

    @property
    def output_weight(self) -> torch.Tensor:
        return getattr(self.model, self.embedding).weight if self.lm_head is None else self.lm_head.weight

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits (..., V) for hidden states (..., C)."""
        if self.fp32_logits:
            hidden = hidden.to(self.output_weight.dtype)
        logits = self.lm_head(hidden) if self.lm_head is not None else F.linear(hidden, self.output_weight)
        return logits.float() if self.fp32_logits else logits

    def _fused_head(self) -> bool:
        # A tensor-parallel head holds a vocabulary slice (a DTensor): it keeps the exact path.
        return self.fast and not isinstance(self.output_weight, DTensor)

    def head_loss_sum(self, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 cross entropy summed over targets != IGNORE_INDEX, their count) for hidden (B, T, C) and
        shifted targets (B, T): fused and chunked when fast, else through the full logits."""
        if not self._fused_head():
            return lm_loss_sum(self.head(hidden), targets)
        if self.fp32_logits:
            hidden = hidden.to(self.output_weight.dtype)
        return fast_lm_loss_sum(hidden, self.output_weight, targets)

    def token_logps(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, targets: torch.Tensor, *,
                    chunk: int | None = None, temperature: float = 1.0,
                    position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) fp32 log-probs of `targets` (B, T: the next token at each position, IGNORE_INDEX where
        nothing is scored, 0 there) under logits / temperature: the backbone's hidden states through
        `hidden_token_logps` (this class's forward would also run the head on the last position, unused).
        `position_ids`: packed rows' (positions restarting per sample). Under DDP call the wrapper's forward
        and `hidden_token_logps` instead."""
        head = deferred_head(self)  # before the backbone (kiln.models.common.tied_grad)
        if type(self).forward is ForCausalLM.forward:
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)
        else:  # a family's own forward (what it adds to the backbone's hidden states)
            out = self.forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               logits_to_keep=1)
            hidden = out.last_hidden_state
        return self.hidden_token_logps(hidden, targets, chunk=chunk, temperature=temperature, head=head)

    def hidden_token_logps(self, hidden: torch.Tensor, targets: torch.Tensor, *, chunk: int | None = None,
                           temperature: float = 1.0, head: torch.Tensor | None = None) -> torch.Tensor:
        """`token_logps` from the hidden states (B, T, C): on the fast path the head runs only where a target
        is, `chunk` rows at a time (no (tokens x vocab) logits); on the exact path through the full logits.
        `head`: the head's weight as `deferred_head` gave it (the fast path), else `output_weight`."""
        keep = targets != IGNORE_INDEX  # (B, T)
        if not self._fused_head():  # the exact path: the full logits, as TRL's selective_log_softmax
            picked = exact_token_logps(self.head(hidden), targets.clamp(min=0), temperature)
            return picked.masked_fill(~keep, 0.0)
        if self.fp32_logits:
            hidden = hidden.to(self.output_weight.dtype)
        bias = None if self.lm_head is None else self.lm_head.bias
        weight = self.output_weight if head is None else head
        picked = linear_token_logps(hidden[keep], weight, targets[keep], bias, chunk, temperature)  # (N,)
        return torch.zeros(keep.shape, dtype=torch.float32, device=hidden.device).index_put((keep,), picked)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                cache: Any = None, logits_to_keep: int = 0, output_router_logits: bool | None = None,
                targets: torch.Tensor | None = None) -> CausalLMOutput:
        """`labels` (B, T) as transformers takes them (`.loss`, their mean); `targets` (B, T) already
        shifted (`.loss_sum`, `.loss_count`). With `fast` on and either given, no logits come back."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            inputs_embeds=inputs_embeds, cache=cache)  # (B, T, C)
        logits = loss = loss_sum = count = None
        if self._fused_head() and not logits_to_keep and (labels is not None or targets is not None):
            loss_sum, count = self.head_loss_sum(hidden, targets if targets is not None else
                                                 shift_labels(labels).to(hidden.device))
            if labels is not None:
                loss = loss_sum / count
        else:
            logits = self.head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden)  # (B, T, V)
            loss = causal_lm_loss(logits, labels) if labels is not None else None
            if targets is not None:
                loss_sum, count = lm_loss_sum(logits, targets)
        if output_router_logits is None:
            output_router_logits = bool(getattr(self.config, "output_router_logits", False))
        router, aux = None, None
        if output_router_logits:
            router = _router_logits(self.model)
            if router:
                # router logits come only from MoE layers, which a family builds only from a config with these
                c = cast(RoutedConfig, self.config)
                aux = load_balancing_loss(router, c.num_experts, c.num_experts_per_tok, attention_mask)
                if loss is not None:
                    loss = loss + c.router_aux_loss_coef * aux
        return CausalLMOutput(logits=logits, loss=loss, last_hidden_state=hidden, aux_loss=aux, router_logits=router,
                              cache=cache, loss_sum=loss_sum, loss_count=count)

    @torch.no_grad()
    def packs_samples(self) -> bool:
        """Whether a packed row (samples side by side, positions restarting at each) gives every sample
        the hidden states it gets alone: asked of the backbone itself on a 5-token row of two samples."""
        p = next(self.parameters())
        if p.is_meta:  # built on meta for a sharded read (no weights yet): asked of the family's tiny model
            # Family.build is what sets a model's family (FamilySpec is the floor's view of that Family)
            family = cast("Family", self.family)
            if family.tiny is None:
                return False
            config = family.config_cls.from_dict(family.tiny.config, source=f"{family.model_type} tiny config")
            with torch.random.fork_rng(devices=[]):  # the question draws nothing from the run's generator
                torch.manual_seed(0)
                # the family builds this task as the class it built self as
                small = cast(ForCausalLM, family.build(config, self.task))
                small.init_weights()
                return small.packs_samples()
        ids = torch.tensor([[1, 2, 3, 4, 5]], device=p.device) % self.vocab_size
        positions = torch.tensor([[0, 1, 2, 0, 1]], device=p.device)
        was_training = self.training
        self.eval()
        try:
            packed = self.model(input_ids=ids, position_ids=positions)[:, 3:].float()  # (1, 2, C)
            alone = self.model(input_ids=ids[:, 3:], position_ids=positions[:, 3:]).float()
        finally:
            self.train(was_training)
        tol = 1e-4 if p.dtype == torch.float32 else 2e-2
        return bool(torch.allclose(packed, alone, rtol=tol, atol=tol * float(alone.abs().max().clamp(min=1))))

    def new_cache(self) -> Any:
        """An empty decoding cache for `generate`: the backbone's own, else a KV cache per layer."""
        make = getattr(self.model, "new_cache", None)
        # a backbone without a cache of its own is the transformer Decoder, whose layers are a ModuleList
        return make() if make is not None else KVCache(len(cast(nn.ModuleList, self.model.layers)))

    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Prompt (B, T) -> prompt + new tokens; see `kiln.models.generation.generate`."""
        from kiln.models.common.generation import generate

        return generate(self, input_ids, **kwargs)
