"""What each spawned rank runs in the pipeline tests: build the tiny 8-block model, cut it into stages, take
one step through the schedule; rank 0 writes the loss, every parameter's gradient (gathered from the
stages and FSDP shards) and the global gradient norm to OUT/<name>.pt.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kiln.errors import ConfigError
from kiln.interop.tiny import TINY
from kiln.models.auto import AutoConfig, from_config
from kiln.models.common.loss import shift_labels
from kiln.parallel.apply import parallelize
from kiln.parallel.config import ParallelSection

CONFIG = {**TINY["qwen3"], "num_hidden_layers": 8, "tie_word_embeddings": False, "intermediate_size": 40}
CONFIGS = {"qwen3": CONFIG,
           "qwen3_moe": {**TINY["qwen3_moe"], "num_hidden_layers": 4, "mlp_only_layers": [2]},
           "deepseek_v3": {**TINY["deepseek_v3"], "num_hidden_layers": 4}}  # MLA; layer 0 dense, the rest MoE


def build(family: str = "qwen3", **overrides):
    cfg = AutoConfig.for_model(family, **{**CONFIGS[family], **overrides})
    return from_config(cfg, task="causal-lm", seed=0)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels) (8, 16); the last rows have a few ignored labels, so rows weigh unequally."""
    ids = torch.randint(1, 99, (8, 16), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[6:, :5] = -100
    return ids, labels


def plan(**keys) -> ParallelSection:
    base = dict(dp=0, tp=1, ep=1, cp=1, pp=1, pp_schedule="1f1b", microbatches=0, pp_stages=None, fsdp=False,
                offload=False, param_dtype=None, reduce_dtype="fp32", sequence_parallel=True,
                activation_checkpointing="none", checkpoint_every=1, compile=False, compile_backend="aot_eager")
    return ParallelSection(**{**base, **keys})  # typed, as kiln train passes it


def reference(lengths: tuple[int, ...] = (16,), **model_keys: Any) -> dict:
    """One process, the whole batch (cut to each of `lengths` in turn, accumulated): the mean loss over every
    target, its gradients and their norm."""
    model = build(**model_keys)
    ids, labels = batch()
    outs = [model(ids[:, :n], targets=shift_labels(labels[:, :n])) for n in lengths]
    loss = sum(o.loss_sum for o in outs) / sum(o.loss_count for o in outs)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    norm = float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1e9))
    return {"loss": loss.detach(), "grads": grads, "grad_norm": norm}


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def run_pipeline(rank: int, world: int, out: str, name: str, keys: dict) -> None:
    keys = dict(keys)
    model = build(**keys.pop("model", {}))
    lengths = keys.pop("lengths", (16,))  # several batches accumulated: one schedule per sequence length
    par = parallelize(model, plan(**keys))
    pipe = par.pipeline
    ids, labels = batch()
    rows = slice(par.data_rank * 8 // par.data_shards, (par.data_rank + 1) * 8 // par.data_shards)
    loss_sum = count = torch.zeros((), dtype=torch.float64)
    for n in lengths:
        part, units = pipe.train_batch({"input_ids": ids[rows, :n], "labels": labels[rows, :n]})
        loss_sum, count = loss_sum + part, count + units
    totals = torch.stack([loss_sum if pipe.has_last else torch.zeros((), dtype=torch.float64),
                          count if pipe.has_first else torch.zeros((), dtype=torch.float64)])
    dist.all_reduce(totals)
    pipe.finish_gradients(float(totals[1]))
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    norm = pipe.clip(1e9)
    everyone = [None] * world
    dist.all_gather_object(everyone, grads)
    if rank == 0:
        merged = {}
        for g in everyone:
            merged.update(g)
        torch.save({"loss": (totals[0] / totals[1]).float(), "grads": merged, "grad_norm": norm},
                   os.path.join(out, f"{name}.pt"))


def run_many(rank: int, world: int, out: str, jobs: list) -> None:
    """Each job in turn; a job named bad-* must fail on every rank, and rank 0 writes the message."""
    for name, keys in jobs:
        if not name.startswith("bad"):
            run_pipeline(rank, world, out, name, keys)
            continue
        try:
            run_pipeline(rank, world, out, name, keys)
        except ConfigError as e:
            if rank == 0:
                torch.save({"error": str(e)}, os.path.join(out, f"{name}.pt"))
