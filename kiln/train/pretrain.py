"""Pre-training from token shards: next-token loss on packed windows, validation loss and perplexity.

`kiln train` lands here when `data.train` is a `kiln tokenize` directory. From Python:

    from kiln.data.shards import ShardSet
    from kiln.data.stream import StreamLoader, Windows
    from kiln.train import Trainer
    from kiln.train.pretrain import lm_step

    loader = StreamLoader(Windows(ShardSet("shards", "train"), seq_len=256), batch_size=8, num_workers=2)
    Trainer(model, loader, step=lm_step, steps=1000, out_dir="runs/lm").fit()

The stream's cursor is the loader's `state_dict()`, so it rides in every checkpoint (trainer.json)
and in RUN_DIR/run_state.json; a resumed run reads exactly the windows an uninterrupted one would.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.nn import functional as F

from kiln.data.shards import MANIFEST, ShardSet, check_tokenizer, tokenizer_digest
from kiln.data.stream import IGNORE, EpochStream, StreamLoader, Windows, data_loader
from kiln.errors import ConfigError
from kiln.hub.files import file_sha256
from kiln.train.config import RunConfig
from kiln.parallel.world import all_reduce_sum
from kiln.train.plans import data_shard
from kiln.train.trainer import Trainer


def is_shard_dir(path: str | None) -> bool:
    return path is not None and (Path(path) / MANIFEST).is_file()


def lm_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed next-token cross entropy, number of real targets) for one stream batch."""
    out = model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"))
    targets = batch["targets"]                                          # (B, T), -100 = no target
    loss_sum = F.cross_entropy(out.logits.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE,
                               reduction="sum")
    return loss_sum, (targets != IGNORE).sum()


@torch.no_grad()
def evaluate_windows(trainer: Trainer, windows: Windows, batch_size: int) -> dict[str, float]:
    """Loss per target token over one pass of `windows` (all ranks together) and its perplexity.

    A model wrapping an LM (`.inner`, e.g. PrototypeModel) is scored on its own logits (eval_loss) and on
    the inner LM head's (eval_lm_loss), so both objectives of a multi-objective run have a held-out curve."""
    model, world = trainer.model, trainer.world
    scored = {"eval_": model}
    inner = getattr(trainer.unwrapped(), "inner", None)
    if inner is not None:
        scored["eval_lm_"] = inner
    model.eval()
    sums = torch.zeros(len(scored), 2, dtype=torch.float64)
    # tp ranks of one group read the same windows; their duplicate sums leave the ratio unchanged
    for batch in data_loader(EpochStream(windows, batch_size, trainer.data_rank, trainer.data_shards)):
        batch = {k: v.to(trainer.device) for k, v in batch.items()}
        for i, m in enumerate(scored.values()):
            with trainer.autocast():
                loss_sum, count = lm_step(m, batch)
            sums[i] += torch.tensor([float(loss_sum), float(count)], dtype=torch.float64)
    model.train()
    sums = all_reduce_sum(sums.to(trainer.device), world).cpu()
    out = {}
    for (prefix, _), (total, count) in zip(scored.items(), sums.tolist()):
        loss = total / max(count, 1.0)
        out[f"{prefix}loss"], out[f"{prefix}ppl"] = loss, math.exp(loss) if loss < 700 else float("inf")
    return out


def _open(path: str, split: str, digest: str, source: str, vocab_size: int) -> ShardSet:
    shards = ShardSet(path, split)
    check_tokenizer(path, shards.manifest, digest, source)
    if shards.vocab_size > vocab_size:
        raise ConfigError(f"{Path(path) / MANIFEST}: token ids go up to {shards.vocab_size - 1} but the model's "
                          f"vocab_size is {vocab_size}; set model.config.vocab_size >= {shards.vocab_size}")
    return shards


def build_pretrain_trainer(cfg: RunConfig, build_model: Callable[[], Any], resume: str | Path | None = None) -> Trainer:
    """The Trainer for a causal LM (made by `build_model()`, once the config checks pass) on the token
    shards `cfg.data.train` (and `cfg.data.eval`) name."""
    d = cfg.data
    if cfg.model.task != "causal-lm":
        raise ConfigError(f"data.train {d.train} is a token shard directory, which only model.task = "
                          f"'causal-lm' reads (not {cfg.model.task!r})")
    if cfg.lora is not None:
        raise ConfigError("[lora] is for fine-tuning; pre-training from token shards trains every weight")
    if d.eval is not None and not is_shard_dir(d.eval):
        raise ConfigError(f"data.eval {d.eval} must be a token shard directory too (data.train is one)")
    model = build_model()
    if cfg.grow is not None:  # placement against the built stack now, not at step grow.at_step
        from kiln.train.grow import find_layers, new_layer_slots

        new_layer_slots(cfg.grow.placement, len(find_layers(model)[1]), cfg.grow.target_layers)
    source = cfg.model.tokenizer or cfg.model.path
    digest = tokenizer_digest(model.tokenizer.backend.to_str())
    vocab = model.config.vocab_size
    train = Windows(_open(d.train, d.train_split, digest, source, vocab), d.max_length, seed=cfg.train.seed,
                    within_doc=d.within_doc)
    rank, shards = data_shard(cfg.parallel, int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")))
    loader = StreamLoader(train, cfg.train.batch_size, rank=rank, world_size=shards, num_workers=d.num_workers,
                          prefetch=d.prefetch)
    evaluate = None
    if d.eval is not None:
        held_out = Windows(_open(d.eval, d.eval_split, digest, source, vocab), d.max_length, shuffle=False,
                           within_doc=d.within_doc)
        evaluate = lambda trainer: evaluate_windows(trainer, held_out, cfg.train.batch_size)  # noqa: E731
    fingerprint = {"train": str(d.train), "manifest_sha256": file_sha256(Path(d.train) / MANIFEST),
                   "split": d.train_split, "seq_len": d.max_length, "within_doc": d.within_doc}
    args = cfg.train if resume is None else cfg.train.model_copy(update={"out_dir": str(resume)})
    step, extra = lm_step, staged_extras(cfg)
    if cfg.hpn is not None:
        model, step = hpn_model(model, cfg), hpn_step
    return Trainer(model, loader, step=step, evaluate=evaluate, args=args, resume=resume,
                   run_config=cfg.model_dump(mode="json"), data_fingerprint=fingerprint, parallel=cfg.parallel,
                   **extra)


def hpn_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{"prototype": ..., "lm": ...} mean losses of a PrototypeModel on one stream batch."""
    return model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), targets=batch["targets"]).losses


def hpn_model(model: nn.Module, cfg: RunConfig) -> nn.Module:
    from kiln.models.hpn import PrototypeModel

    h = cfg.hpn
    return PrototypeModel(model, model.config.vocab_size, proto_dim=h.proto_dim, scale=h.scale, mode=h.mode,
                          loss=h.loss, spread_steps=h.spread_steps, lm_loss=h.lm_loss, seed=cfg.model.init_seed)


def staged_extras(cfg: RunConfig) -> dict[str, Any]:
    """Trainer keywords for [grow] (a GrowthCallback) and [hpn].objectives (a GradientCombiner)."""
    from kiln.train.grow import GrowthCallback, GrowthPlan
    from kiln.train.multiobjective import GradientCombiner

    extra: dict[str, Any] = {}
    if cfg.hpn is not None:
        extra["objectives"] = GradientCombiner(cfg.hpn.objectives, seed=cfg.train.seed)
    if cfg.grow is not None:
        extra["callbacks"] = [GrowthCallback(GrowthPlan(**cfg.grow.model_dump(), seed=cfg.train.seed))]
    return extra
