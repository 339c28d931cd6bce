"""What each spawned rank runs in the context-parallel tests: one Trainer-contract step on a split batch.

Every rank reads its data shard's full rows (cp ranks of one dp rank read the same ones); the model's
CP hook keeps this rank's chunks. The step follows the Trainer: backward of the local loss sum,
DDP / FSDP averaging over all ranks, then gradients times world / (global token count), so they
are the gradient of the global token mean. Rank 0 writes the loss, full gradients and updated weights.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from kiln.constants import IGNORE_INDEX
from kiln.models.auto import AutoConfig, from_config
from kiln.models.common.dsa import Indexer
from kiln.parallel.apply import parallelize
from kiln.parallel.grads import clip_grad_norm
from kiln.train.recipes.moe import MoeLosses, MoeSection
from kiln.train.steps import default_step
from tests.parallel import workers

LLAMA = dict(vocab_size=99, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rope_parameters={"rope_type": "default",
                                                                                   "rope_theta": 10000.0})


def build(family: str):
    if family == "llama":
        return from_config(AutoConfig.for_model("llama", **LLAMA), task="causal-lm", seed=0)
    return workers.build(family)


def batch(kind: str) -> dict[str, torch.Tensor]:
    """The global batch (4 rows): plain, packed (positions restart per sample), or right-padded to 14."""
    ids = workers.batch()  # (4, 16)
    if kind == "plain":
        return {"input_ids": ids, "labels": ids}
    if kind == "packed":
        starts = [[0, 5], [0, 9, 12], [0], [0, 3, 4, 11]]
        pos = torch.zeros_like(ids)
        labels = ids.clone()
        for row, s in enumerate(starts):
            for a, b in zip(s, s[1:] + [ids.shape[1]]):
                pos[row, a:b] = torch.arange(b - a)
                labels[row, a] = IGNORE_INDEX  # nothing predicts a sample's first token from the one before
        return {"input_ids": ids, "labels": labels, "position_ids": pos}
    assert kind == "padded"
    ids = ids[:, :14].clone()
    lengths = torch.tensor([14, 9, 12, 5])
    mask = (torch.arange(14)[None] < lengths[:, None]).long()
    ids[mask == 0] = 0
    labels = ids.masked_fill(mask == 0, IGNORE_INDEX)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def indexer_kl(model) -> MoeLosses:
    """`[moe] indexer = "kl"` as its extension sets it up: the indexers trained on their KL loss, which the
    returned step adds to the LM loss."""
    for ix in model.modules():
        if isinstance(ix, Indexer):
            ix.train_kl = True
            ix.requires_grad_(True)
    return MoeLosses(MoeSection(balance="none", indexer="kl"), default_step)


def reference(family: str, kind: str, kl: bool = False) -> dict:
    """One process, the whole batch: the mean loss over every target, its gradients, one AdamW step (with `kl`,
    the LM loss plus the indexer's KL loss, the indexer's mean KL under "indexer_loss")."""
    model = build(family)
    opt = _adamw(model)
    if not kl:
        return _finish(model, opt, model(**batch(kind)).loss, lambda: None)
    losses = indexer_kl(model)
    part, count = losses.step(model, batch(kind))
    out = _finish(model, opt, part / count.to(part.dtype), lambda: None)
    out["indexer_loss"] = torch.tensor(losses.sums["indexer_loss"] / losses.units)
    return out


def _adamw(model) -> torch.optim.Optimizer:
    # before any forward: FSDP keeps the last block unsharded after it, and parameters() would hand those over
    return torch.optim.AdamW(model.parameters(), lr=workers.LR, weight_decay=0.0)


def _finish(model, opt, loss: torch.Tensor, scale_grads) -> dict:
    loss.backward()
    scale_grads()
    grads = {n: workers._full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
    norm = clip_grad_norm(list(model.parameters()), 1e9)
    opt.step()
    weights = {n: workers._full(p) for n, p in model.named_parameters()}
    return {"loss": loss.detach(), "grads": grads, "weights": weights, "grad_norm": norm}


def run_cp(rank: int, world: int, out: str, name: str, family: str, kind: str, keys: dict) -> None:
    keys = dict(keys)
    kl = keys.pop("indexer_kl", False)  # the step of [moe] indexer = "kl" instead of the LM loss alone
    model = build(family)
    par = parallelize(model, workers.plan(**keys))
    losses = indexer_kl(model) if kl else None  # before DDP: it sees the indexers' parameters trainable
    methods = {m.core.__self__.method for m in model.modules() if getattr(m, "core", None) is not None}
    methods |= {m.context.method for m in model.modules() if getattr(m, "context", None) is not None}
    assert methods == {keys.get("cp_method", "allgather")}, methods  # every attention runs the asked-for core
    wrapped = DistributedDataParallel(model) if par.wrap_ddp else model
    opt = _adamw(model)
    full = batch(kind)
    mine = {k: v.chunk(par.data_shards)[par.data_rank] for k, v in full.items()}
    if kl:
        loss_sum, count = losses.step(wrapped, mine)
        logged = torch.tensor([losses.sums["indexer_loss"], losses.units], dtype=torch.float64)
        dist.all_reduce(logged)
    else:
        result = wrapped(**mine)
        loss_sum, count = result.loss_sum, result.loss_count
        share = result.loss.detach().clone()  # .loss: this rank's share of its cp group's mean
        dist.all_reduce(share)
    totals = torch.stack([loss_sum.detach().double(), count.double()])
    dist.all_reduce(totals)

    def scale_grads() -> None:  # the Trainer's _reduce: DDP/FSDP averaged over the world; to the token mean
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(world / float(totals[1]))

    out_ = _finish(model, opt, loss_sum, scale_grads)
    out_["loss"] = (totals[0] / totals[1]).float()
    if kl:
        out_["indexer_loss"] = (logged[0] / logged[1]).float()  # as the metrics line logs it
    else:
        out_["shares"] = (share / par.data_shards).float()  # mean over dp shards of each cp group's summed shares
    if rank == 0:
        torch.save(out_, os.path.join(out, f"{name}.pt"))


def run_many(rank: int, world: int, out: str, jobs: list) -> None:
    for name, family, kind, keys in jobs:
        run_cp(rank, world, out, name, family, kind, keys)
