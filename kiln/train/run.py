"""From a validated run config to a ready Trainer: the matching recipe builds the model and data,
the extensions whose tables are present change them, and the Trainer gets the parts.

This is what `kiln train --config run.toml` runs; Python users can call `build_trainer` too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.train.checks import check_out_dir, check_train_args
from kiln.train.recipes import active_extensions, recipe_for
from kiln.train.trainer import Trainer


def build_trainer(cfg: Any, resume: str | Path | None = None) -> Trainer:
    """The Trainer for a run config (`kiln.train.config.load_run_config`); with `resume`, for RUN_DIR."""
    check_train_args(cfg.train)  # before any model or data work
    if resume is None:
        check_out_dir(cfg.train.out_dir)
    recipe = recipe_for(cfg)
    extensions = active_extensions(cfg)
    for ext in extensions:
        ext.check(cfg, recipe)

    def on_model(model: Any) -> None:
        for ext in extensions:
            ext.on_model(cfg, model)

    parts = recipe.build(cfg, on_model)
    for ext in extensions:
        ext.extend(cfg, parts)
    args = cfg.train if resume is None else cfg.train.model_copy(update={"out_dir": str(resume)})
    return Trainer(parts.model, parts.data, eval_data=parts.eval_data, step=parts.step, evaluate=parts.evaluate,
                   callbacks=parts.callbacks, objectives=parts.objectives, args=args, resume=resume,
                   run_config=cfg.model_dump(mode="json"), data_fingerprint=parts.fingerprint,
                   parallel=cfg.parallel)
