"""distill: logit distillation of a causal LM from a frozen teacher, on when the run config has a [distill] table.

[data] is the sft recipe's (chat or prompt/completion rows, `train_on`, packing): the positions SFT would train
are where the student's next-token distribution is pulled toward the teacher's. [distill] picks the divergence
(kiln.train.divergence, TRL's GKD definitions): `beta = 0` forward KL(teacher || student), `beta = 1` reverse KL,
in between the generalized JSD; both distributions at `temperature`. The loss is the mean over those positions
(TRL's "batchmean" over unmasked tokens). Both models run their backbones only; each position's logits are made
through the LM heads a chunk at a time, so neither model's (tokens x vocab) logits exist. The teacher is
`teacher = DIR_OR_RUN` (an HF directory, a checkpoint, or a run's newest checkpoint), frozen, in eval mode, on
the run's device (sharded beside the student under FSDP); one whose vocabulary or tokenizer differs from the
student's is refused before work starts; `teacher_quantize = "nf4"` (or "fp4", `model.quantize`'s spelling) holds
its backbone Linears 4-bit.

On-policy (GKD's lambda, `lmbda` as TRL spells it): with probability `lmbda` a micro-batch's rows are replaced by
the student's own completions of their prompts (each sample's tokens before its first trained one), sampled at
`temperature` on the generation engine (kiln.engine, as GRPO's rollouts: the weights being trained, in place) up
to `max_new_tokens`, and the divergence is taken on the completion tokens. The coin and the sampling seed derive
from (train.seed, step, micro-batch; the rank too for the seed), so a run is the same every time and a resumed run
continues exactly; lmbda = 0 never draws. The engine must run the model (one process or DDP; not FSDP).
Metrics: at evaluation `eval_loss` is the same divergence over the eval rows (as they are: off-policy).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import model_validator
from torch import nn
from torch.nn import functional as F

from kiln.errors import ConfigError, KilnError
from kiln.models.auto import load_pretrained
from kiln.models.common.loss import shift_labels
from kiln.models.common.wrapped import unwrap
from kiln.models.tasks import CAUSAL_LM
from kiln.parallel.world import all_reduce_sum
from kiln.train.config import Positive, RunConfig, Section, finite
from kiln.train.divergence import linear_divergence
from kiln.train.engine import StepEngine
from kiln.train.grpo_engine import EngineRollouts, refusal
from kiln.train.packing import lay_out
from kiln.train.plans import place_frozen
from kiln.train.recipes.base import Extension, RunParts
from kiln.train.recipes.pairwise import evaluating
from kiln.train.recipes.sft import SFT
from kiln.train.shares import eval_share, model_dir_of
from kiln.train.trainer import Callback, Trainer

INPUTS = ("input_ids", "attention_mask", "position_ids")


class DistillSection(Section):
    """[distill]: the teacher and the divergence."""
    teacher: str                       # an HF directory, a checkpoint or a run directory
    beta: finite(ge=0, le=1) = 0.0     # 0: forward KL, 1: reverse KL, between: generalized JSD
    temperature: Positive = 1.0
    lmbda: finite(ge=0, le=1) = 0.0    # on-policy fraction: the chance a micro-batch is the student's generations
    max_new_tokens: int = 128          # on-policy: each completion's most tokens (TRL GKDConfig's default)
    teacher_quantize: Literal["nf4", "fp4"] | None = None  # the teacher's backbone Linears held 4-bit

    @model_validator(mode="after")
    def _check(self) -> DistillSection:
        if self.max_new_tokens < 1:
            raise ValueError(f"distill.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        return self


@dataclass(frozen=True)
class Sampling:
    """What the engine's rollouts read of the sampling settings: plain sampling at `temperature` (TRL GKD's:
    top_k 0, top_p 1)."""
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0


def _digest(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(":".join(map(str, ("kiln-gkd", *parts))).encode()).digest()[:8], "little") >> 1


def prompts_of(batch: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each sample's prompt: its tokens before its first trained one (a packed row's samples are where the
    positions restart at 0); a sample with no trained token (a packed row's padding tail) has none."""
    ids, labels = batch["input_ids"], batch["labels"]
    out = []
    for i in range(ids.size(0)):
        if "position_ids" in batch:
            starts = (batch["position_ids"][i] == 0).nonzero().flatten().tolist() + [ids.size(1)]
        else:
            starts = [0, int(batch["attention_mask"][i].sum())]
        for a, b in itertools.pairwise(starts):
            trained = (labels[i, a:b] != -100).nonzero()
            if trained.numel() and int(trained[0]) > 0:
                out.append(ids[i, a: a + int(trained[0])])
    return out


def completion_batch(prompts: list[torch.Tensor], completions: list[list[int]], pack: bool,
                     pad_id: int) -> dict[str, torch.Tensor]:
    """Prompt + completion sequences as a step's batch: rows padded (attention_mask) or packed (position_ids),
    labels on the completion tokens only."""
    ids = [torch.cat([p, torch.tensor(c, dtype=p.dtype, device=p.device)]) for p, c in zip(prompts, completions)]
    comp = [(torch.arange(len(x), device=x.device) >= len(p)).long() for x, p in zip(ids, prompts)]
    layout = lay_out(ids, {"comp": comp}, pack, pad_id)
    trained = F.pad(layout.scored["comp"], (1, 0))[:, :-1]  # scored at t: token t + 1 is a completion token
    batch = {"input_ids": layout.input_ids, "labels": layout.input_ids.masked_fill(~trained, -100)}
    if layout.packed:
        assert layout.position_ids is not None
        batch["position_ids"] = layout.position_ids
    else:
        assert layout.attention_mask is not None
        batch["attention_mask"] = layout.attention_mask
    return batch



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
    return unwrap(model)


class DistillRun(Callback):
    """The step and the evaluation of one distill run; the teacher, placed at the first step."""

    def __init__(self, cfg: DistillSection, teacher: nn.Module, evals: list[dict[str, torch.Tensor]] | None,
                 pack: bool = False):
        self.cfg, self.teacher, self.evals, self.pack = cfg, teacher, evals, pack
        self.trainer: Trainer | None = None
        self.placed = False
        self.rollouts = EngineRollouts(Sampling(cfg.temperature)) if cfg.lmbda > 0 else None
        self.at = (-1, 0)  # (step, micro-batch) of the latest call: the on-policy coin's and seed's place
        self.on_policy = 0  # micro-batches the student generated, this run (tests read it)

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
        if self.rollouts is not None and self.trainer is not None:
            step = self.trainer.step
            self.at = (step, self.at[1] + 1 if self.at[0] == step else 0)
            seed = self.trainer.args.seed
            # the coin: the same on every rank (their sequences must agree under DDP's one backward each)
            if _digest(seed, *self.at) / 2**63 < self.cfg.lmbda:
                batch = self.generated(model, batch, _digest(seed, *self.at, self.trainer.data_rank))
        return self.loss_sum(model, batch)

    @torch.no_grad()
    def generated(self, model: nn.Module, batch: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
        """The batch's prompts, each completed by the student on the generation engine."""
        assert self.rollouts is not None
        core = _core(model)
        prompts = prompts_of(batch)
        if not prompts:
            return dict(batch)
        eos = core.config.eos_token_id
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        self.rollouts.forget()  # remembered prompt blocks hold an earlier step's weights
        groups = self.rollouts.run(core, [p.tolist() for p in prompts], [self.cfg.max_new_tokens] * len(prompts), 1,
                                   torch.Generator().manual_seed(seed), eos_ids)
        self.on_policy += 1
        pad = core.config.pad_token_id
        return completion_batch(prompts, [g[0][0] for g in groups], self.pack,
                                pad if pad is not None else (eos_ids[0] if eos_ids else 0))

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
        if cfg.distill.lmbda > 0 and p is not None and p.fsdp:
            raise ConfigError("distill.lmbda > 0 samples the student on the generation engine, which runs whole "
                              "weights: on-policy distillation runs on one process or under DDP, not with "
                              "parallel.fsdp")

    def on_model(self, cfg: RunConfig, model: nn.Module) -> None:
        """The teacher is read and checked here, before any data work."""
        if cfg.distill.lmbda > 0 and (why := refusal(model)) is not None:
            raise ConfigError(f"distill.lmbda > 0 samples the student on the generation engine, which cannot run "
                              f"it: {why}")
        src = model_dir_of(cfg.distill.teacher, (), "teacher")
        teacher = load_pretrained(src, task=CAUSAL_LM, quantize=cfg.distill.teacher_quantize)
        check_teacher(teacher, model, str(src))
        self._teacher = teacher

    def extend(self, cfg: RunConfig, parts: RunParts) -> None:
        teacher = getattr(self, "_teacher", None)
        if teacher is None:
            raise KilnError("[distill]: the teacher was not read when the student was built")
        self._teacher = None
        evals = parts.eval_data
        run = DistillRun(cfg.distill, teacher, list(evals) if evals is not None else None,
                         bool(getattr(cfg.data, "pack", False)))
        parts.step = run.step
        parts.evaluate = run.evaluate if evals else None
        parts.callbacks.append(run)


RECIPE = Distill()
EXTENSION = DistillExtension()
