"""kto: Kahneman-Tversky optimization of a causal LM on unpaired rows, on when the run config has a [kto] table.

[data] names rows `{"prompt", "completion", "label"}` (TRL's unpaired format; kiln.data.kto tokenizes them as
TRL 1.16's KTOTrainer). The loss is TRL's `KTOTrainer._compute_loss`, per row:
- desirable:   `desirable_weight * (1 - sigmoid(beta * (logratio - kl)))`
- undesirable: `undesirable_weight * (1 - sigmoid(beta * (kl - logratio)))`
with `logratio` the completion's summed log-prob under the policy minus the reference's, and `kl` the
reference-point estimate TRL makes: each micro-batch's completions rotated by one against its prompts
(row i's prompt + row i-1's completion, as TRL's collator pairs them), the mean of policy minus reference
summed log-probs of those mismatched sequences, detached, averaged over processes, clamped at 0.
`loss_type = "apo_zero_unpaired"` is TRL's unpaired APO-zero (no KL term). The step's loss is the mean over
rows. The reference is the starting weights (under [lora] the base with the adapters off; otherwise a frozen
copy) or `reference = "path"`. Metrics per step and at evaluation (`eval_` prefixed): kl, rewards/chosen,
rewards/rejected, rewards/margins (desirable minus undesirable mean reward), logps/chosen, logps/rejected.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

from kiln.data import read_records
from kiln.data.hfdata import source_sha256
from kiln.data.kto import encode_unpaired
from kiln.errors import ConfigError, KilnError
from kiln.models.auto import load_pretrained
from kiln.models.tasks import CAUSAL_LM
from kiln.parallel.world import World, all_reduce_sum
from kiln.train.config import Positive, RunConfig, Section
from kiln.train.packing import Layout, lay_out, layout_logps, settle_pack
from kiln.train.plans import place_frozen
from kiln.train.preference import Signal
from kiln.train.recipes.base import Extension, RunParts, add_lora, build_model, check_text_model
from kiln.train.recipes.dpo import adapters_off, check_reference_vocab
from kiln.train.recipes.finetune import FineTune
from kiln.train.recipes.pairwise import PackedData, ScoredRun, evaluating

# sums: rows, tokens, loss, kl (per batch), batches, desirable rows, chosen reward, chosen logps, undesirable rows,
# rejected reward, rejected logps
SUMS = ("rows", "tokens", "loss", "kl", "batches", "chosen", "rewards/chosen", "logps/chosen", "rejected",
        "rewards/rejected", "logps/rejected")


class UnpairedData(PackedData):
    """[data] of a kto run: rows {prompt, completion, label}; max_length caps each prompt + completion."""


class KTOSection(Section):
    """[kto]: TRL's KTOConfig options of the loss, and the reference."""
    loss_type: Literal["kto", "apo_zero_unpaired"] = "kto"
    beta: Positive = 0.1
    desirable_weight: Positive = 1.0
    undesirable_weight: Positive = 1.0
    reference: str | None = None   # an HF directory; default: the starting weights



def unpaired_layout(batch: Mapping[str, torch.Tensor], max_length: int, pack: bool, shift: int = 0) -> Layout:
    """The micro-batch's sequences, padded with 0 or packed (kiln.train.packing): sequence i is prompt i followed
    by completion i - shift (cyclic; shift 1 is TRL's KL pairing), cut to `max_length`; mask "comp" scores the
    completion."""
    n = batch["prompt_ids"].shape[0]
    plens, clens = batch["prompt_len"].tolist(), batch["completion_len"].tolist()
    ids, comp = [], []
    for i in range(n):
        j = (i - shift) % n
        seq = torch.cat([batch["prompt_ids"][i][:plens[i]], batch["completion_ids"][j][:clens[j]]])[:max_length]
        mask = torch.zeros_like(seq)
        mask[plens[i]:] = 1
        ids.append(seq)
        comp.append(mask)
    return lay_out(ids, {"comp": comp}, pack)


def kto_losses(loss_type: str, logratios: torch.Tensor, labels: torch.Tensor, kl: torch.Tensor, beta: float,
               desirable_weight: float, undesirable_weight: float) -> torch.Tensor:
    """(B,) per-row losses (weights applied); their mean is TRL 1.16's KTO loss for the batch."""
    if loss_type == "kto":
        good = 1 - F.sigmoid(beta * (logratios - kl))
        bad = 1 - F.sigmoid(beta * (kl - logratios))
    else:  # apo_zero_unpaired
        good = 1 - F.sigmoid(beta * logratios)
        bad = F.sigmoid(beta * logratios)
    return torch.where(labels, desirable_weight * good, undesirable_weight * bad)


class KTORun(ScoredRun):
    """The step, the evaluation, the reference and the per-step metrics of one kto run."""
    STATS = SUMS

    def __init__(self, cfg: KTOSection, max_length: int, evals: list[dict[str, torch.Tensor]] | None,
                 starting_copy: nn.Module | None, pack: bool = False):
        super().__init__(evals, pack, Signal("rows", "no completion token within max_length"))
        self.cfg, self.max_length = cfg, max_length
        self.ref_model = starting_copy
        self.placed = False

    def ready(self) -> None:
        t = self.trainer
        if self.placed or t is None:
            return
        self.placed = True
        if self.cfg.reference is not None:
            self.ref_model = load_pretrained(self.cfg.reference, task=CAUSAL_LM)
        if self.ref_model is not None:
            self.ref_model = place_frozen(self.ref_model, t.device, t.plan, t.parallel, not t.args.exact)

    @torch.no_grad()
    def _seq_logps(self, model: nn.Module, layout: Layout, reference: bool) -> torch.Tensor:
        """(B,) summed completion log-probs, no gradient: the policy's (in its current mode, as TRL's KL pass), or
        the reference's (the frozen copy in eval mode, or under [lora] the policy with its adapters off)."""
        ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
        if reference and self.ref_model is not None:
            model, ctx = self.ref_model, evaluating(self.ref_model)
        elif reference:
            ctx = adapters_off(model)
        with ctx:
            return layout.per_sequence(layout_logps(model, layout, "comp"))

    def row_losses(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, Any]]:
        """(per-row losses (B,), what the metrics need) for one micro-batch."""
        c = self.cfg
        labels = batch["label"].bool()
        kl = torch.zeros((), device=labels.device)
        if c.loss_type == "kto":  # the reference point: mismatched pairs, no gradient (as TRL)
            if labels.shape[0] < 2:
                raise KilnError("kto: the KL reference point pairs each prompt with another row's completion; "
                                "a micro-batch of one row has none (set train.batch_size >= 2)")
            mismatched = unpaired_layout(batch, self.max_length, self.pack, shift=1)
            kl_rows = self._seq_logps(model, mismatched, False) - self._seq_logps(model, mismatched, True)
            kl = kl_rows.mean()
            world = self.trainer.world if self.trainer is not None else None
            if world is not None and world.size > 1:  # TRL gathers the per-process means and averages them
                kl = all_reduce_sum(kl.reshape(1).double(), world)[0].float() / world.size
            kl = kl.clamp(min=0)
        layout = unpaired_layout(batch, self.max_length, self.pack)
        ref = self._seq_logps(model, layout, True)  # before the policy: under DDP the graph's forward is last
        logps = layout.per_sequence(layout_logps(model, layout, "comp"))
        ratios = logps - ref
        losses = kto_losses(c.loss_type, ratios, labels, kl, c.beta, c.desirable_weight, c.undesirable_weight)
        return losses, {"labels": labels, "kl": kl.detach(), "rewards": c.beta * ratios.detach(),
                        "logps": logps.detach(), "tokens": float(layout.tokens())}

    @staticmethod
    def _stats(losses: torch.Tensor, info: dict[str, Any], weight: torch.Tensor) -> torch.Tensor:
        w = weight.double()
        good, bad = w * info["labels"].double(), w * (~info["labels"]).double()
        r, lp = info["rewards"].double(), info["logps"].double()
        parts = [w.sum(), torch.tensor(info["tokens"], dtype=torch.float64, device=w.device),
                 (losses.detach().double() * w).sum(), info["kl"].double().reshape(()),
                 torch.ones((), dtype=torch.float64, device=w.device),
                 good.sum(), (r * good).sum(), (lp * good).sum(), bad.sum(), (r * bad).sum(), (lp * bad).sum()]
        return torch.stack([p.to(w.device) for p in parts]).cpu()

    def step(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        self.ready()
        losses, info = self.row_losses(model, batch)
        self.sums += self._stats(losses, info, torch.ones_like(losses))
        # every row teaches that scores a completion token (the weights are > 0; empty completions refused at read)
        self.signal.add(torch.minimum(batch["completion_len"], self.max_length - batch["prompt_len"]) > 0)
        return losses.sum(), losses.shape[0]

    def means(self, s: torch.Tensor, prefix: str) -> dict[str, float]:
        out = {f"{prefix}loss": float(s[2] / max(float(s[0]), 1.0)), f"{prefix}kl": float(s[3] / max(float(s[4]), 1.0))}
        for side, n in (("chosen", 5), ("rejected", 8)):
            if s[n] > 0:
                out[f"{prefix}rewards/{side}"] = float(s[n + 1] / s[n])
                out[f"{prefix}logps/{side}"] = float(s[n + 2] / s[n])
        if s[5] > 0 and s[8] > 0:
            out[f"{prefix}rewards/margins"] = out[f"{prefix}rewards/chosen"] - out[f"{prefix}rewards/rejected"]
        return out

    def eval_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        losses, info = self.row_losses(model, batch)
        return self._stats(losses, info, batch["weight"])


class KTO(FineTune):
    name = "kto"
    summary = "Kahneman-Tversky optimization of a causal LM on unpaired desirable / undesirable completions"
    when = "a [kto] table"
    data_schema = UnpairedData

    def matches(self, task: str, data: Mapping[str, Any]) -> bool:
        return False  # chosen by its table ([kto]), never by the data alone

    def fingerprint(self, cfg: RunConfig, labels: list[str] | None) -> dict[str, Any]:
        d = cfg.data
        return {"train": str(d.train), "train_sha256": source_sha256(d.train), "max_length": d.max_length,
                "eval_sha256": source_sha256(d.eval) if d.eval else None}

    def build(self, cfg: RunConfig, on_model: Callable[[nn.Module], None], world: World) -> RunParts:
        d = cfg.data
        assert isinstance(d, UnpairedData), f"kto builds from its own [data] schema, got {type(d).__name__}"
        if cfg.model.task != CAUSAL_LM:
            raise ConfigError(f"[kto] trains a causal LM: set model.task = {CAUSAL_LM!r} (got {cfg.model.task!r})")
        if cfg.kto.loss_type == "kto" and cfg.train.batch_size < 2:
            raise ConfigError("[kto] loss_type 'kto' estimates its KL reference point from the other rows of a "
                              "micro-batch: train.batch_size must be at least 2")
        train_records = read_records(d.train, d.format)
        eval_records = read_records(d.eval, d.format) if d.eval else None
        model = build_model(cfg, None)
        on_model(model)
        settle_pack(d, model, cfg.model.path or cfg.model.family, lambda m: print(m) if world.main else None)
        check_text_model(cfg, model, d.max_length)
        add_lora(cfg, model)
        train, stats = encode_unpaired(train_records, model.tokenizer, d.max_length)
        evals = encode_unpaired(eval_records, model.tokenizer, d.max_length) if eval_records is not None else None
        if world.main:
            print(f"kto: data.train {d.train}: {stats.line()}")
            if evals is not None:
                print(f"kto: data.eval {d.eval}: {evals[1].line()}")
        if not train:
            raise KilnError(f"data.train {d.train}: no row left within data.max_length = {d.max_length}")
        return RunParts(model, train, eval_data=evals[0] if evals else None, fingerprint=self.fingerprint(cfg, None))


class KTOExtension(Extension):
    section = "kto"
    schema = KTOSection
    summary = "Kahneman-Tversky optimization: the loss ([kto] loss_type, beta, weights) and its reference"
    recipes = ("kto",)
    recipe = "kto"  # the recipe this table selects

    def check(self, cfg: RunConfig, recipe: Any) -> None:
        super().check(cfg, recipe)
        p = cfg.parallel
        if p is not None and (p.compile or p.activation_checkpointing != "none"
                              or any(getattr(p, k, 1) > 1 for k in ("tp", "ep", "pp", "cp"))):
            raise ConfigError("[kto] runs on one process, under DDP or under FSDP ([parallel] dp and fsdp); "
                              "parallel.tp, ep, pp, cp, compile and activation_checkpointing are not supported with "
                              "it yet")

    def extend(self, cfg: RunConfig, parts: RunParts) -> None:
        c, evals = cfg.kto, parts.eval_data
        if c.reference is not None:
            check_reference_vocab(c.reference, parts.model, "kto.reference")
        copy_needed = c.reference is None and cfg.lora is None
        if copy_needed and getattr(parts.model, "deferred_read", None) is not None:
            raise ConfigError("[kto] with the weights read sharded: the default reference is a whole copy of the "
                              "starting weights, which no process holds; use [lora] or kto.reference")
        starting = copy.deepcopy(parts.model) if copy_needed else None
        run = KTORun(c, cfg.data.max_length, list(evals) if evals is not None else None, starting, cfg.data.pack)
        parts.step = run.step
        parts.evaluate = run.evaluate if evals else None
        parts.callbacks.append(run)


RECIPE = KTO()
EXTENSION = KTOExtension()
