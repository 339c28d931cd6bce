"""The model inside a training wrapper.

DistributedDataParallel holds the model as `.module`; what a step, a loss or a save reads off the model (its task,
config, `sums_targets`) is on that inner model. One helper, so no caller re-types the unwrapping.
"""

from __future__ import annotations

from torch import nn


def unwrap(model: nn.Module) -> nn.Module:
    """The model itself: through a DDP wrapper (its `.module`), else `model` as given."""
    return getattr(model, "module", model)
