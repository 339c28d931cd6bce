"""Experiment trackers (`[train] report_to`): the scalars of each metrics.jsonl line and the run config as
hyper-parameters, sent to TensorBoard, Weights & Biases or Trackio from rank 0.

Each tracker is an optional extra; `check_trackers` runs before any model or data work, so a missing
library is a message at start, not a crash at the first log line. Offline use is each library's own:
TensorBoard writes event files under RUN_DIR/tensorboard, W&B follows WANDB_MODE (offline: RUN_DIR/wandb),
Trackio keeps a local SQLite store (TRACKIO_DIR).
"""

from __future__ import annotations

import abc
import importlib.util
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric fields of a metrics.jsonl record, without its step (notes and flags are not curves)."""
    return {k: v for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def flat_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-3}} -> {"train.lr": 1e-3}; values a hyper-parameter table cannot hold become text."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_config(value, name + "."))
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:  # None, lists: kept readable rather than dropped
            out[name] = json.dumps(value)
    return out


class Tracker(abc.ABC):
    """One destination for metrics; opened on rank 0 only."""

    @abc.abstractmethod
    def log(self, step: int, values: dict[str, float]) -> None:
        """Send one metrics line's scalars at `step`."""

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and finish the run."""


class TensorBoardTracker(Tracker):
    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        self.writer = SummaryWriter(str(run_dir / "tensorboard"))
        # the hparams plugin's three summaries written into this run's own file, so the scalars and
        # the config sit in one run (SummaryWriter.add_hparams would open a sub-run per call)
        for summary in hparams(flat_config(config), {}):
            self.writer._get_file_writer().add_summary(summary)  # what SummaryWriter.add_hparams does, without the sub-run
        self.writer.add_text("run_config", "```\n" + json.dumps(config, indent=2, sort_keys=True) + "\n```")

    def log(self, step: int, values: dict[str, float]) -> None:
        for k, v in values.items():
            self.writer.add_scalar(k, v, step)

    def close(self) -> None:
        self.writer.close()


class WandbTracker(Tracker):
    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]):
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        # a resumed run is a new W&B run: W&B refuses steps below ones it has seen, and a resume rewinds
        self.run = wandb.init(project=project, name=run_dir.name, dir=str(run_dir), config=config,
                              reinit="create_new")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


class TrackioTracker(Tracker):
    def __init__(self, run_dir: Path, project: str, config: dict[str, Any]):
        import trackio

        self.run = trackio.init(project=project, name=run_dir.name, config=config, resume="allow")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


# name -> (module that must import, pip extra, opener)
TRACKERS: dict[str, tuple[str, str, Callable[[Path, str, dict], Tracker]]] = {
    "tensorboard": ("tensorboard", "tensorboard", TensorBoardTracker),
    "wandb": ("wandb", "wandb", WandbTracker),
    "trackio": ("trackio", "trackio", TrackioTracker),
}


def check_trackers(names: Sequence[str]) -> None:
    """Each of `names` is a known tracker whose library is installed; else a ConfigError saying what to install."""
    for name in names:
        if name not in TRACKERS:
            raise ConfigError(f"train.report_to: unknown tracker {name!r}; choose from {', '.join(TRACKERS)}")
        module, extra, _ = TRACKERS[name]
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a module set to None in sys.modules (tests) reads as absent
            found = False
        if not found:
            raise ConfigError(f"train.report_to includes {name!r} but the {module} package is not installed; "
                              f"pip install 'kiln[{extra}]' (or drop it from report_to)")


def open_trackers(names: list[str], run_dir: str | os.PathLike, project: str,
                  config: dict[str, Any]) -> list[Tracker]:
    check_trackers(names)
    return [TRACKERS[name][2](Path(run_dir), project, config) for name in dict.fromkeys(names)]
