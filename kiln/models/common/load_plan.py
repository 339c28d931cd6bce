"""What a load decides and a later step reads, as declared data held in one declared place on the model.

A model built on the meta device from a checkpoint's headers (kiln.parallel.sharded_load) is read later, after the
parallel plans are applied: `PreTrainedModel.deferred_read` holds what that read needs (`DeferredRead`: the
checkpoint's index, the seed, the architecture the checkpoint was saved from, the 4-bit modules and where their
weights lie, the FP8 weights read dequantized, a new head's draws) and is None once the model holds its weights.
What outlives the read and a save (the tensors a run holds by reference, not by value: an MTP layer it carries, the
FP8 pairs a kept-FP8 export writes back) is `PreTrainedModel.carried` (`Carried`), written beside a sharded
checkpoint and read by its export (kiln.parallel.sharded_carried, sharded_fp8_export).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kiln.hub.index import CarriedRef, CheckpointIndex, Span
from kiln.models.common.quant4 import BUFFERS


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
class DeferredRead:
    """What a model built on meta still needs to be read (kiln.parallel.sharded_load.read_shards)."""
    index: CheckpointIndex                  # the checkpoint: its path resolved and its headers read, once
    source_task: str | None = None          # the task named by the checkpoint's `architectures` (what it owes)
    seed: int | None = None                 # the load's seed (a new head's and the adapters' draws)
    q4: Q4Read | None = None                # 4-bit Linears and where their weights lie (kiln.parallel.sharded_q4)
    unheld_fp8: frozenset[str] = frozenset()  # kept FP8: FP8 weights no FP8 module holds, read dequantized
    fresh_names: list[str] = field(default_factory=list)  # a new head's tensors, drawn (reported initialised)
    fresh_rng: torch.Tensor | None = None   # the generator after those draws (and an adapter's): where a whole
    #                                         load leaves it, for the next adapters' draws


@dataclass
class Carried:
    """Tensors a run holds by reference (not read; written from their source files on export)."""
    refs: dict[tuple[str, str], CarriedRef] = field(default_factory=dict)  # (holder, name) -> where it lies
    fp8_pairs: dict[str, tuple[CarriedRef, CarriedRef]] = field(default_factory=dict)  # kept FP8: name -> (weight,
    #                                         scale) a whole load keeps to write back, where they lie
