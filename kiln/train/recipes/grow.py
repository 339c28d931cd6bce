"""[grow]: staged expansion of the layer stack during a run (kiln.train.grow): new layers placed as
`placement` says after `at_step` optimizer steps, freezing policies before and after."""

from __future__ import annotations

import re

from pydantic import field_validator, model_validator
from torch import nn

from kiln.train.config import RunConfig, Section, check_freeze_specs
from kiln.train.recipes.base import Extension, RunParts, Shortcut

# The shape of grow.placement; kiln.train.grow checks the indices against the layer count, which only
# the built model knows. Checked here so a typo fails before step 1.
_PLACEMENT = re.compile(r"append|prepend|insert:\d+|specific:\d+(,\d+)*")


class GrowSection(Section):
    """Staged expansion (kiln.train.grow): grow after `at_step` optimizer steps."""
    at_step: int
    target_layers: int
    placement: str = "append"          # append, prepend, insert:N, specific:i,j,...
    freeze: list[str] = []             # from the start; the train.freeze language (first:N, last:N,
    freeze_after: list[str] = []       # layers:i,j, embeddings, name prefixes/globs); _after: on the grown stack

    @field_validator("placement")
    @classmethod
    def _placement(cls, value: str) -> str:
        if not _PLACEMENT.fullmatch(value):
            raise ValueError(f"{value!r} is not a placement: use append, prepend, insert:N or specific:i,j,...")
        return value

    @field_validator("freeze", "freeze_after")
    @classmethod
    def _freeze(cls, value: list[str]) -> list[str]:
        return check_freeze_specs(value)

    @model_validator(mode="after")
    def _check(self) -> GrowSection:
        if self.at_step < 1 or self.target_layers < 1:
            raise ValueError(f"grow.at_step and grow.target_layers must be >= 1, got {self.at_step} and "
                             f"{self.target_layers}")
        return self


class Grow(Extension[GrowSection]):
    section = "grow"
    schema = GrowSection
    summary = "grow the layer stack at a step (append/prepend/insert/specific), freeze policies"
    recipes = ("pretrain",)
    shortcuts = (Shortcut("placement", "grow.placement"), Shortcut("target_layers", "grow.target_layers"),
                 Shortcut("grow_at", "grow.at_step"), Shortcut("freeze", "grow.freeze", multiple=True),
                 Shortcut("freeze_after", "grow.freeze_after", multiple=True))

    def on_model(self, cfg: RunConfig, model: nn.Module) -> None:
        from kiln.train.grow import find_layers, new_layer_slots

        grow = self.table(cfg)
        new_layer_slots(grow.placement, len(find_layers(model)[1]), grow.target_layers)

    def extend(self, cfg: RunConfig, parts: RunParts) -> None:
        from kiln.train.grow import GrowthCallback, GrowthPlan

        parts.callbacks.append(GrowthCallback(GrowthPlan(**self.table(cfg).model_dump(), seed=cfg.train.seed)))


EXTENSION = Grow()
