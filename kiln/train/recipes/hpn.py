"""[hpn]: a hyperspherical prototype head over the vocabulary on top of the causal LM being
pre-trained (kiln.models.hpn.PrototypeModel), its loss and the LM head's loss combined as the
multi-objective settings say (sum, PCGrad, GradNorm, CAGrad; kiln.train.multiobjective)."""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import model_validator
from torch import nn

from kiln.errors import ConfigError
from kiln.train.config import NonNegative, Positive, RunConfig, Section
from kiln.train.recipes.base import Extension, RunParts, Shortcut


class HpnSection(Section):
    """A hyperspherical prototype head over the vocabulary on top of the causal LM (kiln.models.hpn)."""
    proto_dim: int | None = None       # default: the model's hidden size
    scale: Positive = 10.0
    mode: Literal["fixed", "learnable"] = "fixed"
    loss: Literal["ce", "cosine"] = "cosine"
    spread_steps: int = 300
    lm_loss: bool = True               # keep the LM head's loss as a second objective
    objectives: Literal["sum", "pcgrad", "gradnorm", "cagrad"] = "sum"
    cagrad_c: NonNegative = 0.5              # CAGrad: how far the update may leave the mean gradient
    gradnorm_alpha: NonNegative = 1.5        # GradNorm: strength of the pull toward equal training rates
    gradnorm_lr: NonNegative = 0.025         # GradNorm: step of the loss weights

    @model_validator(mode="after")
    def _check(self) -> HpnSection:
        for name in ("cagrad_c", "gradnorm_alpha", "gradnorm_lr"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"hpn.{name} must be >= 0, got {getattr(self, name)}")
        return self


def hpn_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{"prototype": ..., "lm": ...} mean losses of a PrototypeModel on one stream batch."""
    return model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), targets=batch["targets"]).losses


class Hpn(Extension[HpnSection]):
    section = "hpn"
    schema = HpnSection
    summary = "prototype head over the vocabulary + LM loss, combined by sum/pcgrad/gradnorm/cagrad"
    recipes = ("pretrain",)
    shortcuts = (Shortcut("scale", "hpn.scale"), Shortcut("prototype_mode", "hpn.mode"),
                 Shortcut("proto_dim", "hpn.proto_dim"), Shortcut("objectives", "hpn.objectives"))

    def extend(self, cfg: RunConfig, parts: RunParts) -> None:
        from kiln.models.common.config import text_sizes
        from kiln.models.hpn import PrototypeModel
        from kiln.models.pretrained import PreTrainedModel
        from kiln.train.multiobjective import GradientCombiner

        h = self.table(cfg)
        inner = parts.model
        if not isinstance(inner, PreTrainedModel):
            raise ConfigError(f"[hpn] puts its head over a kiln model's vocabulary, not a {type(inner).__name__}")
        parts.model = PrototypeModel(inner, text_sizes(inner.config).vocab_size, proto_dim=h.proto_dim, scale=h.scale,
                                     mode=h.mode, loss=h.loss, spread_steps=h.spread_steps, lm_loss=h.lm_loss,
                                     seed=cfg.model.init_seed)
        parts.step = hpn_step
        parts.objectives = GradientCombiner(h.objectives, seed=cfg.train.seed, cagrad_c=h.cagrad_c,
                                            gradnorm_alpha=h.gradnorm_alpha, gradnorm_lr=h.gradnorm_lr)


EXTENSION = Hpn()
