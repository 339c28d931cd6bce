"""Moved to the floor: `kiln.models.common.keymap` (this name kept importable)."""

from kiln.models.common.keymap import KeyMap, Rule, Stack  # noqa: F401
