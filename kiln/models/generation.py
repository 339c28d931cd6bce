"""Moved to the floor: `kiln.models.common.generation` (this name kept importable)."""

from kiln.models.common.generation import filter_logits, generate, inverse_cdf  # noqa: F401
