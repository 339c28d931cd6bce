"""Training: the Trainer, its run config, optimizers and schedules, checkpoints, metrics."""

from kiln.train.checkpoint import latest_checkpoint, load_checkpoint_model
from kiln.train.config import RunConfig, TrainSection, load_run_config
from kiln.train.trainer import Callback, Trainer
from kiln.train import recipes  # the recipe registry installs the run-config schema load_run_config validates

__all__ = ["Trainer", "Callback", "TrainSection", "RunConfig", "load_run_config", "latest_checkpoint",
           "load_checkpoint_model"]
