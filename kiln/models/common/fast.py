"""One switch between the exact path (bit-identical to transformers) and the fast training path.

`set_fast(model, True)` turns on, in every submodule that has one, the pieces that are within fp32
rounding of the reference but not bit-identical to it:
- `fast`: ForCausalLM's head + loss (logits only at labelled positions, fused chunked cross
  entropy; common/loss.py) and the prototype head's (kiln/models/hpn.py);
- `fast_delta_rule`: Gated DeltaNet's chunked rule with the analytic backward (common/delta_rule.py);
- `scan`: Mamba's selective scan, "fast" or "reference" (common/ssm.py);
- `fast` on stacked `Experts` (the routed experts as one autograd node, common/moe_fast.py) and on
  the group-limited router (fewer ops, the same experts; common/moe_routing.py);
- `fast` on a LoRA layer over a 4-bit base: its float32 update in fused C kernels (kiln/kernels/lora_update.py).
The Trainer calls it in setup with `not train.exact`; everything else (verify-export, the parity
tests, `from_pretrained`) keeps the exact path, which is every module's default.
"""

from __future__ import annotations

from typing import Protocol, cast

from torch import nn

from kiln.models.common.ssm import SCANS

SCAN = {True: "fast", False: "reference"}


class _Switches(Protocol):
    """The switches below, as the module classes that have them declare them; each is found by name."""
    fast: bool
    fast_delta_rule: bool
    scan: str


def set_fast(model: nn.Module, on: bool = True) -> nn.Module:
    """Switch every fast/exact choice inside `model` (through wrappers such as DDP) to fast (on) or exact."""
    for m in model.modules():
        if isinstance(getattr(m, "fast", None), bool):
            cast(_Switches, m).fast = on  # cast: each switch is set only where the check above found it
        if hasattr(m, "fast_delta_rule"):
            cast(_Switches, m).fast_delta_rule = on
        if isinstance(getattr(m, "scan", None), str) and m.scan in SCANS:
            cast(_Switches, m).scan = SCAN[on]
    return model


def fast_state(model: nn.Module) -> dict[str, bool]:
    """{module name: whether it is on its fast path} for every module with a switch (for tests and probes)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(getattr(m, "fast", None), bool):
            out[name] = m.fast
        elif hasattr(m, "fast_delta_rule"):
            out[name] = bool(m.fast_delta_rule)
        elif isinstance(getattr(m, "scan", None), str) and m.scan in SCANS:
            out[name] = m.scan == SCAN[True]
    return out
