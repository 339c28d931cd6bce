"""Constants shared by every layer (this module imports nothing)."""

IGNORE_INDEX = -100  # a target position that carries no loss (the value transformers and torch use)
