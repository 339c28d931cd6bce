"""Multi-token prediction (DeepSeek-V3, depth 1): one extra decoder layer that predicts token t+2.

At position i the main model's last hidden state h_i (after its final norm) and the embedding of
the next token t_{i+1} (the main model's own embedding table) are normalised apart, concatenated
embedding first, as DeepSeek-V3's checkpoints and transformers' MtpLayer order them (the report's
formula writes the hidden state first), and projected back to the hidden size:

    x_i = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)])          (B, T, 2C) -> (B, T, C)

then one decoder layer of the model's own kind runs causally over x, `shared_head.norm` normalises
it, and the main LM head scores it against t_{i+2}. The layer sits at `model.layers.{num_hidden_layers}`,
its checkpoint name; the checkpoint's own copies of the embedding and head
(`embed_tokens`, `shared_head.head`) are the main model's tensors, shared.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.constants import IGNORE_INDEX
from kiln.models.common.mla import MLADecoderLayer, MLASpec
from kiln.models.common.norms import RMSNorm


class SharedHead(nn.Module):
    """The checkpoint's `shared_head`: its own norm; the head itself is the main LM head."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class MTPLayer(MLADecoderLayer):
    def __init__(self, spec: MLASpec, mlp: nn.Module, layer_idx: int, eps: float):
        super().__init__(spec, mlp, layer_idx, eps)
        C = spec.hidden_size
        self.enorm = RMSNorm(C, eps)
        self.hnorm = RMSNorm(C, eps)
        self.eh_proj = nn.Linear(2 * C, C, bias=False)
        self.shared_head = SharedHead(C, eps)

    def predict(self, hidden: torch.Tensor, next_embeds: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                mask: torch.Tensor | None) -> torch.Tensor:
        """hidden (B, T, C) of the main model, next_embeds (B, T, C) = Emb(t_{i+1}) -> normed states (B, T, C)."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        x, _ = self(x, rope, mask)
        return self.shared_head.norm(x)


def next_inputs(input_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) ids -> the next token at each position; the last position repeats its own (no target there)."""
    return torch.cat([input_ids[:, 1:], input_ids[:, -1:]], dim=1)


def mtp_targets(targets: torch.Tensor) -> torch.Tensor:
    """Next-token targets (B, T) -> next-next-token targets: t_{i+2} where both t_{i+1} and t_{i+2} are targets.

    Requiring the next target too keeps a position from predicting across an ignored stretch (a packed
    sample's end, a prompt) it never saw."""
    later = torch.cat([targets[:, 1:], targets.new_full((targets.shape[0], 1), IGNORE_INDEX)], dim=1)
    return later.masked_fill(targets == IGNORE_INDEX, IGNORE_INDEX)
