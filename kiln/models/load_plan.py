"""Moved to the floor: `kiln.models.common.load_plan` (this name kept importable)."""

from kiln.models.common.load_plan import Carried, DeferredRead, LoadPlan, Q4Read  # noqa: F401
