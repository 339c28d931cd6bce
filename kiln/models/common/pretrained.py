"""What every kiln model shares: HF-format load and save, weight init, the checks that name the tensor at fault.

`PreTrainedModel` turns a family's spec (`kiln.models.pretrained.Family`: its typed config, how to build each
task model, the key map between kiln's module names and HF's) into HF state-dict loading (`load_hf_state_dict`,
used by `kiln.models.auto.load_pretrained`) and `save_pretrained`. It sits on the floor (`models/common`) so
the task models here (`causal_lm.py`) build on it without importing the families' layer; it reads its family
through the `FamilySpec` protocol below.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from kiln.constants import BASE_TASK
from kiln.errors import WeightsError
from kiln.hub import Tokenizer, save_weights, write_config
from kiln.models.common.config import FamilyConfig
from kiln.models.common.keymap import KeyMap
from kiln.models.common.load_plan import Carried, DeferredRead

if TYPE_CHECKING:
    from kiln.models.common.fp8 import Fp8State
    from kiln.models.common.quant4 import Bnb4State


class FamilySpec(Protocol):
    """What a model reads of its family (`kiln.models.pretrained.Family`, set by `Family.build`)."""
    model_type: str
    hf_prefix: str
    extra_keys: tuple[str, ...]
    tasks: dict[str, Any]  # task -> its TaskSpec (`architecture`, `build`, `keys`)

    def keymap(self, task: str) -> KeyMap: ...

    def build(self, config: FamilyConfig, task: str) -> PreTrainedModel: ...


@dataclass
class LoadReport:
    """What a load did beyond the plain copy, for the user to read."""
    initialized: list[str] = field(default_factory=list)  # head tensors absent from the checkpoint
    ignored: list[str] = field(default_factory=list)      # checkpoint tensors this model does not use

    def lines(self) -> list[str]:
        out = []
        if self.initialized:
            out.append(f"newly initialised (not in the checkpoint): {', '.join(self.initialized)}")
        if self.ignored:
            out.append(f"ignored (not used by this head): {', '.join(self.ignored[:8])}"
                       + (f" and {len(self.ignored) - 8} more" if len(self.ignored) > 8 else ""))
        return out


def init_module(module: nn.Module, std: float) -> None:
    """HF-style init for freshly built modules: normal(0, std) weights, zero biases, unit norms."""
    with torch.no_grad():
        for m in module.modules():
            init_module_shallow(m, std)
        for m in module.modules():
            if hasattr(m, "after_init"):  # fixed tables (e.g. sinusoidal positions) set after the random init
                m.after_init()


class PreTrainedModel(nn.Module):
    """Base of every kiln model: `family`, `task` and `config` are set by `Family.build`. What a load leaves on the
    model is declared here, and nothing else rides on it: the quantized base's state (FP8, 4-bit), the half dtypes
    a family writes back, the read still to do of a model built on meta, and what it holds by reference."""

    family: FamilySpec
    task: str
    config: FamilyConfig
    tokenizer: Tokenizer | None = None
    fp8_state: Fp8State | None = None     # an FP8 base: its scheme and the pairs written back (common/fp8.py)
    bnb4_state: Bnb4State | None = None   # a 4-bit base: written back under bitsandbytes' names (common/quant4.py)

    def __init__(self) -> None:
        super().__init__()
        self.hf_extras: dict[str, torch.Tensor] = {}
        self.load_report = LoadReport()
        self.stored_half: dict[str, torch.dtype] = {}  # kiln name -> the half dtype it was stored in (written back)
        self.deferred_read: DeferredRead | None = None  # built on meta: the read still to do (kiln.models.load_plan)
        self.carried = Carried()  # tensors held by reference, not read (written back from their source files)

    # ---- HF state dicts ------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """This model's tensors under HF's names, as transformers would save them."""
        keymap = self.family.keymap(self.task)
        # LoRA adapters are not base weights: save_pretrained writes them apart, in PEFT format
        hf, unmatched = keymap.to_hf({k: v for k, v in self.state_dict().items() if ".lora_" not in k})
        assert not unmatched, f"kiln keys without an HF name: {unmatched}"
        prefix = "" if self.task == BASE_TASK else self.family.hf_prefix + "."
        for name, tensor in self.hf_extras.items():
            hf[prefix + name] = tensor
        if getattr(self, "fp8_state", None) is not None:  # loaded from FP8: back to FP8 + scales (common/fp8.py)
            hf = self.fp8_state.export(hf)
        if getattr(self, "bnb4_state", None) is not None:  # 4-bit base: bitsandbytes' tensor names (common/quant4.py)
            hf = self.bnb4_state.export(hf)
        return hf

    def load_hf_state_dict(self, hf: dict[str, torch.Tensor], source: str = "checkpoint",
                           source_task: str | None = None) -> LoadReport:
        """Load an HF state dict into this (possibly meta-device) model: its tensors become the parameters.

        Tensors the source architecture (`source_task`) lacks, e.g. a new head, are initialised fresh.
        """
        used, extras, fresh, report = self._match_hf(hf, source, source_task)
        self.load_state_dict(used, strict=False, assign=True)
        if fresh:
            # the load's compute dtype (FP8 weights and their scales say nothing about it)
            dtype = next((v.dtype for k, v in used.items() if v.dtype.is_floating_point and v.element_size() > 1
                          and not k.endswith("_scale_inv")), torch.float32)
            self._materialise_fresh(dtype)
            keymap = self.family.keymap(self.task)
            report.initialized = [keymap.hf_name(k) or k for k in fresh]
        self.hf_extras = extras
        self.tie_weights()
        self.load_report = report
        return report

    def copy_hf_state_dict(self, hf: dict[str, torch.Tensor], source: str = "checkpoint") -> LoadReport:
        """Copy a full HF state dict of this model's own head into its live tensors, in place.

        The parameters stay the same objects, so an optimizer built on them stays valid (resume).
        """
        used, _, _, report = self._match_hf(hf, source, source_task=self.task)
        self.load_state_dict(used, strict=False)
        return report

    def _match_hf(self, hf: dict[str, torch.Tensor], source: str, source_task: str | None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[str], LoadReport]:
        """HF names -> this model's names, checked: (tensors to load, verbatim extras, fresh names, report)."""
        family = self.family
        normalised: dict[str, torch.Tensor] = {}
        extras: dict[str, torch.Tensor] = {}
        for k, (name, is_extra) in self.normalise_hf_names(hf).items():
            (extras if is_extra else normalised)[name] = hf[k]
        keymap = family.keymap(self.task)
        adapters = self._expert_adapters(normalised)  # routed-expert LoRA tensors (a LoRA run's resume)
        kiln_sd, unmatched = keymap.to_kiln(normalised)
        kiln_sd.update(adapters)
        expected = dict(self.state_dict(keep_vars=True))
        # A tensor is owed by the checkpoint if the architecture it was saved from has it; other
        # missing tensors (a new head, a pooler the source head lacked) are initialised fresh.
        if source_task is None or source_task == self.task:
            owed = set(expected) if source_task == self.task else {k for k in expected if k.startswith("model.")}
        else:
            owed = self._owed_by(source_task, expected)
        ignored, fresh = check_tensors(expected, kiln_sd, owed, source, f"this {family.model_type} config",
                                       lambda k: keymap.hf_name(k) or k)
        report = LoadReport(ignored=sorted(unmatched) + [keymap.hf_name(k) or k for k in ignored])
        return {k: v for k, v in kiln_sd.items() if k in expected}, extras, fresh, report

    def _owed_by(self, source_task: str, expected: dict[str, torch.Tensor]) -> set[str]:
        """This model's tensors that a `source_task` checkpoint of the same config fills: the source architecture's
        HF names, read through this head's key map as a load reads them. Not the kiln names the two share: two heads
        may use one kiln name for different HF tensors (RoBERTa's MLM `head.dense` is `lm_head.dense`, its
        classifier's `classifier.dense`), and one HF tensor may sit under different kiln names (ModernBERT's `head`)."""
        with torch.device("meta"):
            source = self.family.build(self.config, source_task)
        keymap = self.family.keymap(self.task)
        names = self.normalise_hf_names(list(source.hf_state_dict()))
        return {keymap.kiln_name(name) for name, is_extra in names.values() if not is_extra} & set(expected)

    def _expert_adapters(self, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Takes the routed-expert adapter tensors (PEFT's names) out of `hf`, under kiln's names."""
        if not any(".lora_" in k for k in hf):
            return {}
        from kiln.models.common.lora_experts import expert_adapter_names

        return {kiln: hf.pop(name) for kiln, name in expert_adapter_names(self).items() if name in hf}

    def normalise_hf_names(self, keys) -> dict[str, tuple[str, bool]]:
        """Checkpoint key -> (its name for this head, whether it is an extra kept verbatim, named bare)."""
        prefix = self.family.hf_prefix + "."
        has_prefix = any(k.startswith(prefix) for k in keys)
        out = {}
        for k in keys:
            # A checkpoint saved from a task model has the base under `prefix`; one saved from the
            # base model has no prefix and nothing else.
            is_base = k.startswith(prefix) or not has_prefix
            bare = k[len(prefix):] if has_prefix and is_base else k
            if is_base and any(re.fullmatch(p, bare) for p in self.family.extra_keys):
                out[k] = (bare, True)
            elif is_base:
                out[k] = (bare if self.task == BASE_TASK else prefix + bare, False)
            else:
                out[k] = (k, False)
        return out

    def _materialise_fresh(self, dtype: torch.dtype) -> None:
        draw_fresh(self, {n for n, p in self.named_parameters() if p.is_meta}, dtype)

    def tie_weights(self) -> None:
        """Re-point tied parameters after a load; task heads with tied weights override this."""

    def init_weights(self) -> None:
        init_module(self, getattr(self.config, "initializer_range", 0.02))
        self.tie_weights()

    # ---- saving --------------------------------------------------------------------------
    def save_pretrained(self, path: str | os.PathLike, max_shard_bytes: int | None = None,
                        save_tokenizer: bool = True) -> Path:
        """Write config.json + model.safetensors (+ tokenizer files) that transformers loads as is."""
        hf = self.hf_state_dict()
        empty = [k for k, t in hf.items() if t.is_meta]  # e.g. what a sharded read holds by reference (MTP layers)
        if empty:
            raise WeightsError(f"{len(empty)} tensor(s) of this model have no data (e.g. {empty[0]!r}): a "
                               "run read shard by shard carries them in their source files; export its sharded "
                               "checkpoint (kiln export --checkpoint), or load the model whole")
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        cfg = self.config.to_dict()
        cfg["architectures"] = [self.family.tasks[self.task].architecture]
        write_config(out, cfg)
        save_weights(out, hf, max_shard_bytes=max_shard_bytes)
        if getattr(self, "lora_config", None) is not None:
            from kiln.models.common.lora import save_adapter

            save_adapter(self, out)  # adapter_model.safetensors + adapter_config.json beside the base
        if save_tokenizer and self.tokenizer is not None:
            self.tokenizer.save(out)
        return out

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def dtype_kind(dtype: torch.dtype) -> str:
    """What a tensor holds, as a load compares it: floating point (any width, FP8 too), integers, booleans."""
    if dtype == torch.bool:
        return "boolean"
    return "floating-point" if dtype.is_floating_point or dtype.is_complex else "integer"


def dtype_message(source: str, name: str, got: torch.dtype, want: torch.dtype, model: str = "the model") -> str:
    """A stored tensor of another kind than the model's (an int32 under a float weight's name)."""
    return (f"{source}: tensor {name!r} is stored as {str(got).removeprefix('torch.')} ({dtype_kind(got)}), but "
            f"{model} holds it as {dtype_kind(want)} ({str(want).removeprefix('torch.')}); the file was written "
            "wrong or holds another tensor under this name")


def stored_dtype_problems(model: PreTrainedModel, hf: dict[str, torch.Tensor], source: str) -> list[str]:
    """One message per stored tensor (by its HF name) whose kind differs from what `model` (built on meta is
    enough) holds under that name: what a load refuses, for `kiln inspect` to say without loading. Packed
    low-precision weights (integer bytes beside their scales: FP4 experts, bitsandbytes 4-bit) are a quantized
    scheme's, which the load dequantizes, and are not compared."""
    def packed(k: str) -> bool:
        partners = (k + "_scale_inv", k.removesuffix(".weight") + ".scale", k + ".absmax")
        return dtype_kind(hf[k].dtype) == "integer" and any(p in hf for p in partners)

    hf = {k: v for k, v in hf.items() if not packed(k)}
    normalised = {name: hf[k] for k, (name, extra) in model.normalise_hf_names(hf).items() if not extra}
    keymap = model.family.keymap(model.task)
    kiln_sd, _ = keymap.to_kiln(normalised)
    expected = model.state_dict()
    return [dtype_message(source, keymap.hf_name(k) or k, v.dtype, expected[k].dtype,
                          f"a {model.family.model_type} model") for k, v in kiln_sd.items()
            if k in expected and dtype_kind(v.dtype) != dtype_kind(expected[k].dtype)]


def check_tensors(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], owed: set[str], source: str,
                  model: str = "the model", name: Callable[[str], str] = str) -> tuple[list[str], list[str]]:
    """Check tensors to load (`got`) against a model's own (`expected`), both under the model's names.

    Returns (ignored: names in `got` the model lacks, fresh: the model's names absent from `got`
    and not `owed`). A wrong shape, or an owed tensor that is absent, raises a WeightsError that
    names the tensor (as `name(k)`, e.g. its HF name) and both shapes; so does a tensor of another kind
    (integers stored where the model holds floating-point weights, or the reverse; widths may differ).
    """
    for k, v in got.items():
        if k in expected and tuple(v.shape) != tuple(expected[k].shape):
            raise WeightsError(f"{source}: tensor {name(k)!r} has shape {tuple(v.shape)}, "
                               f"but {model} expects {tuple(expected[k].shape)}")
        if k in expected and dtype_kind(v.dtype) != dtype_kind(expected[k].dtype):
            raise WeightsError(dtype_message(source, name(k), v.dtype, expected[k].dtype, model))
    absent = [name(k) for k in expected if k not in got and k in owed]
    if absent:
        raise WeightsError(f"{source}: missing tensor(s) {', '.join(repr(n) for n in absent[:6])}"
                           + (f" and {len(absent) - 6} more" if len(absent) > 6 else ""))
    return [k for k in got if k not in expected], [k for k in expected if k not in got and k not in owed]


def copy_state_dict(module: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> list[str]:
    """Copy `tensors` (under the module's own names) into a plain module in place; returns the names it lacks."""
    own = module.state_dict()
    ignored, _ = check_tensors(own, tensors, set(own), source)
    module.load_state_dict({k: v for k, v in tensors.items() if k in own}, strict=False)
    return ignored


def draw_fresh(model: nn.Module, fresh: set[str], dtype: torch.dtype) -> None:
    """Materialise and draw the parameters a load left fresh (`fresh`: their names; a new head) in `dtype`, as
    transformers' from_pretrained draws a checkpoint's missing tensors: module by module, children before their parent
    (its `initialize_weights` order), each module holding a fresh tensor given the generic init, then each module's
    own family init (`after_fresh(is_fresh)`, transformers' `_init_weights` of that module) of the fresh tensors
    below it; a loaded tensor is neither redrawn nor does it move the generator."""
    std = getattr(getattr(model, "config", None), "initializer_range", 0.02)
    holders = {n.rpartition(".")[0] for n in fresh}
    drawn: set[int] = set()
    with torch.no_grad():
        for name, module in _children_first(model):
            if name in holders:
                module.to_empty(device="cpu", recurse=False)
                for p in module.parameters(recurse=False):
                    p.data = p.data.to(dtype)
                    drawn.add(id(p))
                init_module_shallow(module, std)
            if hasattr(module, "after_fresh") and any(id(p) in drawn for p in module.parameters()):
                module.after_fresh(lambda t: id(t) in drawn)


def _children_first(module: nn.Module, prefix: str = "", seen: set[int] | None = None):
    """(name, module) for `module` and every module below it once, each after its children (post-order)."""
    seen = set() if seen is None else seen
    for name, child in module.named_children():
        if id(child) not in seen:
            yield from _children_first(child, f"{prefix}{name}.", seen)
    seen.add(id(module))
    yield prefix.rstrip("."), module


def init_module_shallow(module: nn.Module, std: float) -> None:
    """Init one module's own parameters (no recursion), as `init_module` would."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, 0.0, std)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            module.weight[module.padding_idx].zero_()
    elif isinstance(module, nn.LayerNorm) or type(module).__name__.endswith("Norm"):
        if getattr(module, "weight", None) is not None:
            nn.init.ones_(module.weight)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif hasattr(module, "reset_parameters_hf"):
        module.reset_parameters_hf(std)  # a block with its own HF init (e.g. a bare bias Parameter)
