"""What a recipe is: the plug-in shape every kind of run (`fine-tune`, `sft`, `pretrain`) and every
recipe extension (`[hpn]`, `[grow]`, ...) takes.

A `Recipe` owns its part of the [data] schema (`data_schema`, a subclass of the core `DataSection`) and
turns a validated run config into `RunParts` (model, data, step, eval, callbacks, fingerprint); exactly
one recipe runs, the first whose `matches(task, data)` is true. An `Extension` owns one TOML table
(present = on), may check the built model, and then changes the parts (wraps the model, swaps the step,
adds callbacks). Both may contribute `kiln train` flags (`Shortcut`s for `--set`). Both are Protocols: a
plug-in subclasses them (for the defaults) or just has their shape. `kiln.train.run.build_trainer` is
the only caller; the Trainer, the core config and the CLI name none.
"""

from __future__ import annotations

import abc
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from kiln.data.stream import StreamLoader
from kiln.errors import ConfigError, KilnError
from kiln.hub import Tokenizer
from kiln.models.auto import AutoConfig, from_config, load_pretrained
from kiln.parallel.mesh import resolve_degrees
from kiln.parallel.sharded_load import lean_pretrained, load_to_device
from kiln.parallel.world import World, launched_world, pick_device
from kiln.train.checks import check_model_tokenizer
from kiln.train.config import DataSection, RunConfig, Section, model_config_overrides
from kiln.train.multiobjective import GradientCombiner
from kiln.train.steps import StepFn
from kiln.train.trainer import Callback, Trainer

SectionT = TypeVar("SectionT", bound=Section)  # an extension's table schema
Examples = Sequence[dict[str, torch.Tensor]]    # encoded examples; the Trainer batches them (kiln.data.loader)
Evaluate = Callable[[Trainer], dict[str, float]]  # a run's own evaluation, given the Trainer


@dataclass(frozen=True)
class Shortcut:
    """A named `kiln train` flag that sets one run-config key (`--d-model 64` = `--set model.config.hidden_size=64`)."""
    flag: str                      # python name; the flag is --flag-with-dashes
    key: str                       # dotted run-config key
    multiple: bool = False         # repeatable, collected into a list


@dataclass
class RunParts:
    """Everything the Trainer is made from; extensions may change any of it."""
    model: nn.Module
    data: Examples | StreamLoader                  # examples (batched by the Trainer) or a ready loader
    eval_data: Examples | None = None
    step: StepFn | None = None                     # None: the task's own loss
    evaluate: Evaluate | None = None               # None: the task's eval over eval_data
    callbacks: list[Callback] = field(default_factory=list)
    objectives: GradientCombiner | None = None     # combines a step's several losses (None: their sum)
    fingerprint: dict[str, Any] = field(default_factory=dict)  # what a resume must find unchanged about the data


class Recipe(Protocol):
    name: str
    summary: str = ""
    when: str = ""                          # when it runs, for messages ("model.task = 'causal-lm' on records")
    data_schema: type[DataSection]          # its [data] keys: the core ones and its own
    shortcuts: tuple[Shortcut, ...] = ()

    @abc.abstractmethod
    def matches(self, task: str, data: Mapping[str, Any]) -> bool:
        """Whether this recipe runs a config of model.task `task` and [data] table `data` (as written,
        paths resolved; its schema is this answer's to choose). Recipes are asked in registry order."""

    @abc.abstractmethod
    def build(self, cfg: RunConfig, on_model: Callable[[nn.Module], None], world: World) -> RunParts:
        """Model (call `on_model(model)` as soon as it exists, before data work) and data for `cfg`, this
        process being `world`'s rank (which part of the data it reads, who verifies files)."""


class Extension(Protocol[SectionT]):
    section: str                            # the TOML table it owns
    schema: type[SectionT]
    summary: str = ""
    shortcuts: tuple[Shortcut, ...] = ()
    recipes: tuple[str, ...] = ()           # the recipes it can extend
    recipe: str | None = None               # a table that brings its own recipe ([dpo]): that recipe runs

    def check(self, cfg: RunConfig, recipe: Recipe) -> None:
        if recipe.name not in self.recipes:
            raise ConfigError(f"[{self.section}] extends the {' / '.join(self.recipes)} recipe(s); this run config "
                              f"is a {recipe.name} run")

    def table(self, cfg: RunConfig) -> SectionT:
        """This extension's validated table in `cfg` (the registry adds one field per extension to the run-config
        model it assembles); only runs that have the table are handed to an extension."""
        value = getattr(cfg, self.section, None)
        if not isinstance(value, self.schema):
            raise KilnError(f"this run config has no [{self.section}] table")
        return value

    def on_model(self, cfg: RunConfig, model: nn.Module) -> None:
        """The built model, before any data is read: refuse what cannot work on it."""
        return None  # a default, not an abstract method: most extensions take any model

    @abc.abstractmethod
    def extend(self, cfg: RunConfig, parts: RunParts) -> None:
        """Change the run's parts: wrap the model, swap the step, add callbacks."""


def shards_weights(cfg: RunConfig) -> bool:
    """This run splits the weights over its processes (fsdp, tp, ep or pp with several of them; not FP8
    training): its model is built on meta and each rank reads only its share."""
    world = launched_world().size
    p = cfg.parallel
    if p is None or world < 2 or cfg.train.precision == "fp8":
        return False
    d = resolve_degrees(p, world)
    return bool(p.fsdp) or d.tp > 1 or d.ep > 1 or d.pp > 1


def run_device(cfg: RunConfig) -> torch.device:
    """The device this process trains on (the Trainer's choice: train.device, this process's local rank)."""
    return pick_device(cfg.train.device, int(os.environ.get("LOCAL_RANK", "0")))


def build_model(cfg: RunConfig, labels: list[str] | None, need_tokenizer: bool = True) -> nn.Module:
    """The [model] section's model: loaded from model.path, or built from model.family + config (with
    model.tokenizer, unless `need_tokenizer` is False: data that is token ids already)."""
    m = cfg.model
    changes: dict[str, Any] = {"labels": labels} if labels else {}
    if m.path is not None:
        changes.update(model_config_overrides(m))  # dropout and the like; a key that reshapes a weight is refused
        # each rank reads its share once the plans are applied (kiln.parallel.sharded_load); a base quantized at
        # load too, each rank quantizing its rows (kiln.parallel.sharded_q4)
        if shards_weights(cfg):
            lean = lean_pretrained(m.path, m.task, m.init_seed, fp8=m.fp8, quantize=m.quantize, **changes)
            if lean is not None:
                return lean
        elif cfg.train.precision != "fp8" and (m.quantize is not None or run_device(cfg).type != "cpu"):
            # file -> GPU tensor by tensor; a base quantized at load (one process, DDP) weight by weight, so the
            # load never holds the model in bf16
            direct = load_to_device(m.path, run_device(cfg), m.task, m.init_seed, fp8=m.fp8, quantize=m.quantize,
                                    **changes)
            if direct is not None:
                return direct
        return load_pretrained(m.path, task=m.task, seed=m.init_seed, fp8=m.fp8, quantize=m.quantize, **changes)
    assert m.family is not None  # ModelSection's validator: exactly one of model.path and model.family
    check_config_keys(m.family, m.config)
    config = AutoConfig.for_model(m.family, **m.config)
    if labels:
        config.set_labels(labels)
    model = from_config(config, task=m.task, seed=m.init_seed)
    if m.tokenizer is None and not need_tokenizer:
        return model
    if m.tokenizer is None:
        raise ConfigError("model.family builds a model from scratch; set model.tokenizer to a directory "
                          "with tokenizer.json or vocab.txt")
    model.tokenizer = Tokenizer.from_dir(m.tokenizer)
    return model


def check_text_model(cfg: RunConfig, model: nn.Module, max_length: int | None) -> None:
    """A model that reads text has a tokenizer and (with `max_length`) positions and vocabulary for it."""
    if model.tokenizer is None:
        raise KilnError(f"{cfg.model.path}: no tokenizer files (tokenizer.json or vocab.txt) in the model directory")
    if max_length is not None:
        check_model_tokenizer(model, max_length, str(cfg.model.path or cfg.model.family), cfg.train.precision)


def add_lora(cfg: RunConfig, model: nn.Module) -> None:
    """[lora]'s adapters on the model's targets (the base frozen), when the run has the table."""
    if cfg.lora is not None:
        from kiln.models.common.lora import LoraConfig, apply_lora

        lora = cfg.lora
        apply_lora(model, LoraConfig(lora.r, lora.alpha, lora.dropout, lora.targets, lora.use_rslora,
                                     lora.target_parameters, str(cfg.model.path) if cfg.model.path else None))



def check_config_keys(family: str, config: dict[str, Any]) -> None:
    """model.config keys the family does not model are kept as transformers keeps them (written back to
    config.json); one a single typo away from a key it does model (a letter left out, added, changed or two
    swapped) would be ignored silently (a `hiden_size` trains at the default size): refused, naming the key."""
    import dataclasses

    from kiln.models.auto import family_for

    fields = sorted({f.name for f in dataclasses.fields(family_for(family, "model.family").config_cls)} - {"extra"})
    for key in config:
        near = [f for f in fields if key not in fields and _one_typo(key, f)]
        if near:
            raise ConfigError(f"model.config.{key} is not a {family} config key; did you mean {near[0]}?")


def _one_typo(a: str, b: str) -> bool:
    """`a` and `b` differ by exactly one edit: a character inserted, deleted or changed, or two adjacent ones
    swapped (transformers' own keys differ from kiln's fields by more, e.g. qk_head_dim / v_head_dim)."""
    if a == b or abs(len(a) - len(b)) > 1:
        return False
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1 and a[diff[0]] == b[diff[1]]
                                  and a[diff[1]] == b[diff[0]])
    short, long_ = sorted((a, b), key=len)
    return any(long_[:i] + long_[i + 1:] == short for i in range(len(long_)))
