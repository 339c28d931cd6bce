"""What a load dropped or made up, judged before a command exports or predicts with the model.

A model's `load_report` lists checkpoint tensors it did not use and tensors it initialised fresh.
Some of that is what the user asked for: loading a masked-LM directory as `base` drops the MLM head.
The rest is a sign that the weights and config.json disagree (a tensor of a layer the config no
longer has, a stray tensor) or that a head would predict from random weights; those are refused
unless the caller allows them, naming the tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.errors import WeightsError
from kiln.models.pretrained import PreTrainedModel
from kiln.models.tasks import BASE


def _names(items: list[str], limit: int = 8) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


@dataclass
class LoadFindings:
    unused: list[str] = field(default_factory=list)        # checkpoint tensors its own config does not describe
    head_dropped: list[str] = field(default_factory=list)  # the source head's tensors, not used by this head
    fresh: list[str] = field(default_factory=list)         # tensors of this head the checkpoint lacks


def _source_names(model: PreTrainedModel, source_task: str | None) -> set[str]:
    """HF names (family prefix stripped) of every tensor the source architecture has under this config."""
    family = model.family
    with torch.device("meta"):
        source = family.build(model.config, source_task or BASE)
    prefix = family.hf_prefix + "."
    return {n.removeprefix(prefix) for n in source.hf_state_dict()}


def findings(model: PreTrainedModel, source_task: str | None) -> LoadFindings:
    """Sort the model's load report into expected and unexpected parts."""
    report = model.load_report
    prefix = model.family.hf_prefix + "."
    known = _source_names(model, source_task) if report.ignored else set()
    out = LoadFindings(fresh=list(report.initialized))
    for name in report.ignored:
        (out.head_dropped if name.removeprefix(prefix) in known and source_task != model.task
         else out.unused).append(name)
    return out


def check_load(model: PreTrainedModel, source: str, source_task: str | None, *, allow_missing: bool = False,
               allow_unused: bool = False, new_head_asked: bool = False) -> list[str]:
    """Refuse a load that ignored tensors the checkpoint's own config does not describe (unless
    `allow_unused`) or that initialised tensors fresh (unless `allow_missing`, or `new_head_asked`: the
    user named another head). Returns notes on what was dropped or initialised by permission."""
    f = findings(model, source_task)
    notes: list[str] = []
    if f.unused:
        if not allow_unused:
            raise WeightsError(f"{source}: {len(f.unused)} tensor(s) in the weights have no place in the model "
                               f"that config.json describes: {_names(f.unused)}; config.json and the weights "
                               "disagree (e.g. num_hidden_layers). Fix config.json, or pass --allow-unused to drop "
                               "them")
        notes.append(f"dropped {len(f.unused)} unused tensor(s): {_names(f.unused)}")
    if f.fresh:
        what = f"the {model.task} head" if source_task != model.task else "the model"
        if not (allow_missing or new_head_asked):
            kind = f"a {source_task} checkpoint" if source_task else "a checkpoint without architectures"
            raise WeightsError(f"{source}: is {kind}; {what} needs tensor(s) it does not hold: {_names(f.fresh)}. "
                               "They would be random, so the results would be meaningless and differ on every "
                               "run. Use a directory trained for this task, or pass --allow-missing to use a "
                               "freshly initialised head anyway")
        notes.append(f"initialised fresh (not in the weights): {_names(f.fresh)}")
    if f.head_dropped:
        notes.append(f"left out the {source_task} head's tensor(s): {_names(f.head_dropped)}")
    return notes
