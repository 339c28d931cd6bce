"""The load plan: the model on the meta device and one typed source per tensor, declared data every load reads.

A load (kiln.models.loading) reads a checkpoint's headers once (kiln.hub.index.CheckpointIndex), builds the model on
meta, runs the family's own load on those headers, and writes down, for each tensor of the model, where its values
come from (`Source`):

- `Stored`: one checkpoint tensor as stored (each rank reads its rows, or its box as a slice read);
- `Stacked`: kiln's (E, ...) stack of per-expert checkpoint tensors (each rank reads its experts, part by part);
- `Assembled`: a tensor step over checkpoint tensors (a cat, a transpose): read whole one at a time, then cut;
- `Fp8Box`: FP8 (or packed FP4) weights dequantized as read (each rank its box and the scale blocks it touches);
- `Rows4`: a 4-bit Linear's packed bytes and quant state (each rank its run of bytes, quantized at load or read);
- `Fresh`: a tensor the checkpoint lacks, drawn as a whole load draws it (a new head, an adapter beside the weights);
- carried tensors are not the model's: `Carried.refs` (references written back from their files on export).

One materialization (kiln.models.loading.read.materialize) fills each rank's pieces from the plan, after the
parallel plans are applied (or at once: a whole load is that path on one rank); `kiln plan` reads the same plan.
`PreTrainedModel.deferred_read` holds the plan until the read, then None. What outlives the read and a save is
`PreTrainedModel.carried` (`Carried`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kiln.hub.index import CarriedRef, CheckpointIndex, Span
from kiln.models.common.quant4 import BUFFERS

Part = tuple[str, str]  # (checkpoint key, its normalised HF name)


@dataclass(frozen=True)
class Stored:
    """One checkpoint tensor as stored: its plain HF name maps one to one onto the kiln tensor."""
    key: str
    hf: str


@dataclass(frozen=True)
class Stacked:
    """kiln's (E, ...) stack over experts of the cat of their HF parts, each part one checkpoint tensor."""
    parts: tuple[Part, ...]


@dataclass(frozen=True)
class Assembled:
    """A tensor step (the key map's) over checkpoint tensors: read whole, one tensor at a time, then cut."""
    parts: tuple[Part, ...]


@dataclass(frozen=True)
class Fp8Box:
    """Checkpoint tensors some of which are FP8 (or packed FP4) weights dequantized as read (`scales`: weight key ->
    its scale's key); one plain stored weight reads its box and the scale blocks around it, others read whole."""
    parts: tuple[Part, ...]
    scales: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Rows4:
    """A 4-bit Linear's weight (`module.weight`) and quant-state buffers: its packed bytes (read, or quantized at load
    from the stored values of its blocks) and the quant state whole."""
    module: str
    key: str


@dataclass(frozen=True)
class Fresh:
    """Not in the checkpoint: drawn when the plan was made (a new head; an adapter beside the weights), held since."""
    hf: str


Source = Stored | Stacked | Assembled | Fp8Box | Rows4 | Fresh


@dataclass
class Q4Read:
    """The 4-bit modules of a model built on meta, and where their weights are in the checkpoint."""
    modules: dict[str, str]          # module name -> checkpoint key of its weight
    quantize: str | None = None      # "nf4" | "fp4": quantized at load (double quant, as `[model] quantize`); None: read

    def held(self, model: nn.Module) -> dict[str, nn.Module]:
        """module name -> the 4-bit module, for those the model still has (a pipeline stage holds its layers)."""
        out = {}
        for m in self.modules:
            try:
                out[m] = model.get_submodule(m)
            except AttributeError:
                continue
        return out

    def names(self, model: nn.Module) -> set[str]:
        """The model's tensor names this read fills (packed weight and quant-state buffers; not the bias)."""
        out = set()
        for m, module in self.held(model).items():
            out.add(f"{m}.weight")
            out.update(f"{m}.{b}" for b in BUFFERS if module._buffers.get(b) is not None)
        return out

    def keys(self, spans: dict[str, Span]) -> set[str]:
        """The checkpoint keys this read uses (the weights, and a bitsandbytes directory's quant-state tensors)."""
        out = set(self.modules.values())
        if self.quantize is None:  # `<m>.weight.absmax` ... beside each `<m>.weight`
            out.update(k for k in spans if ".weight." in k and k.split(".weight.", 1)[0] + ".weight" in out)
        return out


@dataclass
class LoadPlan:
    """What a model built on meta is read by: its checkpoint, one source per tensor, and what the read reports."""
    index: CheckpointIndex                  # the checkpoint: its path resolved and its headers read, once
    source_task: str | None = None          # the task named by the checkpoint's `architectures` (what it owes)
    seed: int | None = None                 # the load's seed (a new head's and the adapters' draws)
    sources: dict[str, Source] = field(default_factory=dict)  # kiln tensor name -> where its values come from
    extras: list[str] = field(default_factory=list)  # checkpoint keys kept verbatim beside the model (hf_extras)
    used: frozenset[str] = frozenset()      # checkpoint keys the read (or the family's load) takes: the rest ignored
    whole: str | None = None                # why every rank loads this checkpoint whole (None: the plan reads it)
    q4: Q4Read | None = None                # 4-bit Linears and where their weights lie (kiln.models.loading.q4)
    unheld_fp8: frozenset[str] = frozenset()  # kept FP8: FP8 weights no FP8 module holds, read dequantized
    fp8_pairs: dict[str, tuple[str, str]] = field(default_factory=dict)  # FP8 weights read dequantized: name the
    #                                         save writes -> (weight key, scale key), the pairs a whole load keeps
    fresh_names: list[str] = field(default_factory=list)  # a new head's tensors, drawn (reported initialised)
    fresh_rng: torch.Tensor | None = None   # the generator after those draws (and an adapter's): where a whole
    #                                         load leaves it, for the next adapters' draws

    def counts(self) -> dict[str, int]:
        """How many tensors each kind of source fills (what a test or `kiln plan` inspects)."""
        out: dict[str, int] = {}
        for s in self.sources.values():
            out[type(s).__name__] = out.get(type(s).__name__, 0) + 1
        return out


DeferredRead = LoadPlan  # the name stage 3 gave it


@dataclass
class Carried:
    """Tensors a run holds by reference (not read; written from their source files on export)."""
    refs: dict[tuple[str, str], CarriedRef] = field(default_factory=dict)  # (holder, name) -> where it lies
    fp8_pairs: dict[str, tuple[CarriedRef, CarriedRef]] = field(default_factory=dict)  # kept FP8: name -> (weight,
    #                                         scale) a whole load keeps to write back, where they lie
