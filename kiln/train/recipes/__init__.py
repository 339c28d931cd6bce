"""The kinds of runs `kiln train` knows, and the extensions a run config may switch on.

A new recipe (or extension) is one file in this folder and one line below; `kiln train --help`,
the run-config schema (its TOML table) and `build_trainer` pick it up from here.
"""

from __future__ import annotations

from kiln.train.recipes import ff, finetune, grow, hpn, moe, pretrain, sft
from kiln.train.recipes.base import Extension, Recipe, RunParts, Shortcut

# Tried in order; the first that matches a run config runs it (fine-tune is the fallback).
RECIPES: dict[str, Recipe] = {r.name: r for r in (pretrain.RECIPE, sft.RECIPE, finetune.RECIPE)}
EXTENSIONS: dict[str, Extension] = {e.section: e for e in (hpn.EXTENSION, grow.EXTENSION, ff.EXTENSION, moe.EXTENSION)}


def recipe_for(cfg) -> Recipe:
    return next(r for r in RECIPES.values() if r.matches(cfg))


def active_extensions(cfg) -> list[Extension]:
    return [e for e in EXTENSIONS.values() if getattr(cfg, e.section, None) is not None]


def shortcuts() -> list[Shortcut]:
    return [s for r in (*RECIPES.values(), *EXTENSIONS.values()) for s in r.shortcuts]


__all__ = ["Extension", "Recipe", "RunParts", "Shortcut", "RECIPES", "EXTENSIONS", "recipe_for",
           "active_extensions", "shortcuts"]
