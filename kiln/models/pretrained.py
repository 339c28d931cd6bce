"""A family's spec: its typed config, how to build each task model, and the key map between kiln's module
names and HF's.

A `Family` describes one model_type; `PreTrainedModel` (on the floor, `kiln.models.common.pretrained`, and
importable from here as before) turns it into HF state-dict loading and `save_pretrained`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from kiln.errors import ConfigError
from kiln.models.common.config import FamilyConfig
from kiln.models.common.fp8 import with_scale_stacks  # FP8 experts' scales stack like their weights
from kiln.models.common.keymap import KeyMap
from kiln.models.common.pretrained import (  # noqa: F401
    LoadReport,
    PreTrainedModel,
    check_tensors,
    copy_state_dict,
    draw_fresh,
    dtype_kind,
    dtype_message,
    init_module,
    init_module_shallow,
    stored_dtype_problems,
)
from kiln.models.parallel_plan import ParallelPlan
from kiln.models.tasks import BASE, TASKS


@dataclass(frozen=True)
class TaskSpec:
    architecture: str                          # HF class name written to config.json
    build: Callable[[Any], PreTrainedModel]  # config -> model (on the current default device)
    keys: KeyMap = field(default_factory=lambda: KeyMap([]))  # kiln head names <-> HF head names


@dataclass(frozen=True)
class Tiny:
    """A family's smallest test model and how the parity tests treat it.

    kiln.interop.tiny builds it with transformers (random weights, a word-list tokenizer); the parity
    harness (tests/models/test_parity.py) and the verify matrix read it from the registry, so a new
    family is tested by declaring this beside its config.
    """
    config: dict[str, Any]          # transformers config kwargs: the smallest shape that takes every path
    specials: dict[str, str]        # tokenizer special tokens, in id order from 0 (pad/bos/eos ids as the config's)
    unigram: bool = False           # a SentencePiece (Unigram) tokenizer, as the family's checkpoints ship one
    # tensors transformers initialises to constants (balancing biases, hash tables), drawn at random in the saved
    # checkpoint so one that is dropped or misread changes outputs: (name, tensor, generator) -> new or None
    randomize: Callable[[str, torch.Tensor, torch.Generator], torch.Tensor | None] | None = None
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)  # other configs parity runs: name -> overrides
    long_rows: bool = False         # encoders: parity also over 40-token rows (relative positions, local windows)
    router_layers: int = 0          # MoE layers that report router logits: compared (with the aux loss) when > 0
    skips: dict[str, str] = field(default_factory=dict)  # parity check -> why this family cannot run it
    # (head, transformers config) -> the batches parity compares on, for a family whose inputs are not token ids
    inputs: Callable[[str, Any], list[dict]] | None = None


@dataclass(frozen=True)
class Family:
    model_type: str
    config_cls: type[FamilyConfig]
    hf_prefix: str        # where the base model sits inside a task checkpoint ("bert", "roberta", ...)
    base_keys: KeyMap     # kiln backbone names (under `model.`) <-> HF base names (no prefix)
    tasks: dict[str, TaskSpec]
    extra_keys: tuple[str, ...] = ()   # regexes of HF base keys kept verbatim (buffers like position_ids)
    parallel_plan: ParallelPlan | None = None  # how kiln.parallel may split it (None: blocks found by size, no TP/EP)
    tiny: Tiny | None = None  # its tiny test model (None: the verify matrix and parity tests fail it by name)

    def with_tiny(self, tiny: Tiny) -> Family:
        return replace(self, tiny=tiny)

    def keymap(self, task: str) -> KeyMap:
        prefix = "" if task == BASE else self.hf_prefix
        return with_scale_stacks(self.base_keys.prefixed("model", prefix) + self.tasks[task].keys)

    def task_of(self, architecture: str) -> str | None:
        for task, spec in self.tasks.items():
            if spec.architecture == architecture:
                return task
        return None

    def build(self, config: FamilyConfig, task: str) -> PreTrainedModel:
        if task not in self.tasks:
            raise ConfigError(f"model_type {self.model_type!r} has no {task!r} head; it has: {', '.join(self.tasks)}")
        model = self.tasks[task].build(config)
        # the task as its registry Task (a plain name in, the Task out): what the floor reads off it (e.g. the PEFT
        # task type an adapter is saved with) rides on the model, so `models/common` never asks the registry
        model.family, model.task, model.config = self, TASKS.get(task, task), config
        return model
