"""Aux-loss-free load balancing for sigmoid-routed MoE models (DeepSeek-V3's recipe), as a Trainer callback.

During training forwards every `GroupLimitedRouter` counts the tokens it sends to each expert.
After each optimizer step this callback takes those counts (summed over the step's micro-batches
and over processes) and moves each layer's `e_score_correction_bias` a fixed step toward balance:

    bias_e += bias_update_speed * sign(mean_load - load_e)

so an overloaded expert is chosen less often from the next step on and an idle one more often.
The bias only steers which experts are picked, never the weights they get, so no gradient
changes. It is a buffer of the model: checkpoints save it (under transformers' name) and a
resumed run continues exactly. A step the Trainer skipped (non-finite loss) moves nothing.

Per step it returns, for metrics, each MoE layer's max and mean tokens per expert and
`moe_imbalance`, the mean over layers of max / mean (1.0 = perfectly even).

The alternative, `sequence_aux_loss`, is DeepSeek-V3's complementary sequence-wise balance loss
(report eq. 17-20): a differentiable penalty added to the training loss (the `[moe]` extension,
kiln.train.recipes.moe, does both from a run config).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kiln.errors import KilnError
from kiln.models.common.moe_routing import GroupLimitedRouter
from kiln.parallel.world import all_reduce_sum
from kiln.train.trainer import Callback

if TYPE_CHECKING:
    from kiln.train.trainer import Trainer


def routers(model: nn.Module) -> list[tuple[str, GroupLimitedRouter]]:
    """(module name, router) of every sigmoid-routed MoE layer, in layer order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, GroupLimitedRouter)]


def load_stats(loads: torch.Tensor, names: list[str]) -> dict[str, float]:
    """loads (L, E) tokens per expert -> {moe_max_load.<layer>, moe_mean_load.<layer>, moe_imbalance}."""
    loads = loads.double()
    peak, mean = loads.max(dim=-1).values, loads.mean(dim=-1)  # (L,)
    out: dict[str, float] = {}
    for name, p, m in zip(names, peak.tolist(), mean.tolist()):
        out[f"moe_max_load.{name}"] = p
        out[f"moe_mean_load.{name}"] = m
    ratio = peak / mean.clamp(min=1e-12)
    out["moe_imbalance"] = float(ratio.mean())
    return out


@torch.no_grad()
def update_biases(found: list[GroupLimitedRouter], loads: torch.Tensor, speed: float) -> None:
    """One aux-loss-free step: each bias moves by `speed` against its expert's excess load."""
    for router, load in zip(found, loads):
        load = load.to(router.e_score_correction_bias.device, torch.float32)
        router.e_score_correction_bias.add_(torch.sign(load.mean() - load), alpha=speed)


def segment_ids(input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """(N,) = (B*T,) sequence id of every token for the balance loss; -1 for padding.

    Packed rows (position_ids restarting at 0 where a sample starts) give one id per sample; without
    position ids each row is one sequence."""
    B, T = input_ids.shape
    starts = torch.zeros(B, T, dtype=torch.bool, device=input_ids.device)
    if position_ids is not None:
        starts = position_ids.expand(B, T) == 0
    starts[:, 0] = True
    ids = torch.cumsum(starts.long(), dim=1) - 1 + torch.arange(B, device=input_ids.device)[:, None] * T  # (B, T)
    if attention_mask is not None:
        ids = ids.masked_fill(attention_mask == 0, -1)
    return ids.reshape(-1)


def sequence_aux_loss(router_logits: torch.Tensor, index: torch.Tensor, top_k: int,
                      segments: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss of one MoE layer, averaged over sequences (without alpha).

    router_logits (N, E) float32, index (N, k) the picked experts, segments (N,) a sequence id per token
    (-1: left out). Per sequence of T tokens, with s' the sigmoid affinities normalised over all E experts:
        f_i = E / (k T) * #tokens that picked expert i,   P_i = mean over tokens of s'_i,   loss = sum_i f_i P_i
    (1.0 when the load and the affinities are both even). Only P carries gradients."""
    E = router_logits.shape[-1]
    keep = segments >= 0
    seg = torch.unique(segments[keep], return_inverse=True)[1]  # (n,) 0..S-1
    if seg.numel() == 0:
        return router_logits.sum() * 0.0
    scores = router_logits[keep].sigmoid()
    scores = scores / scores.sum(-1, keepdim=True)  # (n, E) s'
    S = int(seg.max()) + 1
    tokens = torch.bincount(seg, minlength=S).to(scores.dtype)[:, None]  # (S, 1)
    picked = index[keep]
    counts = torch.zeros(S, E, dtype=scores.dtype, device=scores.device)
    counts.index_put_((seg[:, None].expand_as(picked), picked), torch.ones_like(picked, dtype=scores.dtype),
                      accumulate=True)
    f = counts * (E / top_k) / tokens
    P = torch.zeros(S, E, dtype=scores.dtype, device=scores.device).index_add(0, seg, scores) / tokens
    return (f * P).sum(-1).mean()


class AuxFreeBalance(Callback):
    """Trainer callback: `Trainer(..., callbacks=[AuxFreeBalance(bias_update_speed=1e-3)])`.

    `update=False` only measures: the same statistics, biases left alone.
    """

    def __init__(self, bias_update_speed: float = 1e-3, update: bool = True):
        if not bias_update_speed > 0:
            raise KilnError(f"bias_update_speed must be > 0, got {bias_update_speed}")
        self.speed, self.update = bias_update_speed, update
        self.last: dict[str, float] = {}   # the latest step's statistics
        self.history: list[dict[str, float]] = []

    def _found(self, trainer: Trainer) -> list[tuple[str, GroupLimitedRouter]]:
        found = routers(trainer.unwrapped())
        if not found:
            raise KilnError("AuxFreeBalance: the model has no sigmoid-routed MoE layer (GroupLimitedRouter) whose "
                            "e_score_correction_bias it could adjust")
        return found

    def on_setup(self, trainer: Trainer, step: int) -> None:
        if getattr(trainer.parallel, "pp", 1) > 1:  # (the plans are applied after on_setup)
            raise KilnError("expert-load balancing ([moe]) with parallel.pp > 1 is not supported: each pipeline "
                            "stage holds different MoE layers; use dp, fsdp, tp or ep")
        for _, router in self._found(trainer):
            router.take_load()  # counts start with the first step of this run (resumed or not)

    def on_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        found = self._found(trainer)
        loads = torch.stack([r.take_load().cpu() for _, r in found])  # (L, E) int64
        device = trainer.device if trainer.world.active and trainer.device.type == "cuda" else torch.device("cpu")
        loads = all_reduce_sum(loads.to(device), trainer.world).cpu()  # every rank then moves its biases alike
        if trainer.plan is not None and trainer.plan.degrees.tp > 1:
            loads = loads // trainer.plan.degrees.tp  # a tp group's ranks all route the same (whole) tokens
        if not (math.isfinite(record["loss"]) and math.isfinite(record["grad_norm"])):
            return  # the Trainer skipped this optimizer step (non-finite): the bias stays too
        names = [name.removesuffix(".gate").removesuffix(".mlp") for name, _ in found]
        stats = load_stats(loads, names)
        if self.update:
            update_biases([r for _, r in found], loads, self.speed)
        self.last = stats
        self.history.append({"step": trainer.step, **stats})
        record.update(stats)  # the Trainer writes the step's metrics line after its callbacks' on_step
