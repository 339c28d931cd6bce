"""Training: the Trainer, its run config, optimizers and schedules, checkpoints, metrics."""

from kiln.train import recipes  # noqa: F401 - imported for its effect: the recipe registry installs the run-config schema load_run_config validates
from kiln.train.checkpoint import latest_checkpoint, load_checkpoint_model
from kiln.train.config import RunConfig, TrainSection, load_run_config
from kiln.train.trainer import Callback, Trainer

__all__ = [
           "Callback",
           "RunConfig",
           "TrainSection",
           "Trainer",
           "latest_checkpoint",
           "load_checkpoint_model",
           "load_run_config",
]
