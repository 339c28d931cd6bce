"""Moved to the floor: `kiln.models.common.config` (this name kept importable)."""

from kiln.models.common.config import COUNTS, EXPERT_COUNTS, WHOLE_SIZES, FamilyConfig  # noqa: F401
