"""Constants shared by every layer (this module imports nothing)."""

IGNORE_INDEX = -100  # a target position that carries no loss (the value transformers and torch use)
# `kiln launch` names a folder here where each rank leaves its pid once it catches SIGTERM / SIGINT
# (kiln.train.preempt), so the launcher can pass a signal on to the ranks themselves.
LAUNCH_DIR_ENV = "KILN_LAUNCH_DIR"
