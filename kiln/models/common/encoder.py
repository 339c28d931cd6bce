"""The post-LayerNorm encoder scaffold shared by BERT, RoBERTa, DistilBERT, XLM-R and friends.

Embeddings (word [+ token type] [+ position]) -> LayerNorm -> dropout, then N layers of
  h = norm(x + dropout(attn(x)));  y = norm(h + dropout(down(act(up(h)))))
and an optional pooler (tanh(dense(h[:, 0]))). Families pass sizes and switches; nothing here
knows a family by name.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from kiln.errors import ConfigError
from kiln.models.common.activations import activation
from kiln.models.common.attention import SelfAttention, bidirectional_mask


def positions_from_padding(input_ids: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """RoBERTa-style positions: count real tokens from padding_idx + 1; pads keep padding_idx."""
    real = input_ids.ne(padding_idx).int()
    return (torch.cumsum(real, dim=1).type_as(real) * real).long() + padding_idx


class Embeddings(nn.Module):
    def __init__(self, vocab_size: int, dim: int, max_positions: int, type_vocab_size: int, pad_token_id: int | None,
                 eps: float, dropout: float, padding_positions: bool = False, norm_bias: bool = True):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, dim, padding_idx=pad_token_id)
        self.position_embeddings = nn.Embedding(max_positions, dim, padding_idx=pad_token_id if padding_positions else None) if max_positions else None
        self.token_type_embeddings = nn.Embedding(type_vocab_size, dim) if type_vocab_size else None
        self.norm = nn.LayerNorm(dim, eps=eps, bias=norm_bias)  # ModernBERT: no norm bias by default
        self.dropout = nn.Dropout(dropout)
        self.pad_token_id = pad_token_id
        self.padding_positions = padding_positions  # RoBERTa: positions skip pads, start at pad + 1

    def position_ids(self, input_ids: torch.Tensor | None, shape: torch.Size, device: torch.device) -> torch.Tensor:
        if self.padding_positions:
            if self.pad_token_id is None:
                raise ConfigError("positions that skip padding (RoBERTa) need the config's pad_token_id")
            if input_ids is not None:
                return positions_from_padding(input_ids, self.pad_token_id)
            start = self.pad_token_id + 1
            return torch.arange(start, start + shape[1], device=device).unsqueeze(0).expand(shape)
        return torch.arange(shape[1], device=device).unsqueeze(0)

    def forward(self, input_ids: torch.Tensor | None = None, token_type_ids: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        x = self.word_embeddings(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, C)
        shape = x.shape[:-1]
        if self.token_type_embeddings is not None:
            if token_type_ids is None:
                token_type_ids = torch.zeros(shape, dtype=torch.long, device=x.device)
            x = x + self.token_type_embeddings(token_type_ids)
        if self.position_embeddings is not None:
            if position_ids is None:
                position_ids = self.position_ids(input_ids, shape, x.device)
            x = x + self.position_embeddings(position_ids)
        return self.dropout(self.norm(x))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.up_proj = nn.Linear(dim, hidden)
        self.act = activation(act)
        self.down_proj = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, num_heads: int, intermediate: int, act: str, eps: float, dropout: float,
                 attn_dropout: float, attn_output_dropout: bool = True, mlp_output_dropout: bool = True,
                 attn: nn.Module | None = None):
        super().__init__()
        # `attn` replaces the SDPA block (DeBERTa's disentangled attention); it maps (x, mask, **inputs) -> x.
        self.attn = attn if attn is not None else SelfAttention(dim, num_heads, attn_dropout)
        self.attn_norm = nn.LayerNorm(dim, eps=eps)
        self.mlp = MLP(dim, intermediate, act)
        self.mlp_norm = nn.LayerNorm(dim, eps=eps)
        # DistilBERT applies no dropout to the attention output, only after the MLP; ALBERT the reverse.
        self.attn_dropout = nn.Dropout(dropout) if attn_output_dropout else nn.Identity()
        self.mlp_dropout = nn.Dropout(dropout) if mlp_output_dropout else nn.Identity()

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, **attn_inputs) -> torch.Tensor:
        h = self.attn_norm(self.attn_dropout(self.attn(x, mask, **attn_inputs)) + x)
        return self.mlp_norm(self.mlp_dropout(self.mlp(h)) + h)


class Pooler(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dense = nn.Linear(dim, dim)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class Encoder(nn.Module):
    """Embeddings + layers (+ pooler). Returns (last hidden state (B, T, C), pooled (B, C) or None)."""

    def __init__(self, embeddings: nn.Module, layers: Sequence[nn.Module], pooler: nn.Module | None = None):
        super().__init__()
        self.embeddings = embeddings
        self.layers = nn.ModuleList(layers)
        self.pooler = pooler

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = self.embeddings(input_ids=input_ids, token_type_ids=token_type_ids, position_ids=position_ids,
                            inputs_embeds=inputs_embeds)
        mask = bidirectional_mask(attention_mask, x.shape[1])
        for layer in self.layers:
            x = layer(x, mask)
        return x, (self.pooler(x) if self.pooler is not None else None)
