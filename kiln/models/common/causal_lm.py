"""The causal-LM task models over any backbone: the bare base model and backbone + LM head.

A backbone (the transformer `Decoder`, `MambaBackbone`, ...) maps token ids to the last hidden
state (B, T, C) and takes `input_ids, attention_mask, position_ids, inputs_embeds, cache` by
keyword; one that decodes incrementally makes its cache with `new_cache()` (None: generation
re-reads the whole sequence each step). The head is HF's `lm_head`, or with tied embeddings the
input embedding matrix itself (no tensor of its own). What differs between families is data
given to the constructor: where the embedding sits, and whether logits come back in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from kiln.models.common.decoder import KVCache
from kiln.models.common.loss import causal_lm_loss
from kiln.models.common.moe import load_balancing_loss
from kiln.models.pretrained import PreTrainedModel
from kiln.models.tasks import BASE, CAUSAL_LM


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None
    router_logits: tuple[torch.Tensor, ...] | None = None
    cache: Any = None


def _router_logits(backbone: nn.Module) -> tuple[torch.Tensor, ...]:
    """The router logits each MoE block kept from this forward, in layer order."""
    found = (getattr(m, "router_logits", None) for m in backbone.modules())
    return tuple(r for r in found if r is not None)


class DecoderModel(PreTrainedModel):
    """The backbone alone (HF's `{Arch}Model`): returns the last hidden state."""
    default_task = BASE

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
    default_task = CAUSAL_LM

    def __init__(self, model: nn.Module, hidden_size: int, vocab_size: int, tied: bool,
                 embedding: str = "embed_tokens", fp32_logits: bool = False):
        super().__init__()
        self.model = model
        self.lm_head = None if tied else nn.Linear(hidden_size, vocab_size, bias=False)
        self.embedding, self.fp32_logits = embedding, fp32_logits

    @property
    def output_weight(self) -> torch.Tensor:
        return getattr(self.model, self.embedding).weight if self.lm_head is None else self.lm_head.weight

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                cache: Any = None, logits_to_keep: int = 0,
                output_router_logits: bool | None = None) -> CausalLMOutput:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            inputs_embeds=inputs_embeds, cache=cache)  # (B, T, C)
        h = hidden[:, -logits_to_keep:] if logits_to_keep else hidden
        if self.fp32_logits:
            h = h.to(self.output_weight.dtype)
        logits = self.lm_head(h) if self.lm_head is not None else F.linear(h, self.output_weight)  # (B, T, V)
        if self.fp32_logits:
            logits = logits.float()
        loss = causal_lm_loss(logits, labels) if labels is not None else None
        if output_router_logits is None:
            output_router_logits = bool(getattr(self.config, "output_router_logits", False))
        router, aux = None, None
        if output_router_logits:
            router = _router_logits(self.model)
            if router:
                c = self.config
                aux = load_balancing_loss(router, c.num_experts, c.num_experts_per_tok, attention_mask)
                if loss is not None:
                    loss = loss + c.router_aux_loss_coef * aux
        return CausalLMOutput(logits=logits, loss=loss, last_hidden_state=hidden, aux_loss=aux, router_logits=router,
                              cache=cache)

    def new_cache(self) -> Any:
        """An empty decoding cache for `generate`: the backbone's own, else a KV cache per layer."""
        make = getattr(self.model, "new_cache", None)
        return make() if make is not None else KVCache(len(self.model.layers))

    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """Prompt (B, T) -> prompt + new tokens; see `kiln.models.generation.generate`."""
        from kiln.models.generation import generate

        return generate(self, input_ids, **kwargs)
