"""[moe]: DeepSeek-V3 / V3.2 / GLM-5 training switches for any recipe (pretrain, sft, fine-tune).

    [moe]
    balance = "aux_free"        # DeepSeek-V3's bias steps (kiln.train.moe_balance.AuxFreeBalance);
                                # "seq_aux": the sequence-wise balance loss instead; "none"
    bias_update_speed = 1e-3    # aux_free: the bias step per optimizer step
    seq_aux_alpha = 1e-4        # seq_aux: the loss weight alpha
    mtp_weight = 0.0            # > 0: train the depth-1 multi-token-prediction layer with this weight
    indexer = "frozen"          # "kl": train the sparse-attention indexer on its KL loss
    indexer_loss_weight = 1.0

The extra losses join the step's loss per unit (loss = LM + seq_aux_alpha * balance loss + mtp_weight *
MTP cross entropy + indexer_loss_weight * indexer KL) and are logged apart in metrics.jsonl:
`moe_aux_loss` (alpha included, summed over MoE layers), `mtp_loss` and `indexer_loss` (unweighted;
the indexer's averaged over its layers), `lm_loss` (the step's own loss alone); each is a mean per unit
over the step's micro-batches and processes, so loss = lm_loss + the weighted others. The balance loss is
per packed sample where position_ids mark where samples start, else per row. Expert-load statistics
(`moe_max_load.<layer>`, `moe_mean_load.<layer>`, `moe_imbalance`) are logged whatever `balance` is;
only "aux_free" moves the biases. The indexer's inputs are detached, so its loss trains the indexer
alone and the LM loss never reaches it (its top-k choice is not differentiable).
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, runtime_checkable

import torch
from pydantic import model_validator
from torch import nn

from kiln.errors import ConfigError, KilnError
from kiln.models.common.dsa import Indexer
from kiln.models.common.moe_routing import SharedExpertMoE
from kiln.models.common.wrapped import unwrap
from kiln.parallel.world import all_reduce_sum
from kiln.train.config import NonNegative, Positive, RunConfig, Section
from kiln.train.moe_balance import AuxFreeBalance, routers, segment_ids, sequence_aux_loss
from kiln.train.recipes.base import Extension, RunParts, Shortcut
from kiln.train.steps import StepFn, as_sum_and_count, default_step
from kiln.train.trainer import Callback, Trainer


class MoeSection(Section):
    """Load balancing, multi-token prediction and indexer training for DeepSeek-style MoE models."""
    balance: Literal["aux_free", "seq_aux", "none"] = "aux_free"
    bias_update_speed: Positive = 1e-3
    seq_aux_alpha: Positive = 1e-4
    mtp_weight: NonNegative = 0.0
    indexer: Literal["frozen", "kl"] = "frozen"
    indexer_loss_weight: Positive = 1.0

    @model_validator(mode="after")
    def _check(self) -> MoeSection:
        for name in ("bias_update_speed", "seq_aux_alpha", "indexer_loss_weight"):
            if not getattr(self, name) > 0:
                raise ValueError(f"moe.{name} must be > 0, got {getattr(self, name)}")
        if not self.mtp_weight >= 0:
            raise ValueError(f"moe.mtp_weight must be >= 0 (0 = off), got {self.mtp_weight}")
        return self


@runtime_checkable
class _LeavesMtpLoss(Protocol):
    """A model with a live MTP layer: a training forward leaves (loss sum, count) of its t+2 predictions."""
    mtp_loss_parts: tuple[torch.Tensor, torch.Tensor] | None


def _model_type(model: nn.Module) -> str:
    return getattr(getattr(model, "config", None), "model_type", type(model).__name__)


class MoeLosses(Callback):
    """Runs the extra losses beside the step's own and writes their means into the step's metrics line."""

    def __init__(self, cfg: MoeSection, inner: StepFn):
        self.cfg, self.inner = cfg, inner
        self.sums: dict[str, float] = {}   # name -> sum over this step's micro-batches of (mean x units)
        self.units = 0.0

    def step(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The wrapped step: (its loss sum + the weighted extra losses per unit, its count)."""
        result = self.inner(model, batch)
        if isinstance(result, dict):
            raise KilnError("[moe] adds its losses to a step with one loss; this run's step returns several "
                            f"({', '.join(result)})")
        loss_sum, count = as_sum_and_count(result, batch)
        m, c = unwrap(model), self.cfg
        units = count.to(loss_sum.device, loss_sum.dtype)
        # each part's mean times the units it is weighted by, as it joins the loss sum: loss = lm_loss + the rest
        terms = {"lm_loss": loss_sum}
        if c.balance == "seq_aux":
            terms["moe_aux_loss"] = self._balance_loss(m, batch) * c.seq_aux_alpha * units
        if c.mtp_weight > 0:
            found = m.mtp_loss_parts if isinstance(m, _LeavesMtpLoss) else None
            if found is None or not isinstance(m, _LeavesMtpLoss):
                raise KilnError("[moe] mtp_weight > 0 but the forward left no MTP loss (does the step pass labels "
                                "or targets to the model?)")
            m.mtp_loss_parts = None
            terms["mtp_loss"] = found[0] / found[1].clamp(min=1) * units
        if c.indexer == "kl":
            indexers = [ix for ix in m.modules() if isinstance(ix, Indexer)]
            losses = [ix.loss for ix in indexers if ix.loss is not None]
            for ix in indexers:
                ix.loss = None
            if losses:
                # under context parallelism each rank's KL is its share of the whole rows' mean
                # (kiln.parallel.context): weighted by the cp group's units, the ranks add up to one process
                cp = next((ix.context for ix in indexers if ix.context is not None), None)
                terms["indexer_loss"] = torch.stack(losses).mean() * (units if cp is None else cp.group_sum(units))
        weight = {"mtp_loss": c.mtp_weight, "indexer_loss": c.indexer_loss_weight}
        total = loss_sum + sum(weight.get(k, 1.0) * v for k, v in terms.items() if k != "lm_loss")
        for k, v in terms.items():
            self.sums[k] = self.sums.get(k, 0.0) + float(v.detach())
        self.units += float(count)
        return total, count

    @staticmethod
    def _balance_loss(m: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"]
        segments = segment_ids(ids, batch.get("position_ids"), batch.get("attention_mask"))
        total = None
        for moe in m.modules():
            if isinstance(moe, SharedExpertMoE) and moe.router_logits is not None and moe.router_index is not None:
                part = sequence_aux_loss(moe.router_logits, moe.router_index, moe.gate.top_k, segments)
                total = part if total is None else total + part
                moe.router_logits = moe.router_index = None  # this forward's; free the graph they hold
        if total is None:
            raise KilnError("[moe] balance = 'seq_aux': no MoE layer routed this batch")
        return total

    def on_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if not self.units:
            return
        names = sorted(self.sums)
        totals = torch.tensor([self.sums[k] for k in names] + [self.units], dtype=torch.float64)
        device = trainer.device if trainer.world.active and trainer.device.type == "cuda" else torch.device("cpu")
        totals = all_reduce_sum(totals.to(device), trainer.world).cpu()  # every rank's micro-batches
        for k, v in zip(names, totals[:-1].tolist()):
            record[k] = v / float(totals[-1])
        self.sums, self.units = {}, 0.0


class Moe(Extension[MoeSection]):
    section = "moe"
    schema = MoeSection
    summary = "DeepSeek-style MoE training: aux-free or sequence-wise balancing, MTP loss, indexer KL loss"
    recipes = ("pretrain", "sft", "fine-tune")
    shortcuts = (Shortcut("balance", "moe.balance"), Shortcut("mtp_weight", "moe.mtp_weight"),
                 Shortcut("indexer", "moe.indexer"))

    def on_model(self, cfg: RunConfig, model: nn.Module) -> None:
        c, kind = self.table(cfg), _model_type(model)
        if c.balance != "none" and not routers(model):
            raise ConfigError(f"[moe] balance = {c.balance!r} balances sigmoid-routed MoE layers (DeepSeek-V3 style, "
                              f"with e_score_correction_bias); a {kind} model has none; set balance = \"none\"")
        if c.balance == "seq_aux" and cfg.parallel.cp > 1:
            raise ConfigError(f"[moe] balance = \"seq_aux\" with parallel.cp = {cfg.parallel.cp}: the sequence-wise "
                              "balance loss needs each whole sequence's routing, and every cp rank sees only its "
                              "chunks of it; use balance = \"aux_free\" (its expert loads add up over the ranks)")
        if c.mtp_weight > 0:
            enable_mtp = getattr(model, "enable_mtp", None)
            if enable_mtp is None:
                raise ConfigError(f"[moe] mtp_weight = {c.mtp_weight}: a {kind} {getattr(model, 'task', '')} model has "
                                  "no multi-token-prediction layer (deepseek_v3 / deepseek_v32 / glm_moe_dsa / deepseek_v4 "
                                  "causal LMs and qwen3_5 / qwen3_5_moe image-text releases do)")
            enable_mtp(f"[moe] mtp_weight = {c.mtp_weight}: {cfg.model.path or cfg.model.family}",
                             fresh=cfg.model.path is None)
        if c.indexer == "kl" and not any(isinstance(m, Indexer) for m in model.modules()):
            raise ConfigError(f"[moe] indexer = \"kl\" trains a sparse-attention indexer (deepseek_v32, glm_moe_dsa); "
                              f"a {kind} model has none")

    def extend(self, cfg: RunConfig, parts: RunParts) -> None:
        c = self.table(cfg)
        if routers(parts.model):  # load statistics whatever the balancing; only aux_free moves the biases
            parts.callbacks.append(AuxFreeBalance(c.bias_update_speed, update=c.balance == "aux_free"))
        if c.indexer == "kl":  # after [lora] froze the base: the indexer trains on its own loss
            for ix in parts.model.modules():
                if isinstance(ix, Indexer):
                    ix.train_kl = True
                    ix.requires_grad_(True)
        if c.balance == "seq_aux" or c.mtp_weight > 0 or c.indexer == "kl":
            losses = MoeLosses(c, parts.step or default_step)
            parts.step = losses.step
            parts.callbacks.append(losses)


EXTENSION = Moe()
