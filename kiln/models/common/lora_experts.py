"""LoRA on routed experts: adapters on the stacked (E, out, in) expert weights, in PEFT's `target_parameters` form.

PEFT (0.21) adapts a targeted 3-D parameter with a ParamWrapper holding lora_A (E*r, in) and lora_B (out, r*E):
expert e's factors are A_e = lora_A.reshape(E, r, in)[e] and B_e = lora_B.reshape(out, r, E)[:, :, e], and in
each forward the parameter reads as W + scaling * B_e A_e, one `baddbmm` in W's dtype. kiln computes the same
tensor with the same op, so a kiln adapter in PEFT on the transformers model gives kiln's logits bit for bit,
and a merged export writes exactly the weight kiln computed with.

The stacked parameters keep their names (the key map, checkpoints and plans are untouched): the module's class
is switched to one whose `gate_up_proj` / `down_proj` read as the adapted tensors (what `Experts.stacked` then
gives); the adapters sit in `<experts>.lora.<param>.lora_A/B`. Several targeted parameters of one module nest
in PEFT, the first registered innermost, so on disk the adapter of a parameter is
`<module>.` + `base_layer.` x (targeted parameters registered after it) + `lora_A.weight`.
"""

from __future__ import annotations

import math
from typing import TypeGuard

import torch
from torch import nn

from kiln.errors import KilnError
from kiln.models.common.moe import Experts
from kiln.models.common.typed import is_kiln_model

HOLDER = "lora"  # the ModuleDict on an adapted experts module: param name -> ExpertLora


class ExpertLora(nn.Module):
    """PEFT's adapters for one stacked parameter of shape (E, out, in)."""

    def __init__(self, shape: tuple[int, ...], r: int, scaling: float, device: torch.device | str,
                 dtype: torch.dtype):
        super().__init__()
        E, out, inn = shape
        self.num_experts, self.r, self.scaling = E, r, scaling
        self.lora_A = nn.Linear(inn, r * E, bias=False, device=device, dtype=dtype)  # (E*r, in): expert-major rows
        self.lora_B = nn.Linear(r * E, out, bias=False, device=device, dtype=dtype)  # (out, r*E): expert-minor columns
        if torch.device(device).type != "meta":
            self.reset_lora()

    def reset_lora(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def factors(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(B_e (E, out, r), A_e (E, r, in)) in `dtype`, as views of the two weights."""
        a, b = self.lora_A.weight, self.lora_B.weight
        a = a.reshape(self.num_experts, -1, a.shape[-1])                     # (E, r, in)
        b = b.reshape(b.shape[0], -1, self.num_experts).permute(2, 0, 1)     # (E, out, r)
        return b.to(dtype), a.to(dtype)

    def adapted(self, weight: torch.Tensor) -> torch.Tensor:
        """W + scaling * B_e A_e for every expert, in W's dtype (never the autocast dtype: it is a weight)."""
        b, a = self.factors(weight.dtype)
        with torch.autocast(weight.device.type, enabled=False):
            return torch.baddbmm(weight, b, a, alpha=self.scaling)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, r={self.r}, scaling={self.scaling}"


class LoraExperts(Experts):
    """Mixed in before an `Experts` class: an adapted stacked weight reads as W + scaling * B_e A_e."""

    def adapters(self) -> nn.ModuleDict:
        """The adapters (`HOLDER`): stacked parameter name -> its ExpertLora."""
        holder = self._modules[HOLDER]
        if not isinstance(holder, nn.ModuleDict):
            raise KilnError(f"{type(self).__name__}.{HOLDER}: the expert adapters are missing")
        return holder

    def _adapted(self, name: str) -> torch.Tensor:
        base = self._parameters[name]
        if base is None:
            raise KilnError(f"{type(self).__name__}.{name}: no stacked expert weight in this slot")
        holder = self.adapters()
        if name not in holder:
            return base
        lora = holder[name]
        if not isinstance(lora, ExpertLora):
            raise KilnError(f"{type(self).__name__}.{HOLDER}.{name}: a {type(lora).__name__}, not an ExpertLora")
        return lora.adapted(base)

    gate_up_proj = property(lambda self: self._adapted("gate_up_proj"))
    down_proj = property(lambda self: self._adapted("down_proj"))


_CLASSES: dict[type, type] = {}


def _lora_class(cls: type) -> type:
    if issubclass(cls, LoraExperts):
        return cls
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Lora{cls.__name__}", (LoraExperts, cls), {})
    return _CLASSES[cls]


def matches_target(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def shortest_suffixes(names: list[str], others: set[str], least: int = 1) -> list[str]:
    """Per name the shortest trailing dotted part (`least` parts at least) that matches none of `others` (PEFT
    matches a target as a name or a '.'-suffix of one), sorted; a name with no such part adds nothing."""
    out = set()
    for name in names:
        parts = name.split(".")
        for k in range(least, len(parts) + 1):
            suffix = ".".join(parts[-k:])
            if not any(matches_target(o, suffix) for o in others):
                out.add(suffix)
                break
    return sorted(out)


def expert_params(model: nn.Module) -> list[str]:
    """`<module>.<param>` of every stacked expert weight (PEFT's `target_parameters` match these names)."""
    return [f"{m_name}.{p}" for m_name, m in model.named_modules() if isinstance(m, Experts)
            for p, t in m._parameters.items() if t is not None and t.dim() == 3]


def expert_targets(model: nn.Module, targets: list[str], dropout: float) -> list[str]:
    """The stacked expert weights whose `<module>.<param>` name is or ends with a target (PEFT's matching)."""
    if not targets:
        return []
    names = expert_params(model)
    unmatched = [t for t in targets if not any(matches_target(n, t) for n in names)]
    if unmatched:
        shown = sorted({".".join(n.split(".")[-2:]) for n in names}) or ["none: this model has no stacked experts"]
        raise KilnError(f"lora target parameter(s) {unmatched} match no stacked expert weight of this model; "
                        f"expert weights here: {', '.join(shown)}")
    if dropout:
        raise KilnError("lora.dropout must be 0 with target_parameters: a dropout on the input cannot be "
                        "folded into an adapted expert weight (PEFT refuses it too)")
    return [n for n in names if any(matches_target(n, t) for t in targets)]


def add_expert_lora(model: nn.Module, name: str, r: int, scaling: float) -> None:
    """Adapters on the stacked weight `<module>.<param>` (its base already frozen)."""
    module_name, _, param = name.rpartition(".")
    module = model.get_submodule(module_name)
    weight = module._parameters[param]
    if weight is None:
        raise KilnError(f"{name}: no stacked expert weight to adapt")
    if not weight.dtype.is_floating_point or weight.element_size() < 2:
        raise KilnError(f"{name}: LoRA on routed experts held in {weight.dtype} (FP8 / packed) is not supported; "
                        "load the model with fp8 = \"dequantize\"")
    if HOLDER not in module._modules:
        module.add_module(HOLDER, nn.ModuleDict())
        module.__class__ = _lora_class(type(module))
    if not has_expert_lora(module):
        raise KilnError(f"{module_name}: a {type(module).__name__}, not stacked experts that take adapters")
    module.adapters()[param] = ExpertLora(tuple(weight.shape), r, scaling, weight.device, weight.dtype)


def has_expert_lora(module: nn.Module) -> TypeGuard[LoraExperts]:
    return isinstance(module, LoraExperts)


def peft_target_parameters(model: nn.Module) -> list[str]:
    """`target_parameters` for PEFT: per adapted weight the shortest trailing `<module>.<param>` (two parts at
    least, `experts.gate_up_proj`) that selects no stacked weight left without an adapter."""
    done = adapted_params(model)
    return shortest_suffixes(done, set(expert_params(model)) - set(done), least=2)


def adapted_params(model: nn.Module) -> list[str]:
    """`<module>.<param>` of the stacked weights that carry adapters."""
    return [f"{m_name}.{p}" for m_name, m in model.named_modules() if has_expert_lora(m) for p in m.adapters()]


def expert_adapter_names(model: nn.Module) -> dict[str, str]:
    """kiln tensor name -> the name PEFT gives it on the transformers model (no `base_model.model.` prefix),
    for every routed-expert adapter tensor."""
    if not is_kiln_model(model):
        raise KilnError(f"a {type(model).__name__} is no kiln model: its adapters have no HF names (no key map)")
    keymap = model.family.keymap(model.task)
    out = {}
    for m_name, module in model.named_modules():
        if not has_expert_lora(module):
            continue
        holder = module.adapters()
        order = [p for p in module._parameters if p in holder]  # registration order: the first is innermost
        for i, param in enumerate(order):
            hf = keymap.hf_name(f"{m_name}.{param}")
            if hf is None:
                raise KilnError(f"{m_name}.{param} has no HF name; its adapter cannot be written in PEFT's form")
            # a stacked-on-disk weight names its module before the expert index: `...experts.*.gate_proj.weight`
            hf_module = hf.split(".*.", 1)[0] if ".*." in hf else hf.rpartition(".")[0]
            nest = "base_layer." * (len(order) - 1 - i)
            for ab in ("lora_A", "lora_B"):
                out[f"{m_name}.{HOLDER}.{param}.{ab}.weight"] = f"{hf_module}.{nest}{ab}.weight"
    return out


@torch.no_grad()
def merge_expert_lora(model: nn.Module) -> None:
    """Fold every expert adapter into its stacked weight (the adapted tensor the forward computes) and drop it."""
    for module in model.modules():
        if not has_expert_lora(module):
            continue
        for param in list(module.adapters()):
            module._parameters[param] = nn.Parameter(module._adapted(param), requires_grad=False)
        del module._modules[HOLDER]
        # back to the class it was before (_lora_class): a plain experts class again
        module.__class__ = next(c for c in type(module).__mro__[1:]  # type: ignore[assignment]
                                if not issubclass(c, LoraExperts))
