"""Training: the Trainer, its run config, optimizers and schedules, checkpoints, metrics."""

from kiln.train.checkpoint import latest_checkpoint, load_checkpoint_model
from kiln.train.config import RunConfig, TrainSection, load_run_config
from kiln.train.trainer import Callback, Trainer

__all__ = ["Trainer", "Callback", "TrainSection", "RunConfig", "load_run_config", "latest_checkpoint",
           "load_checkpoint_model"]
