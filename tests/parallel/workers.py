"""What each spawned rank runs in the parity tests: build the tiny model, apply a plan, take one step.

Every worker writes, from rank 0, the loss, the full gradients and the updated weights to
OUT/<name>.pt, gathered from whatever shards the plan made; the test compares them with one
process running the same global batch.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from kiln.interop.tiny import TINY
from kiln.models.auto import AutoConfig, from_config
from kiln.parallel.apply import parallelize
from kiln.parallel.blocks import plan_of
from kiln.parallel.config import ParallelSection
from kiln.parallel.grads import clip_grad_norm

DENSE = {**TINY["qwen3"], "intermediate_size": 40}
MOE = {**TINY["qwen3_moe"], "mlp_only_layers": [], "intermediate_size": 40}  # tp checks the (unused) dense size
MODELS = {"qwen3": DENSE, "qwen3_moe": MOE, "deepseek_v3": TINY["deepseek_v3"],  # EP over routed experts
          "qwen3_next": {**TINY["qwen3_next"], "mlp_only_layers": []},
          "llama": {**TINY["llama"], "intermediate_size": 40},  # tie_word_embeddings = true: TP ties the head
          "glm_moe_dsa": TINY["glm_moe_dsa"],  # MLA with a query latent and the (replicated) indexer
          "deepseek_v4": TINY["deepseek_v4"]}  # hyper-connected streams, compressors, hash + top-k routed experts
LR = 1e-2


def build(family: str):
    cfg = AutoConfig.for_model(family, **MODELS[family])
    return from_config(cfg, task="causal-lm", seed=0)


def batch(seed: int = 1) -> torch.Tensor:
    return torch.randint(1, 99, (4, 16), generator=torch.Generator().manual_seed(seed))  # (B, T)


def plan(**keys) -> ParallelSection:
    base = dict(dp=0, tp=1, ep=1, fsdp=False, offload=False, param_dtype=None, reduce_dtype="fp32",
                sequence_parallel=True, activation_checkpointing="none", checkpoint_every=1, compile=False,
                compile_backend="aot_eager")
    return ParallelSection(**{**base, **keys})  # typed, as kiln train passes it


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def step(model, ids: torch.Tensor, sync=lambda: None) -> dict:
    """Loss of `ids` (B, T); backward; optimizer step; the loss, full grads and weights."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    loss = model(ids, labels=ids).loss
    loss.backward()
    sync()
    grads = {n: _full(p.grad) for n, p in model.named_parameters() if p.grad is not None}  # the indexer has none
    norm = clip_grad_norm(list(model.parameters()), 1e9)
    opt.step()
    weights = {n: _full(p) for n, p in model.named_parameters()}
    return {"loss": loss.detach(), "grads": grads, "weights": weights, "grad_norm": norm}


def reference(family: str, **plan_keys) -> dict:
    model = build(family)
    if plan_keys:
        parallelize(model, plan(**plan_keys), world_size=1)
    return step(model, batch())


def _held_at_head(model) -> list[bool]:
    """Whether FSDP2 holds a flat all-gather buffer when the head runs (after the final norm), per forward."""
    held: list[bool] = []
    state, norm = getattr(model, "_get_fsdp_state", None), plan_of(model).final_norm
    if state is not None and norm is not None:  # (DeepSeek-V4's plan names no final norm: its hc head mixes first)
        model.get_submodule(norm).register_forward_hook(
            lambda *_: held.append(state()._comm_ctx.all_gather_state is not None))
    return held


def run_plan(rank: int, world: int, out: str, name: str, family: str, keys: dict) -> None:
    model = build(family)
    par = parallelize(model, plan(**keys))
    held = _held_at_head(model)
    ids = batch()
    shard = ids.chunk(par.data_shards)[par.data_rank]  # tp ranks of one group read the same rows
    result = step(model, shard, par.sync_gradients)
    result["gather_held_at_head"] = torch.tensor([bool(h) for h in held], dtype=torch.bool)
    loss = result["loss"].clone()
    dist.all_reduce(loss)  # the global mean: shards hold equal token counts; tp ranks hold equal copies
    loss /= world
    result["loss"] = loss
    if rank == 0:
        torch.save(result, os.path.join(out, f"{name}.pt"))


def run_many(rank: int, world: int, out: str, jobs: list) -> None:
    for name, family, keys in jobs:
        run_plan(rank, world, out, name, family, keys)


def _train(model, par, opt, steps: range) -> None:
    for s in steps:
        ids = batch(seed=s).chunk(par.data_shards)[par.data_rank]
        loss = model(ids, labels=ids).loss
        loss.backward()
        par.sync_gradients()
        opt.step()
        opt.zero_grad()


def _full_weights(model) -> dict:
    return {n: _full(p) for n, p in model.named_parameters()}


def run_checkpoint(rank: int, world: int, out: str, phase: str, keys: dict) -> None:
    """phase "straight": 4 steps, a sharded save after step 2; "resume": load that save, steps 3-4."""
    from kiln.parallel.checkpoint import load_sharded, save_sharded

    model = build("qwen3")
    par = parallelize(model, plan(**keys))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ckpt = os.path.join(out, "ckpt-2")
    if phase == "straight":
        _train(model, par, opt, range(1, 3))
        save_sharded(ckpt, model, opt, {"step": 2})
        at_two = _full_weights(model)
        _train(model, par, opt, range(3, 5))
    else:
        state = load_sharded(ckpt, model, opt)
        _train(model, par, opt, range(state["step"] + 1, 5))
        at_two = None
    weights = _full_weights(model)
    if rank == 0:
        torch.save({"at_two": at_two, "end": weights}, os.path.join(out, f"{phase}.pt"))


def run_plan_cuda(rank: int, world: int, out: str, name: str, family: str, keys: dict) -> None:
    """`run_plan` on cuda:rank (nccl): loss and updated weights come back on the CPU."""
    model = build(family).to(f"cuda:{rank}")
    par = parallelize(model, plan(**keys), device=torch.device("cuda", rank))
    ids = batch().chunk(par.data_shards)[par.data_rank].to(f"cuda:{rank}")
    result = step(model, ids, par.sync_gradients)
    loss = result["loss"].clone()
    dist.all_reduce(loss)
    result["loss"] = (loss / world).cpu()
    result = {k: ({n: t.cpu() for n, t in v.items()} if isinstance(v, dict) else v) for k, v in result.items()}
    if rank == 0:
        torch.save(result, os.path.join(out, f"{name}.pt"))
