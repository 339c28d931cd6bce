"""From a validated run config to a ready Trainer: the matching recipe builds the model and data,
the extensions whose tables are present change them, and the Trainer gets the parts.

This is what `kiln train --config run.toml [--resume RUN_DIR]` runs; Python users call `build_trainer`
and get the same run, resume included:

    from kiln.train import load_run_config
    from kiln.train.run import build_trainer
    build_trainer(load_run_config("run.toml"), resume="runs/lm").fit()
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from kiln.errors import ConfigError
from kiln.parallel.mesh import resolve_degrees
from kiln.parallel.world import World, launched_world
from kiln.train.checkpoint import resume_target
from kiln.train.checks import check_out_dir, check_train_args
from kiln.train.config import RunConfig
from kiln.train.plans import data_shard
from kiln.train.recipes import active_extensions, recipe_for
from kiln.train.resume import content_digests
from kiln.train.resume import keep_global_batch as global_batch_on
from kiln.train.trainer import Trainer


def resumed_batch_size(cfg: RunConfig, resume: str | Path, world: World) -> RunConfig:
    """`cfg` with the train.batch_size a resume of RUN_DIR on `world` needs: the one that keeps its newest
    checkpoint's global batch over this world's data-parallel processes (another world size reshards;
    the run's TOML may still hold the batch size of the world size it started on). Says so on rank 0."""
    shards = data_shard(cfg.parallel, 0, world.size)[1]
    cfg, note = global_batch_on(cfg, Path(resume), world.size, shards)
    if note and world.main:
        print(f"resume: {note}")
    return cfg


def build_trainer(cfg: RunConfig, resume: str | Path | None = None, *, keep_global_batch: bool = True) -> Trainer:
    """The Trainer for a run config (`kiln.train.config.load_run_config`); with `resume`, for RUN_DIR: it
    continues the newest complete checkpoint there, and (`keep_global_batch`, as `kiln train --resume`
    unless given --set train.batch_size) with the per-process batch size that keeps its global batch."""
    world = launched_world()
    if resume is not None:
        resume = resume_target(resume)  # RUN/ckpt-N (the newest there) stands for RUN
    resolve_degrees(cfg.parallel, world.size)  # the degrees against torchrun's world, before any model or data work
    if resume is not None and keep_global_batch:
        cfg = resumed_batch_size(cfg, resume, world)
    check_train_args(cfg.train)
    if resume is None:
        check_out_dir(cfg.train.out_dir)
        check_out_dir_is_not_data(cfg)
    recipe = recipe_for(cfg)
    if not isinstance(cfg.data, recipe.data_schema):
        raise ConfigError(f"this is a {recipe.name} run ({recipe.when}): its [data] must be a "
                          f"{recipe.data_schema.__name__}, got {type(cfg.data).__name__}; load the run config with "
                          "kiln.train.load_run_config (or parse_run_config), which picks it")
    extensions = active_extensions(cfg)
    for ext in extensions:
        ext.check(cfg, recipe)

    def on_model(model: nn.Module) -> None:
        for ext in extensions:
            ext.on_model(cfg, model)

    parts = recipe.build(cfg, on_model, world)
    for ext in extensions:
        ext.extend(cfg, parts)
    args = cfg.train if resume is None else cfg.train.model_copy(update={"out_dir": str(resume)})
    return Trainer(parts.model, parts.data, eval_data=parts.eval_data, step=parts.step, evaluate=parts.evaluate,
                   callbacks=parts.callbacks, objectives=parts.objectives, args=args, resume=resume,
                   run_config=cfg.model_dump(mode="json"), data_fingerprint={**parts.fingerprint, **content_digests(parts.model, cfg.data.eval)},
                   parallel=cfg.parallel)


def check_out_dir_is_not_data(cfg: RunConfig) -> None:
    """train.out_dir naming the data folder itself (a folder of raw token files, which check_out_dir does not
    tell from an empty one) would fill it with checkpoints and metrics: refused, naming both keys."""
    out = Path(cfg.train.out_dir).resolve()
    for key in ("train", "eval"):
        value = getattr(cfg.data, key, None)
        if isinstance(value, str) and Path(value).is_dir() and Path(value).resolve() == out:
            raise ConfigError(f"train.out_dir {cfg.train.out_dir} is data.{key}'s folder; a run writes checkpoints "
                              "and metrics there: choose another train.out_dir")
