"""A decoder's sequence-classification head (HF's `{Arch}ForSequenceClassification`): the backbone, then
`score`, a bias-free Linear (hidden -> num_labels), read at each row's last token.

As transformers' generic head: the row's score is taken at its rightmost token that is not
`config.pad_token_id` (right or left padding alike; a row of pads reads position 0); with no pad id a
batch of one reads the last position and a larger batch is refused. The loss for `labels` is
transformers' sequence-classification loss (regression for one label, as a reward model is).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kiln.errors import KilnError
from kiln.models.common import scored_tail
from kiln.models.common.causal_lm import ForCausalLM
from kiln.models.heads import ForSequenceClassification, ModelOutput
from kiln.models.pretrained import PreTrainedModel

if TYPE_CHECKING:  # (decoder_lm builds this head)
    from kiln.models.decoder_lm import DecoderConfig


def last_token_index(input_ids: torch.Tensor, pad_token_id: int | None) -> torch.Tensor:
    """(B,) the position each row is read at: its rightmost non-pad token (transformers' rule)."""
    B, T = input_ids.shape
    if pad_token_id is None:
        if B != 1:
            raise KilnError("a decoder's sequence score needs config.pad_token_id to find each row's last token "
                            f"in a batch of {B}; set pad_token_id in config.json")
        return torch.full((1,), T - 1, dtype=torch.long, device=input_ids.device)
    real = (input_ids != pad_token_id).to(torch.int32)
    return (torch.arange(T, device=input_ids.device, dtype=torch.int32) * real).argmax(-1)


class DecoderForSequenceClassification(ForSequenceClassification):
    """Backbone + `score` at the last token; `problem_type` and `loss` as the encoders' head."""

    def __init__(self, model: nn.Module, hidden_size: int, num_labels: int):
        PreTrainedModel.__init__(self)  # not the encoders' (model, head): the head here is HF's `score`
        self.model = model
        self.score = nn.Linear(hidden_size, num_labels, bias=False)

    # whether packed rows keep samples apart: the causal LM's question, asked of the same backbone
    packs_samples = ForCausalLM.packs_samples
    config: DecoderConfig

    @property
    def vocab_size(self) -> int:
        """The vocabulary the borrowed packs_samples draws its probe ids below (the causal LM keeps it as a field)."""
        return self.config.vocab_size

    def forward(self, input_ids=None, attention_mask=None,  # type: ignore[override]  # a decoder: no token_type_ids
                position_ids=None, inputs_embeds=None, labels=None, read_at: torch.Tensor | None = None) -> ModelOutput:
        """`read_at` (2, N): the (row, position) of each score, for rows that hold several sequences (packed, their
        positions restarting per sequence) or to read padded rows where the caller chose: one score per sequence.
        Given it, the last layer runs only at those positions where kiln.models.common.scored_tail applies (then
        the output has no last_hidden_state)."""
        if input_ids is None:
            raise KilnError("a decoder's sequence score reads input_ids to find each row's last token")
        if read_at is not None and inputs_embeds is None and scored_tail.applies(self.model, self.training):
            at = read_at.to(input_ids.device)
            logits = self.score(scored_tail.scored_hidden(self.model, input_ids, attention_mask, position_ids,
                                                          at[0], at[1]))
            return ModelOutput(logits=logits, loss=None if labels is None else self.loss(logits, labels))
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            inputs_embeds=inputs_embeds)  # (B, T, C)
        if read_at is not None:
            logits = self.score(hidden[read_at[0], read_at[1]])  # (N, labels): only where a score is read
        else:
            rows = torch.arange(input_ids.shape[0], device=hidden.device)
            # the head over every position, then one row each, as transformers (the exact path stays bitwise equal)
            logits = self.score(hidden)[rows, last_token_index(input_ids, self.config.pad_token_id).to(hidden.device)]
        return ModelOutput(logits=logits, loss=None if labels is None else self.loss(logits, labels),
                           last_hidden_state=hidden)
