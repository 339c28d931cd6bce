"""Staged layer expansion and freezing: grow a model from `base_layers` to `target_layers` mid-run.

Choices:
- the stack is the model's one `nn.ModuleList` named `layers` (found by name, e.g. `model.layers`);
- placement `append`, `prepend`, `insert:N` (new layers before old layer N) or `specific:i,j,...` (the
  new layers' indices in the grown stack); old layers keep their order in the remaining slots;
- a new layer is a copy of its nearest old neighbour re-initialised with the family's init from a
  generator seeded by (seed, its index), then its residual output projections (`residual_outputs()`
  of the block) zeroed: the block adds exactly 0 to the residual stream, so the function is unchanged
  at the moment of growth while the zeroed projection still gets a gradient;
- old parameters stay the same tensors, so optimizer state (keyed by parameter) follows them; the
  optimizer's groups are rebuilt in the grown model's natural parameter order, the order a run
  resumed after the growth builds, so optimizer checkpoints map index for index;
- freezing (before and at growth) speaks `kiln.train.freeze`'s language: `first:N`, `last:N`,
  `layers:i,j,...`, `embeddings`, or parameter name prefixes and globs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from kiln.errors import ConfigError
from kiln.models.pretrained import init_module
from kiln.train.freeze import find_layers, freeze
from kiln.train.optim import param_groups
from kiln.train.resume import model_fingerprint
from kiln.train.trainer import Callback, Trainer


def new_layer_slots(placement: str, base: int, target: int) -> list[int]:
    """Indices the new layers take in the grown stack of `target` layers."""
    k = target - base
    if k <= 0:
        raise ConfigError(f"grow: target_layers ({target}) must exceed base_layers ({base})")
    kind, _, arg = placement.partition(":")
    if kind == "append" and not arg:
        return list(range(base, target))
    if kind == "prepend" and not arg:
        return list(range(k))
    try:
        values = [int(v) for v in arg.split(",")] if arg else []
    except ValueError:
        values = []
    if kind == "insert" and len(values) == 1 and 0 <= values[0] <= base:
        return list(range(values[0], values[0] + k))
    if kind == "specific" and len(values) == k and len(set(values)) == k and all(0 <= v < target for v in values):
        return sorted(values)
    raise ConfigError(f"grow.placement {placement!r} is not valid for {base} -> {target} layers: use append, "
                      f"prepend, insert:N (0 <= N <= {base}) or specific:i,j,... ({k} distinct indices below {target})")


@runtime_checkable
class ResidualBlock(Protocol):
    """A pre-norm residual block that names the projections writing into the residual stream."""

    def residual_outputs(self) -> list[nn.Linear]: ...


def _identity_layer(template: nn.Module, std: float, seed: int) -> nn.Module:
    if not isinstance(template, ResidualBlock):
        raise ConfigError(f"layer growth needs a pre-norm residual block that names its output projections "
                          f"(residual_outputs()); {type(template).__name__} does not")
    layer = copy.deepcopy(template)
    with torch.random.fork_rng():  # leave the run's RNG stream alone: resume must not see growth
        torch.manual_seed(seed)
        init_module(layer, std)
    with torch.no_grad():
        for proj in layer.residual_outputs():
            proj.weight.zero_()
            if proj.bias is not None:
                proj.bias.zero_()
    return layer


def grow_layers(model: nn.Module, target: int, placement: str = "append", seed: int = 0) -> list[int]:
    """Grow the stack to `target` layers in place; returns the new layers' indices."""
    _, stack = find_layers(model)
    base = len(stack)
    slots = new_layer_slots(placement, base, target)
    std = getattr(getattr(model, "config", None), "initializer_range", 0.02)
    old = iter(stack)
    grown: list[nn.Module | None] = [None if i in slots else next(old) for i in range(target)]  # old keep order
    kept = [i for i in range(target) if i not in slots]
    for i in slots:  # template: the old layer just before the slot, else the first old layer
        template = grown[max([j for j in kept if j < i], default=kept[0])]
        assert template is not None  # a kept (old) layer
        grown[i] = _identity_layer(template, std, seed * 100003 + i)
    for i, layer in enumerate(grown):
        assert layer is not None  # every slot was filled above
        if i < base:
            stack[i] = layer
        else:
            stack.append(layer)
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "num_hidden_layers"):
        config.num_hidden_layers = target  # an export after growth describes the grown model
    return slots


def regroup_optimizer(optimizer: torch.optim.Optimizer, groups: list[dict]) -> None:
    """Point the optimizer's groups at `groups`' params (same group count); state stays keyed by parameter."""
    if len(groups) != len(optimizer.param_groups):
        raise ConfigError(f"cannot regroup an optimizer of {len(optimizer.param_groups)} groups into {len(groups)}")
    for group, new in zip(optimizer.param_groups, groups):
        group["params"] = list(new["params"])
    live = {p for g in optimizer.param_groups for p in g["params"]}
    for p in [p for p in optimizer.state if p not in live]:
        del optimizer.state[p]  # frozen at growth: its moments must not come back if it is unfrozen later


@dataclass
class GrowthPlan:
    at_step: int                  # grow after this many optimizer steps (before step at_step + 1)
    target_layers: int
    placement: str = "append"
    freeze: list[str] = field(default_factory=list)         # from the start
    freeze_after: list[str] = field(default_factory=list)   # applied to the grown stack at growth
    seed: int = 0


class Growth:
    """Applies a GrowthPlan to a model (and its optimizer) at the right step, also for a resumed run."""

    def __init__(self, plan: GrowthPlan, groups: Callable[[nn.Module], list[dict]] | None = None):
        self.plan = plan
        self.groups = groups  # model -> optimizer param groups in natural order (the Trainer's param_groups)
        self.grown = False

    def setup(self, model: nn.Module, step: int) -> None:
        """Before weights load and the optimizer is built: initial freezing, and growth if `step` is past it."""
        if self.plan.freeze:
            freeze(model, self.plan.freeze, key="grow.freeze")
        if step >= self.plan.at_step:
            self._grow(model)

    def maybe_grow(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, step: int) -> bool:
        """After optimizer step `step`: grow once when it equals `at_step`; True if it grew now."""
        if self.grown or step != self.plan.at_step:
            return False
        self._grow(model)
        if optimizer is not None:
            if self.groups is None:
                raise ConfigError("Growth needs groups= (model -> param groups) to update the optimizer")
            regroup_optimizer(optimizer, self.groups(model))
        return True

    def _grow(self, model: nn.Module) -> None:
        grow_layers(model, self.plan.target_layers, self.plan.placement, self.plan.seed)
        if self.plan.freeze_after:
            freeze(model, self.plan.freeze_after, key="grow.freeze_after")
        self.grown = True


class GrowthCallback(Callback):
    """The Trainer side of a GrowthPlan: shape on setup/resume, grow after step `at_step`."""

    def __init__(self, plan: GrowthPlan):
        self.growth = Growth(plan)

    def on_setup(self, trainer: Trainer, step: int) -> None:
        if trainer.world.active:
            raise ConfigError("layer growth with several processes is not supported yet; run it on one process")
        self.growth.groups = lambda m: param_groups(m, trainer.args.weight_decay)
        self.growth.setup(trainer.unwrapped(), step)

    def on_step(self, trainer: Trainer, record: dict) -> None:
        model = trainer.unwrapped()
        if self.growth.maybe_grow(model, trainer.optimizer, trainer.step):
            trainer.fingerprint["model"] = model_fingerprint(model)  # checkpoints from now on hold the grown model
            _, stack = find_layers(model)
            if trainer.world.main:
                print(f"step {trainer.step}: grew to {len(stack)} layers ({self.growth.plan.placement})")
