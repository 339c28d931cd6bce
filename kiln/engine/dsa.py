"""The engine's forward over sparse latent attention (DeepSeek-V3.2, GLM-5): MLA plus the DSA indexer.

A layer with its own indexer caches the indexer's key (index_head_dim numbers, rope applied) beside the shared
rope key in its value slot of the paged cache; a GLM-5 "shared" layer caches nothing more and reuses the last
indexer layer's choice, as the model does. Each query row scores the keys of its blocks as common/dsa.py does
(per head relu(q . k) / sqrt(D), summed with the row's head weights, float32), one (heads x D) @ (D x block)
product per row and block, so a key's score never depends on the batch; the row keeps its top index_topk keys
at or before its position (`exact.top_keys`: equal scores go to the earlier key, where the model's torch.topk
leaves the order of equal scores unspecified) and attends to those alone (`exact.attend`'s keep).
Everything else is the latent-attention runner's (kiln.engine.mla).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from kiln.engine.exact import top_keys
from kiln.engine.mla import MLARunner, main_layers
from kiln.engine.runner import register
from kiln.models.common.mla import MLADecoderLayer


@register
class DSARunner(MLARunner):
    """Runs a ForCausalLM over `MLADecoder` whose layers attend sparsely (an indexer, or a shared choice)."""

    families = ("deepseek_v32", "glm_moe_dsa")

    @classmethod
    def accepts(cls, model: nn.Module) -> bool:
        return cls.latent(model) and any(layer.self_attn.sparse for layer in main_layers(model.model))

    def _setup(self) -> None:
        super()._setup()
        self._picks: dict[int, torch.Tensor] = {}  # attention group -> the last indexer layer's choice

    def _extra_slot(self, i: int) -> int:
        a = self.backbone.layers[i].self_attn
        return a.indexer.head_dim if a.sparse == "full" else 0

    def _index_tile(self, layer: MLADecoderLayer, h: torch.Tensor, q_resid: torch.Tensor | None,
                    cos: torch.Tensor, sin: torch.Tensor) -> list[torch.Tensor]:
        """[the indexer's key (D) | its queries (heads x D) | its head weights (heads)] of a tile's rows."""
        a = layer.self_attn
        if a.sparse != "full":
            return []
        ix, T = a.indexer, h.shape[0]
        split = [ix.rope_dim, ix.head_dim - ix.rope_dim]  # the rope dims come first in the indexer
        q_rot, q_pass = ix.wq_b(q_resid).view(T, ix.num_heads, ix.head_dim).split(split, -1)
        k_rot, k_pass = ix.k_norm(ix.wk(h))[:, None].split(split, -1)
        q_rot, k_rot = ix.rope_fn(q_rot, k_rot, cos, sin)
        weights = ix.weights_proj(h.to(ix.weights_proj.weight.dtype)).to(h.dtype)
        return [torch.cat([k_rot, k_pass], -1).flatten(1), torch.cat([q_rot, q_pass], -1).flatten(1), weights]

    def _keep(self, i: int, group: int, extras: torch.Tensor, cached: torch.Tensor, pos: torch.Tensor
              ) -> torch.Tensor | None:
        a = self.backbone.layers[i].self_attn
        if a.sparse == "shared":
            return self._picks[group]  # the model's config check makes the first layer an indexer layer
        if a.sparse != "full":
            return None
        ix, T = a.indexer, extras.shape[0]
        H, D = ix.num_heads, ix.head_dim
        with torch.no_grad():  # a choice: nothing differentiable leaves it (the model's indexer runs so too)
            q = extras[:, :H * D].view(T, 1, H, D).float()
            weights = extras[:, H * D:H * D + H].float() * H**-0.5  # (T, H)
            keys = cached[:, :, :, 0, self.rope_dim:].float()  # (X, NB, BS, D)
            NB, BS = keys.shape[1:3]
            scores = F.relu(torch.matmul(q, keys.transpose(-1, -2)) * ix.softmax_scale)  # (T, NB, H, BS)
            index = torch.matmul(weights.view(T, 1, 1, H), scores).view(T, NB * BS)  # summed over heads per block
            keep = top_keys(index, pos, ix.topk)
        self._picks[group] = keep
        return keep
