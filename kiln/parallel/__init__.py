"""Scale out: parallel plans applied to a built model (FSDP2, tensor and expert parallel), per-block
activation checkpointing and compile, sharded checkpoints, and the adaptive sync cadence.

Model code stays free of all of it: `parallelize(model, cfg.parallel)` applies what the [parallel]
table asks for to a model that was built the ordinary way.
"""

from kiln.parallel.apply import Parallelized, parallelize
from kiln.parallel.mesh import Degrees, resolve_degrees

__all__ = ["Degrees", "Parallelized", "parallelize", "resolve_degrees"]
