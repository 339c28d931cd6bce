"""distill: logit distillation of a causal LM from a frozen teacher, on when the run config has a [distill] table.

[data] is the sft recipe's (chat or prompt/completion rows, `train_on`, packing): the positions SFT would train
are where the student's next-token distribution is pulled toward the teacher's. [distill] picks the divergence
(kiln.train.divergence, TRL's GKD definitions): `beta = 0` forward KL(teacher || student), `beta = 1` reverse KL,
in between the generalized JSD; both distributions at `temperature`. The loss is the mean over those positions
(TRL's "batchmean" over unmasked tokens). Both models run their backbones only; each position's logits are made
through the LM heads a chunk at a time, so neither model's (tokens x vocab) logits exist. The teacher is
`teacher = DIR_OR_RUN` (an HF directory, a checkpoint, or a run's newest checkpoint), frozen, in eval mode, on
the run's device (sharded beside the student under FSDP); one whose vocabulary or tokenizer differs from the
student's is refused before work starts. Off-policy only: the student's own generations scored by the teacher
(GKD's lambda) need the generation engine and are not here yet.
Metrics: at evaluation `eval_loss` is the same divergence over the eval rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kiln.errors import ConfigError, KilnError
from kiln.models.auto import load_pretrained
from kiln.models.common.loss import shift_labels
from kiln.models.tasks import CAUSAL_LM
from kiln.parallel.world import all_reduce_sum
from kiln.train.config import Positive, RunConfig, Section, finite
from kiln.train.divergence import linear_divergence
from kiln.train.engine import StepEngine
from kiln.train.plans import place_frozen
from kiln.train.recipes.base import Extension, RunParts
from kiln.train.recipes.dpo import evaluating
from kiln.train.recipes.sft import SFT
from kiln.train.shares import eval_share, model_dir_of
from kiln.train.trainer import Callback, Trainer

INPUTS = ("input_ids", "attention_mask", "position_ids")


class DistillSection(Section):
    """[distill]: the teacher and the divergence."""
    teacher: str                       # an HF directory, a checkpoint or a run directory
    beta: finite(ge=0, le=1) = 0.0     # 0: forward KL, 1: reverse KL, between: generalized JSD
    temperature: Positive = 1.0



def check_teacher(teacher: nn.Module, student: nn.Module, where: str) -> None:
    """The teacher scores the student's tokens: same vocabulary size and the same tokenizer, or a message."""
    tv, sv = teacher.config.vocab_size, student.config.vocab_size
    if tv != sv:
        raise ConfigError(f"distill.teacher {where}: its vocabulary has {tv} entries, the student's {sv}; logit "
                          "distillation compares the two distributions token by token, so they must share one")
    if teacher.tokenizer is None:
        raise ConfigError(f"distill.teacher {where}: no tokenizer files, so it cannot be checked to read the "
                          "student's tokens as the same text")
    a, b = teacher.tokenizer.backend.get_vocab(with_added_tokens=True), \
        student.tokenizer.backend.get_vocab(with_added_tokens=True)
    if a != b:
        differ = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])[:3]
        raise ConfigError(f"distill.teacher {where}: its tokenizer differs from the student's (e.g. "
                          f"{', '.join(f'{t!r}={i}' for t, i in differ)}); the two must map text to the same ids")


def _core(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


class DistillRun(Callback):
    """The step and the evaluation of one distill run; the teacher, placed at the first step."""

    def __init__(self, cfg: DistillSection, teacher: nn.Module, evals: list[dict[str, torch.Tensor]] | None):
        self.cfg, self.teacher, self.evals = cfg, teacher, evals
        self.trainer: Trainer | None = None
        self.placed = False

    def wrap_engine(self, trainer: Trainer, engine: StepEngine) -> StepEngine:
        self.trainer = trainer
        return engine

    def _place(self) -> None:
        t = self.trainer
        if not self.placed and t is not None:
            self.placed = True
            self.teacher = place_frozen(self.teacher, t.device, t.plan, t.parallel, not t.args.exact)

    def loss_sum(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(divergence summed over the scored positions, their count)."""
        inputs = {k: batch[k] for k in INPUTS if k in batch}
        keep = shift_labels(batch["labels"]) != -100  # (B, T): positions whose next token is trained
        with torch.no_grad():
            teacher = _core(self.teacher)
            th = teacher.model(**inputs)[keep]  # (N, C_t) the teacher's backbone only
        core = _core(model)
        # under DDP through its forward (readies the gradient sync), one position's logits at most
        hs = core.model(**inputs) if core is model else model(**inputs, logits_to_keep=1).last_hidden_state
        bias = None if core.lm_head is None else core.lm_head.bias
        tbias = None if teacher.lm_head is None else teacher.lm_head.bias
        total = linear_divergence(hs[keep], core.output_weight, th, teacher.output_weight, beta=self.cfg.beta,
                                  temperature=self.cfg.temperature, bias=bias, teacher_bias=tbias)
        return total, keep.sum()

    def step(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        self._place()
        return self.loss_sum(model, batch)

    @torch.no_grad()
    def evaluate(self, trainer: Trainer) -> dict[str, float]:
        self._place()
        sums = torch.zeros(2, dtype=torch.float64, device=trainer.device)
        with evaluating(trainer.model):
            for batch in eval_share(self.evals or [], trainer.data_rank, trainer.data_shards, trainer.args.batch_size,
                                    trainer.device, trainer.args.eval_batches):
                w = batch.pop("weight")
                if float(w.min()) == 0.0:  # a repeated row that evens the ranks' batch counts: not counted
                    batch["labels"] = batch["labels"].masked_fill(w[:, None] == 0, -100)
                with trainer.autocast():
                    total, count = self.loss_sum(trainer.model, batch)
                sums += torch.stack([total.double(), count.double()])
        sums = all_reduce_sum(sums, trainer.world).cpu()
        return {"eval_loss": float(sums[0] / sums[1].clamp(min=1))}


class Distill(SFT):
    name = "distill"
    summary = "logit distillation of a causal LM from a frozen teacher (forward / reverse KL, generalized JSD)"
    when = "a [distill] table"

    def matches(self, task: str, data: Mapping[str, Any]) -> bool:
        return False  # chosen by its table ([distill]), never by the data alone


class DistillExtension(Extension):
    section = "distill"
    schema = DistillSection
    summary = "logit distillation: the teacher ([distill] teacher = DIR_OR_RUN), beta and temperature"
    recipes = ("distill",)
    recipe = "distill"

    def check(self, cfg: RunConfig, recipe: Any) -> None:
        super().check(cfg, recipe)
        if cfg.model.task != CAUSAL_LM:
            raise ConfigError(f"[distill] trains a causal LM: set model.task = {CAUSAL_LM!r} (got {cfg.model.task!r})")
        p = cfg.parallel
        if p is not None and (p.compile or any(getattr(p, k, 1) > 1 for k in ("tp", "ep", "pp", "cp"))):
            raise ConfigError("[distill] runs on one process, under DDP or under FSDP ([parallel] dp and fsdp); "
                              "parallel.tp, ep, pp, cp and compile are not supported with it yet")

    def on_model(self, cfg: RunConfig, model: nn.Module) -> None:
        """The teacher is read and checked here, before any data work."""
        src = model_dir_of(cfg.distill.teacher, (), "teacher")
        teacher = load_pretrained(src, task=CAUSAL_LM)
        check_teacher(teacher, model, str(src))
        self._teacher = teacher

    def extend(self, cfg: RunConfig, parts: RunParts) -> None:
        teacher = getattr(self, "_teacher", None)
        if teacher is None:
            raise KilnError("[distill]: the teacher was not read when the student was built")
        self._teacher = None
        evals = parts.eval_data
        run = DistillRun(cfg.distill, teacher, list(evals) if evals is not None else None)
        parts.step = run.step
        parts.evaluate = run.evaluate if evals else None
        parts.callbacks.append(run)


RECIPE = Distill()
EXTENSION = DistillExtension()
