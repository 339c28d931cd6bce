"""LoRA: low-rank adapters on Linear layers, saved and loaded in PEFT's format.

y = W x (+ b) + B(A(dropout(x))) * scaling, scaling = alpha / r (alpha / sqrt(r) with rslora),
A (r, in) Kaiming-uniform, B (out, r) zeros, as PEFT initialises them. `LoraLinear` is an
nn.Linear (its weight and bias keep their names), so the base key map is untouched; the
adapters add `<module>.lora_A.weight` / `.lora_B.weight`. Targets are module names (a name
matches itself or any `...<name>` path) or "all-linear" (every Linear but the LM head).

On disk (PEFT): adapter_config.json + adapter_model.safetensors with keys
`base_model.model.<HF module name>.lora_A.weight`; PEFT's `PeftModel.from_pretrained` loads it on
the transformers model and kiln loads PEFT's adapters. `merge_lora` folds B A * scaling into W. On an FP8 base (`FP8Linear`) the weight stays FP8 and frozen
and the adapters train in its compute dtype; merging re-quantizes W + B A * scaling in its blocks. Over a
4-bit base (`quant4.Linear4`, QLoRA) the packed weight stays frozen and the adapters are float32 (PEFT's
default there); merging dequantizes W to the dtype it was quantized from first. Stacked routed-expert weights
take adapters by parameter name (`target_parameters`, PEFT's form; common/lora_experts.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from kiln.errors import KilnError
from kiln.hub.files import as_umask_allows
from kiln.hub.jsonio import read_json
from kiln.models.common.fp8 import FP8Linear, fp8_linear, merged_fp8_linear
from kiln.models.common.lora_experts import (
    add_expert_lora,
    expert_adapter_names,
    expert_targets,
    matches_target,
    merge_expert_lora,
    peft_target_parameters,
    shortest_suffixes,
)
from kiln.models.common.qlora import qlora_linear
from kiln.models.common.quant4 import BUFFERS as Q4_BUFFERS
from kiln.models.common.quant4 import KeepsQuantState, dequantized, is_4bit, linear4
from kiln.models.common.typed import is_kiln_model

if TYPE_CHECKING:  # (a type only: pretrained imports this module)
    from kiln.models.common.pretrained import PreTrainedModel
from kiln.models.common.wrapped import unwrap

PEFT_PREFIX = "base_model.model."
M = TypeVar("M", bound=nn.Module)


def peft_task_type(model: nn.Module) -> str | None:
    """PEFT's task_type for adapters of this model's head: its Task's (`Family.build` sets the registry Task on the
    model), None for a model that names no task."""
    return getattr(getattr(unwrap(model), "task", None), "peft_type", None)


@dataclass
class LoraConfig:
    r: int = 16
    alpha: float = 32
    dropout: float = 0.0
    targets: list[str] | str = field(default_factory=lambda: ["q_proj", "v_proj"])
    use_rslora: bool = False
    target_parameters: list[str] = field(default_factory=list)  # stacked expert weights (common/lora_experts.py)
    base_model_name_or_path: str | None = None  # the base it was put on (a path or hub id), for adapter_config.json

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r


class LoraLinear(KeepsQuantState, nn.Linear):
    """A Linear with a trainable low-rank update; the base weight and bias are frozen."""

    block: tuple[int, int] | None    # over an FP8 base: its scale blocks
    weight_scale_inv: torch.Tensor   # over an FP8 base: its scales (a buffer)
    fast: bool                       # over a 4-bit base: the update's fused kernels (set_fast)

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float, scaling: float):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight, self.bias = base.weight, base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        # an FP8 base (common/fp8.FP8Linear) stays FP8; the adapters take its compute dtype
        self.fp8 = isinstance(base, FP8Linear)
        if isinstance(base, FP8Linear):
            self.register_buffer("weight_scale_inv", base.weight_scale_inv)
            self.block, self.compute_dtype = base.block, base.compute_dtype
        # a 4-bit base (common/quant4.Linear4, QLoRA) stays packed; the adapters take its compute dtype
        self.q4 = base.q4 if is_4bit(base) else None
        if is_4bit(base):
            for name in Q4_BUFFERS:
                if name in base._buffers:
                    self.register_buffer(name, base._buffers[name])
            self.compute_dtype = base.compute_dtype
            self.fast = False  # set_fast: the update's fused float32 kernels (kiln/kernels/lora_update.py)
        self.r, self.alpha, self.scaling = r, alpha, scaling
        # adapters over a 4-bit base are float32, as PEFT makes them over bitsandbytes' Linear4bit
        dtype = torch.float32 if self.q4 is not None else self.compute_dtype if self.fp8 else base.weight.dtype
        kw = dict(device=base.weight.device, dtype=dtype)
        self.lora_A = nn.Linear(self.in_features, r, bias=False, **kw)   # (r, in)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, **kw)  # (out, r)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        if not base.weight.is_meta:
            self.reset_lora()

    def reset_lora(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.lora_A.weight, self.lora_B.weight
        if (self.q4 is not None and x.dtype == self.compute_dtype != a.dtype and x.device.type == "cpu"
                and isinstance(self.lora_dropout, nn.Identity) and not torch.is_autocast_enabled("cpu")
                and not hasattr(a, "device_mesh")):
            return qlora_linear(x, self, a, b, self.scaling, self.fast)  # PEFT over Linear4bit, one Function
        if self.q4 is not None:
            result = linear4(x, self)
        elif self.fp8:
            result = fp8_linear(x, self.weight, self.weight_scale_inv, self.block, self.bias)
        else:
            result = super().forward(x)
        dtype = result.dtype
        x = x.to(a.dtype)
        update = self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling
        if self.q4 is not None and not torch.is_autocast_enabled(x.device.type):
            return result + update.to(dtype)  # PEFT over bitsandbytes' Linear4bit rounds the update, then adds
        return (result + update).to(dtype)

    def delta_weight(self) -> torch.Tensor:
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling  # (out, in)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, alpha={self.alpha}"


def linear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not isinstance(m, LoraLinear)
            and n.rsplit(".", 1)[-1] not in ("lora_A", "lora_B")]


def apply_lora(model: nn.Module, config: LoraConfig) -> list[str]:
    """Swap the targeted Linears for LoraLinears and freeze everything else. Returns the module names."""
    if config.r < 1:
        raise KilnError(f"lora.r must be >= 1, got {config.r}")
    names = linear_names(model)
    if config.targets == "all-linear" or config.targets == ["all-linear"]:
        chosen = [n for n in names if n.rsplit(".", 1)[-1] != "lm_head"]
    else:
        targets = [config.targets] if isinstance(config.targets, str) else list(config.targets)
        unmatched = [t for t in targets if not any(matches_target(n, t) for n in names)]
        if unmatched:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in names})
            raise KilnError(f"lora target module(s) {unmatched} match no Linear layer in this model; "
                            f"Linear names here: {', '.join(leaves)} (or 'all-linear')")
        chosen = [n for n in names if any(matches_target(n, t) for t in targets)]
    experts = expert_targets(model, list(config.target_parameters), config.dropout)
    if not chosen and not experts:
        raise KilnError("lora: no targets (give lora.targets module names, or target_parameters for routed experts)")
    for p in model.parameters():
        p.requires_grad_(False)
    # in module order, Linears and stacked experts alike: the draws a sharded load's init_adapters repeats
    position, stacked = {n: i for i, (n, _) in enumerate(model.named_modules())}, set(experts)
    def order(name: str) -> int:  # a Linear's own place; a stacked expert parameter's: its module's
        at = position.get(name, position.get(name.rpartition(".")[0]))
        if at is None:
            raise KilnError(f"lora: target {name!r} is no module of this model, nor a parameter of one")
        return at

    for name in sorted(chosen + experts, key=order):
        if name in stacked:
            add_expert_lora(model, name, config.r, config.scaling)
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, LoraLinear(getattr(parent, leaf), config.r, config.alpha, config.dropout, config.scaling))
    # any module takes adapters, so the settings ride on it (torch types Module attributes as tensors or modules)
    model.lora_config = config  # type: ignore[assignment]  # read back through lora_config_of
    model.lora_targets = chosen  # type: ignore[assignment]  # read back through peft_targets
    return chosen


def lora_config_of(model: nn.Module) -> LoraConfig | None:
    """The LoRA settings `apply_lora` left on `model` (None: it holds no adapters)."""
    config = getattr(model, "lora_config", None)
    if config is not None and not isinstance(config, LoraConfig):
        raise KilnError(f"model.lora_config is a {type(config).__name__}, not kiln's LoraConfig (set by apply_lora)")
    return config


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if ".lora_A." in k or ".lora_B." in k}


def _hf_name(model: nn.Module, kiln_key: str, experts: dict[str, str] | None = None) -> str:
    if experts and kiln_key in experts:  # a routed-expert adapter: PEFT's ParamWrapper names
        return experts[kiln_key]
    keymap = model.family.keymap(model.task) if is_kiln_model(model) else None
    name = keymap.hf_name(kiln_key) if keymap is not None else kiln_key
    if name is None:
        raise KilnError(f"LoRA tensor {kiln_key!r} has no HF name")
    return name


def peft_targets(model: nn.Module) -> list[str]:
    """`target_modules` for PEFT: per adapted module the shortest trailing part of its name that selects
    no Linear left without an adapter (PEFT matches a name or a '.'-suffix of it). Leaf names when they
    suffice (q_proj); `shared_experts.gate_proj` where another `gate_proj` is not adapted. kiln's module
    names are transformers' in-memory ones, which is what PEFT matches (not the names on disk)."""
    targets = getattr(model, "lora_targets", None)
    if not isinstance(targets, list):
        raise KilnError("this model has no LoRA targets (apply_lora or a [lora] section first)")
    return shortest_suffixes(targets, set(linear_names(model)) - set(targets))


def save_adapter(model: nn.Module, out_dir: str | os.PathLike, base_model_name_or_path: str | None = None) -> Path:
    """Write adapter_model.safetensors + adapter_config.json as PEFT writes them."""
    config = lora_config_of(model)
    if config is None:
        raise KilnError("this model has no LoRA adapters to save (apply_lora or a [lora] section first)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    experts = expert_adapter_names(model)
    tensors = {PEFT_PREFIX + _hf_name(model, k, experts): v.detach().contiguous().cpu()
               for k, v in lora_state_dict(model).items()}
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    as_umask_allows(out / "adapter_model.safetensors")  # safetensors writes 0600
    targets = peft_targets(model)
    base = base_model_name_or_path or config.base_model_name_or_path
    peft_config: dict[str, object] = {  # (adapter_config.json: JSON values)
        "peft_type": "LORA", "task_type": peft_task_type(model),
        "base_model_name_or_path": base, "r": config.r, "lora_alpha": config.alpha,
        "lora_dropout": config.dropout, "target_modules": targets, "use_rslora": config.use_rslora,
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {}, "use_dora": False, "lora_bias": False,
    }
    if experts:  # adapters on stacked expert weights, which PEFT targets by parameter name
        peft_config["target_parameters"] = peft_target_parameters(model)
    (out / "adapter_config.json").write_text(json.dumps(peft_config, indent=2, sort_keys=True) + "\n")
    return out


def read_adapter_config(adapter_dir: str | os.PathLike) -> LoraConfig:
    path = Path(adapter_dir) / "adapter_config.json"
    if not path.is_file():
        raise KilnError(f"{adapter_dir}: no adapter_config.json; is it a PEFT adapter directory?")
    raw: dict[str, Any] = read_json(path, want=dict)
    if raw.get("peft_type", "LORA") != "LORA":
        raise KilnError(f"{path}: peft_type {raw.get('peft_type')!r} is not LORA")
    for key in ("use_dora", "lora_bias", "fan_in_fan_out"):
        if raw.get(key):
            raise KilnError(f"{path}: {key}=true is not supported")
    if raw.get("rank_pattern") or raw.get("alpha_pattern"):
        raise KilnError(f"{path}: per-module rank_pattern / alpha_pattern are not supported")
    return LoraConfig(r=int(raw["r"]), alpha=raw.get("lora_alpha", 8), dropout=raw.get("lora_dropout", 0.0),
                      targets=raw.get("target_modules") or [], use_rslora=bool(raw.get("use_rslora", False)),
                      target_parameters=list(raw.get("target_parameters") or []),
                      base_model_name_or_path=raw.get("base_model_name_or_path"))


def read_adapter_tensors(adapter_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors under bare HF names (`model.layers.0.self_attn.q_proj.lora_A.weight`)."""
    path = Path(adapter_dir) / "adapter_model.safetensors"
    if not path.is_file():
        raise KilnError(f"{adapter_dir}: no adapter_model.safetensors")
    out = {}
    for k, v in load_file(str(path)).items():
        bare = k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else k
        out[bare.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")] = v
    return out


def has_adapter(model_dir: str | os.PathLike) -> bool:
    return (Path(model_dir) / "adapter_config.json").is_file()


def load_adapter(model: PreTrainedModel, adapter_dir: str | os.PathLike) -> PreTrainedModel:
    """Apply a PEFT LoRA adapter (config + weights) to a kiln model, in place."""
    tensors = apply_adapter(model, adapter_dir)
    model.load_state_dict(adapter_state(model, adapter_dir, tensors), strict=False)
    return model


def apply_adapter(model: PreTrainedModel, adapter_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The adapters of a PEFT LoRA adapter directory on a kiln model (`apply_lora`: on a model built on meta, meta
    adapters), on the modules its tensors name; returns its tensors (`read_adapter_tensors`)."""
    config = read_adapter_config(adapter_dir)
    keymap = model.family.keymap(model.task)
    tensors = read_adapter_tensors(adapter_dir)
    # the modules holding tensors are the ones to adapt: target_modules may be leaf names that also
    # match Linears the adapter never touched (PEFT gives those zero adapters; kiln leaves them plain)
    linears = set(linear_names(model))
    held = sorted({m for k in tensors if (name := keymap.kiln_name(k)) and ".lora_" in name
                   and (m := name.rsplit(".lora_", 1)[0]) in linears})
    if held or config.target_parameters:
        config = dataclasses.replace(config, targets=held)
    apply_lora(model, config)
    return tensors


def adapter_state(model: PreTrainedModel, adapter_dir: str | os.PathLike, tensors: dict[str, torch.Tensor] | None = None
                  ) -> dict[str, torch.Tensor]:
    """The adapter directory's tensors (or `tensors`, read from it) under the model's names, in the dtypes of the
    adapters `apply_adapter` put on it; a tensor no adapter takes, or an adapter without its tensor, is named."""
    path = Path(adapter_dir) / "adapter_model.safetensors"
    keymap = model.family.keymap(model.task)
    tensors = tensors if tensors is not None else read_adapter_tensors(adapter_dir)
    expected = lora_state_dict(model)
    from_experts = {hf: kiln for kiln, hf in expert_adapter_names(model).items()}
    loaded = {}
    for k, v in tensors.items():
        name = from_experts.get(k) or keymap.kiln_name(k)
        if name not in expected:
            raise KilnError(f"{path}: tensor {k!r} does not belong to any targeted module of this model")
        if tuple(v.shape) != tuple(expected[name].shape):
            raise KilnError(f"{path}: tensor {k!r} has shape {tuple(v.shape)}, this model expects "
                            f"{tuple(expected[name].shape)}")
        loaded[name] = v.to(expected[name].dtype)
    missing = sorted(set(expected) - set(loaded))
    if missing:
        names = ", ".join(_hf_name(model, m, expert_adapter_names(model)) for m in missing[:4])
        raise KilnError(f"{path}: missing adapter tensor(s) {names}")
    return loaded


@torch.no_grad()
def merge_lora(model: M) -> M:
    """Fold every adapter into its base weight (W += B A * scaling) and put plain Linears back."""
    fp8_state = getattr(model, "fp8_state", None)
    merge_expert_lora(model)  # routed experts: each stacked weight becomes the adapted one the forward computed
    for name, module in list(model.named_modules()):
        plain: nn.Linear
        if isinstance(module, LoraLinear) and module.fp8:  # W + B A * scaling, quantized again in its blocks
            plain = merged_fp8_linear(module, module.delta_weight(), fp8_state.scheme.ue8m0 if fp8_state else False)
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, leaf, plain)
        elif isinstance(module, LoraLinear):
            # a 4-bit base: dequantized to the dtype it was quantized from, then W + B A * scaling
            weight = dequantized(module, module.q4.dtype) if module.q4 is not None else module.weight
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None,
                              device=weight.device, dtype=weight.dtype)
            plain.weight.copy_(weight + module.delta_weight().to(weight.dtype))
            if module.bias is not None:
                plain.bias.copy_(module.bias)
            parent_name, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, leaf, plain)
    for p in model.parameters():
        p.requires_grad_(p.dtype not in (torch.float8_e4m3fn, torch.uint8))  # FP8 and 4-bit weights stay frozen
    for attr in ("lora_config", "lora_targets"):
        if hasattr(model, attr):
            delattr(model, attr)
    return model
