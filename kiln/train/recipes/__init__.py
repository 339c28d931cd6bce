"""The kinds of runs `kiln train` knows, and the extensions a run config may switch on.

A new recipe (or extension) is one file in this folder and one line below; `kiln train --help`,
the run-config schema and `build_trainer` pick it up from here. The registry builds the schema: per
recipe, the core tables (kiln.train.config) with [data] typed as the recipe's own data schema, plus an
optional table per extension; `SCHEMA` picks the model for a parsed TOML (installed into
kiln.train.config below, so that module imports no recipe).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import create_model

from kiln.train import grpo_async  # noqa: F401  (agent3: registers [grpo] async's callback)
from kiln.train.config import ModelSection, RunConfig, use_run_schema
from kiln.train.recipes import (
    distill,
    dpo,
    embedding,
    ff,
    finetune,
    grow,
    grpo,
    hpn,
    images,
    kto,
    moe,
    pretrain,
    reward_model,
    sft,
)
from kiln.train.recipes.base import Extension, Recipe, RunParts, Shortcut

# Tried in order; the first that matches a run config runs it (fine-tune is the fallback); a table that
# brings its recipe ([dpo], [grpo]) selects it whatever the order.
RECIPES: dict[str, Recipe] = {r.name: r for r in (pretrain.RECIPE, sft.RECIPE, images.RECIPE, embedding.RECIPE,
                                                  reward_model.RECIPE, finetune.RECIPE, dpo.RECIPE, grpo.RECIPE,
                                                  kto.RECIPE, distill.RECIPE)}
EXTENSIONS: dict[str, Extension[Any]] = {e.section: e for e in (hpn.EXTENSION, grow.EXTENSION, ff.EXTENSION, moe.EXTENSION,
                                                           embedding.EXTENSION, dpo.EXTENSION, grpo.EXTENSION,
                                                           reward_model.EXTENSION, kto.EXTENSION,
                                                           distill.EXTENSION)}


def select_recipe(task: str, data: Mapping[str, Any]) -> Recipe:
    """The recipe that runs model.task `task` on the [data] table `data` (as written, paths resolved)."""
    return next(r for r in RECIPES.values() if r.matches(task, data))


def recipe_for(cfg: RunConfig) -> Recipe:
    """The recipe of a validated run config: the one its model was assembled for."""
    if type(cfg).recipe in RECIPES:
        return RECIPES[type(cfg).recipe]
    return select_recipe(cfg.model.task, cfg.data.model_dump())  # a core RunConfig built by hand


def active_extensions(cfg: RunConfig) -> list[Extension[Any]]:
    return [e for e in EXTENSIONS.values() if getattr(cfg, e.section, None) is not None]


def shortcuts() -> list[Shortcut]:
    return [*(s for r in RECIPES.values() for s in r.shortcuts), *(s for e in EXTENSIONS.values() for s in e.shortcuts)]


@functools.cache
def run_config_model(recipe: str) -> type[RunConfig]:
    """RunConfig for `recipe` runs: [data] as its data schema, an optional table per extension."""
    tables: dict[str, Any] = {name: (ext.schema | None, None) for name, ext in EXTENSIONS.items()}
    model = create_model("RunConfig", __base__=RunConfig, __module__=RunConfig.__module__,
                         data=(RECIPES[recipe].data_schema, ...), **tables)
    model.recipe = recipe
    return model


class _Schema:
    """kiln.train.config.RunSchema over this registry."""

    def model_for(self, table: Mapping[str, Any]) -> type[RunConfig]:
        for ext in EXTENSIONS.values():  # a table that brings its own recipe ([dpo]) selects it
            recipe = getattr(ext, "recipe", None)  # an extension with the Protocol's shape may not declare it
            if recipe and ext.section in table:
                return run_config_model(recipe)
        model, data = table.get("model"), table.get("data")
        task = model.get("task") if isinstance(model, Mapping) else None
        task = task if isinstance(task, str) else ModelSection.model_fields["task"].default
        return run_config_model(select_recipe(task, data if isinstance(data, Mapping) else {}).name)

    def misplaced(self, table: Mapping[str, Any], model: type[RunConfig], key: str) -> str | None:
        section, _, leaf = key.partition(".")
        if section != "data" or "." in leaf or model.recipe not in RECIPES:
            return None
        owners = [r for r in RECIPES.values() if leaf in r.data_schema.model_fields]
        if not owners:
            return None
        mine = RECIPES[model.recipe]
        where = " and ".join(f"the {r.name} recipe ({r.when})" for r in owners)
        hint = f"this run config runs the {mine.name} recipe ({mine.when}); data.{leaf} belongs to {where}"
        data = table.get("data")
        train = data.get("train") if isinstance(data, Mapping) else None
        if isinstance(train, str) and not Path(train).exists():  # the recipe is chosen by what data.train holds
            hint += f"; data.train {train} does not exist, so what it holds could not decide"
        elif isinstance(train, str) and Path(train).is_dir() and not any(Path(train).iterdir()):
            hint += f"; data.train {train} is an empty folder, so what it holds could not decide"
        return hint


SCHEMA = _Schema()
use_run_schema(SCHEMA)

__all__ = [
    "EXTENSIONS",
    "RECIPES",
    "SCHEMA",
    "Extension",
    "Recipe",
    "RunParts",
    "Shortcut",
    "active_extensions",
    "recipe_for",
    "run_config_model",
    "select_recipe",
    "shortcuts",
]
