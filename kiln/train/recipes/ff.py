"""[ff]: Forward-Forward updates of the Mamba skip vectors D between backprop steps (pre-training).

The rule is the seed research trainer's (neuromamba/rust_trainer: `ff_goodness_activation`,
`ff_loss_pair`, `ff_grad_theta`, `GenericTrainer::train_step`, the surgery of `loss.rs`), on kiln's Mamba:

- capture: what enters each layer's convolution, x (B, T, I) = the u half of `in_proj`'s output (D's
  width); positive summary p = mean over batch and time of x, negative summary n = mean of
  x[(t + 1) mod T] * s(t, d), where s = +1 when (t + d) is even, else -1;
- goodness g(h) = sum_i (h_i / (std(h) + 1e-5)) * (D_i / (|D| + 1e-5)), std the population std;
  ff_loss = max(0, 1 - (g(p) - g(n)));
- gradient (the seed's closed form): -(p / s_p - n / s_n) / (|D| + 1e-5) where the hinge is active,
  else 0. It is the gradient of ff_loss with |D| held constant (the radial term of d|D|/dD is left out);
- every step that is not a backprop step (all but every `bp_cadence_steps`-th) is an FF step only:
  D -= ff_lr * gradient, by plain SGD, no optimizer step, no other weight moves; its batches are drawn
  as usual, so the data cursor advances every step (`FFEngine`, wrapping the run's own engine);
- on a backprop step each D's gradient becomes bp + (ff_lr / lr) * surgery(ff, bp) (lr: this step's
  scheduled rate; 1 where it is ~0), one-sided: only the FF gradient is changed. `pcgrad` projects ff
  off bp when they conflict (dot < 0), `cagradstep` removes lambda times that projection, `gradnorm`
  scales ff by exp(alpha * |ff/|ff| - bp/|bp||). `conflict_layers` counts layers with dot(ff, bp) < 0;
- `d_init = "normal"`: a from-scratch model's D start at N(0, 0.02) and, with [grow], the grown layers'
  D at zero, as the seed initialises them (the default "model" keeps the family's init: D = 1).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from pydantic import field_validator, model_validator
from torch import nn

from kiln.data.loader import batch_tokens
from kiln.errors import ConfigError
from kiln.models.mamba import MambaMixer
from kiln.train.config import NonNegative, RunConfig, Section
from kiln.train.engine import StepContext, StepEngine, StepOutcome
from kiln.train.recipes.base import Extension, RunParts, Shortcut
from kiln.train.steps import as_sum_and_count, sum_losses
from kiln.train.trainer import Callback, Trainer

GOODNESS_EPS = 1e-5   # the seed's: added to the population std of h and to |D|
D_INIT_STD = 0.02     # the seed's random init of every parameter, D included


class FFSection(Section):
    """Forward-Forward updates of Mamba's D between backprop steps (present = on); defaults are the seed's."""
    ff_lr: NonNegative = 1e-4                 # SGD step of the local FF update
    bp_cadence_steps: int = 32          # every N-th step is a full backprop step (1: every step)
    surgery: Literal["pcgrad", "gradnorm", "cagradstep"] = "pcgrad"  # changes the FF gradient of D on bp steps
    epsilon: NonNegative = 1e-8               # surgery: added to |bp|^2 and to the norms
    gradnorm_alpha: NonNegative = 0.2         # gradnorm: ff scaled by exp(alpha * disagreement)
    cagrad_lambda: NonNegative = 1.0          # cagradstep: how much of the conflicting projection is removed
    d_init: Literal["model", "normal"] = "model"  # normal: D ~ N(0, 0.02) from scratch, grown layers' D = 0

    @field_validator("surgery", mode="before")
    @classmethod
    def _alias(cls, value: Any) -> Any:
        return "cagradstep" if value == "cagrad" else value  # the seed's parser takes both spellings

    @model_validator(mode="after")
    def _check(self) -> FFSection:
        if self.bp_cadence_steps < 1:
            raise ValueError(f"ff.bp_cadence_steps must be >= 1, got {self.bp_cadence_steps}")
        for name in ("ff_lr", "epsilon", "gradnorm_alpha", "cagrad_lambda"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"ff.{name} must be >= 0, got {getattr(self, name)}")
        return self


def summaries(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums over (batch, time) of x (B, T, I) and of its negative x[(t + 1) mod T] * (+1 if t + d even else -1)."""
    _, T, I = x.shape
    t, d = torch.arange(T, device=x.device), torch.arange(I, device=x.device)
    sign = 1.0 - 2.0 * ((t[:, None] + d[None, :]) % 2).to(x.dtype)                     # (T, I)
    return x.sum((0, 1)), (torch.roll(x, -1, dims=1) * sign).sum((0, 1))                # roll -1: x[(t+1) % T]


def goodness(h: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """sum_i (h_i / (std(h) + 1e-5)) * (D_i / (|D| + 1e-5)), std the population std (the seed's goodness)."""
    return (h / (h.std(correction=0) + GOODNESS_EPS) * (D / (D.norm() + GOODNESS_EPS))).sum()


def ff_loss_and_grad(D: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The hinge max(0, 1 - (g(pos) - g(neg))) and the seed's closed-form gradient with respect to D (fp32)."""
    D, pos, neg = D.detach().float(), pos.float(), neg.float()
    loss = max(0.0, 1.0 - float(goodness(pos, D) - goodness(neg, D)))
    if loss <= 0.0:
        return 0.0, torch.zeros_like(D)
    sp, sn = pos.std(correction=0) + GOODNESS_EPS, neg.std(correction=0) + GOODNESS_EPS
    return loss, -(pos / sp - neg / sn) / (D.norm() + GOODNESS_EPS)


def surgery(ff: torch.Tensor, bp: torch.Tensor, cfg: FFSection) -> torch.Tensor:
    """The FF gradient of one D after the seed's one-sided surgery against its backprop gradient."""
    ff, bp = ff.float(), bp.float()
    dot = torch.dot(ff, bp)
    if cfg.surgery == "gradnorm":
        ff_norm, bp_norm = ff.norm() + cfg.epsilon, bp.norm() + cfg.epsilon
        return ff * torch.exp(cfg.gradnorm_alpha * (ff / ff_norm - bp / bp_norm).norm())
    if dot >= 0:  # pcgrad and cagradstep leave an FF gradient alone unless it points against bp
        return ff
    weight = 1.0 if cfg.surgery == "pcgrad" else cfg.cagrad_lambda
    return ff - bp * (weight * dot / (torch.dot(bp, bp) + cfg.epsilon))


class FFCallback(Callback):
    """Captures each Mamba layer's conv input, computes the FF gradients, and combines them on backprop steps."""

    def __init__(self, cfg: FFSection, growth: tuple[int, list[int]] | None = None):
        self.cfg = cfg
        self.growth = growth                 # (at_step, new layer slots) to zero the grown D (d_init = normal)
        self.sums: dict[nn.Module, list] = {}  # in_proj -> [pos sum, neg sum, count] of this step
        self.capturing = False
        self.ff_grads: list[tuple[MambaMixer, float, torch.Tensor]] | None = None  # a backprop step's
        self.record: dict[str, Any] = {}

    def on_setup(self, trainer: Trainer, step: int) -> None:
        if trainer.world.active:
            raise ConfigError("[ff] runs on one process (its local updates are not synchronised across ranks)")
        if not self.mixers(trainer.unwrapped()):
            raise ConfigError(f"[ff] updates the skip vectors D of Mamba layers; {type(trainer.unwrapped()).__name__} "
                              "has none")

    def mixers(self, model: nn.Module) -> list[MambaMixer]:
        """The model's Mamba mixers now (growth adds some), each with the capture hook on its in_proj."""
        found = [m for m in model.modules() if isinstance(m, MambaMixer)]
        for m in found:
            # A plain function (not a bound method): a layer deep-copied by growth shares it, and it keys the
            # sums by the module it is called on, so a copy's capture never lands in its template's slot.
            if not any(getattr(h, "_kiln_ff", False) for h in m.in_proj._forward_hooks.values()):
                def hook(module: nn.Module, _args: Any, out: torch.Tensor, ff: FFCallback = self) -> None:
                    ff._capture(module, out)
                hook._kiln_ff = True  # type: ignore[attr-defined]  # the marker the check above reads
                m.in_proj.register_forward_hook(hook)
        return found

    def _capture(self, in_proj: nn.Module, out: torch.Tensor) -> None:
        """in_proj's output (B, T, 2I): its first half is what enters the conv; add its summaries."""
        if not self.capturing:
            return
        with torch.no_grad():
            x = out.detach()[..., : out.shape[-1] // 2].float()
            pos, neg = summaries(x)
            acc = self.sums.setdefault(in_proj, [0.0, 0.0, 0])
            acc[0], acc[1], acc[2] = acc[0] + pos, acc[1] + neg, acc[2] + x.shape[0] * x.shape[1]

    def start(self, model: nn.Module, step: int) -> list[MambaMixer]:
        mixers = self.mixers(model)
        if self.growth is not None and step == self.growth[0]:
            # [grow] added its layers after step at_step (Growth.maybe_grow): their D start at 0, as the seed's
            # grown layers do. Stateless: a run resumed at this step zeroes them here too.
            from kiln.train.freeze import find_layers

            _, stack = find_layers(model)
            with torch.no_grad():
                for i in self.growth[1]:
                    for m in stack[i].modules():
                        if isinstance(m, MambaMixer):
                            m.D.zero_()
        self.sums, self.capturing, self.ff_grads, self.record = {}, True, None, {}
        return mixers

    def finish(self, mixers: list[MambaMixer]) -> list[tuple[MambaMixer, float, torch.Tensor]]:
        """(mixer, ff_loss, FF gradient of D) for each trainable D seen this step; ff_loss / ff_updates recorded."""
        out = []
        for m in mixers:
            if not m.D.requires_grad or m.in_proj not in self.sums:
                continue  # frozen, as the seed's frozen layers, get no FF update
            pos, neg, n = self.sums[m.in_proj]
            loss, grad = ff_loss_and_grad(m.D, pos / n, neg / n)
            out.append((m, loss, grad.to(m.D.device)))
        self.sums, self.capturing = {}, False
        self.record = {"ff_loss": sum(x[1] for x in out) / max(len(out), 1),
                       "ff_updates": sum(1 for x in out if x[1] > 0)}
        return out

    def wrap_engine(self, trainer: Trainer, engine: StepEngine) -> StepEngine:
        return FFEngine(engine, self)

    def before_update(self, trainer: Trainer) -> None:
        grads = self.ff_grads
        if grads is None:
            return
        conflicts = 0
        for mixer, _, g_ff in grads:
            g_bp = mixer.D.grad if mixer.D.grad is not None else torch.zeros_like(mixer.D)
            lr = next(g["lr"] for g in trainer.optimizer.param_groups if any(p is mixer.D for p in g["params"]))
            scale = self.cfg.ff_lr / lr if abs(lr) > 1e-12 else 1.0  # the seed's guard for a zero rate
            conflicts += int(torch.dot(g_ff.float(), g_bp.float().flatten()) < 0)
            mixer.D.grad = (g_bp.float() + scale * surgery(g_ff, g_bp.flatten(), self.cfg)).to(mixer.D.dtype)
        self.record["conflict_layers"] = conflicts

    def on_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        record.update(self.record)
        self.record, self.ff_grads = {}, None


class FFEngine(StepEngine):
    """Every `bp_cadence_steps`-th step is the wrapped engine's backprop step; the others are FF local steps."""

    def __init__(self, inner: StepEngine, ff: FFCallback):
        self.inner, self.ff = inner, ff
        self.keep_grads = inner.keep_grads

    def gradients(self, run: StepContext) -> StepOutcome:
        ff = self.ff
        mixers = ff.start(run.model, run.step)
        if (run.step + 1) % ff.cfg.bp_cadence_steps == 0:
            out = self.inner.gradients(run)   # its forward passes fill the summaries at the current D
            ff.ff_grads = ff.finish(mixers)   # combined with the backprop gradients in before_update
            return out
        loss_sum, count, tokens = 0.0, 0.0, 0
        with torch.no_grad():
            for _ in range(run.args.grad_accum):
                batch = run.next_batch()
                tokens += batch_tokens(batch, run.loader)
                with run.autocast():
                    result = run.step_fn(run.model, batch)
                if isinstance(result, dict):
                    result = sum_losses(result)
                part, n = as_sum_and_count(result, batch)
                loss_sum, count = loss_sum + float(part), count + float(n)
        grads = ff.finish(mixers)
        with torch.no_grad():  # the FF rule is plain SGD on D: no optimizer step, no other weight moves
            for mixer, _, grad in grads:
                mixer.D.sub_(ff.cfg.ff_lr * grad.to(mixer.D.dtype))
        norm = math.sqrt(sum(float(g.float().pow(2).sum()) for _, _, g in grads))
        return StepOutcome(loss_sum / max(count, 1.0), tokens, run.args.batch_size * run.args.grad_accum,
                           update=False, grad_norm=norm, lr=ff.cfg.ff_lr)

    def clip(self, run: StepContext, max_norm: float) -> float:
        return self.inner.clip(run, max_norm)

    def state_dict(self, run: StepContext) -> dict[str, Any] | None:
        return self.inner.state_dict(run)

    def load_state_dict(self, run: StepContext, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(run, state)


def init_d_normal(model: nn.Module, seed: int) -> None:
    """D of every Mamba layer ~ N(0, 0.02), from a generator of its own (the run's RNG stream is left alone)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MambaMixer):
                m.D.copy_(torch.randn(m.D.shape, generator=gen) * D_INIT_STD)


class FF(Extension[FFSection]):
    section = "ff"
    schema = FFSection
    summary = "Forward-Forward updates of Mamba's D between backprop steps, one-sided surgery on backprop steps"
    recipes = ("pretrain",)
    shortcuts = (Shortcut("ff_lr", "ff.ff_lr"), Shortcut("bp_cadence_steps", "ff.bp_cadence_steps"),
                 Shortcut("gradient_surgery_method", "ff.surgery"))

    def on_model(self, cfg: RunConfig, model: nn.Module) -> None:
        if not any(isinstance(m, MambaMixer) for m in model.modules()):
            raise ConfigError(f"[ff] updates the skip vectors D of Mamba layers; a {cfg.model.family or 'loaded'} "
                              "model has none")
        if self.table(cfg).d_init == "normal":
            if cfg.model.path is not None:
                raise ConfigError(f"ff.d_init = 'normal' initialises a from-scratch model's D; model.path "
                                  f"({cfg.model.path}) loads trained ones: drop ff.d_init or use model.family")
            init_d_normal(model, cfg.model.init_seed)

    def extend(self, cfg: RunConfig, parts: RunParts) -> None:
        from kiln.train.recipes.grow import EXTENSION as GROW

        ff, growth = self.table(cfg), None
        if ff.d_init == "normal" and getattr(cfg, GROW.section, None) is not None:
            from kiln.train.freeze import find_layers
            from kiln.train.grow import new_layer_slots

            grow, base = GROW.table(cfg), len(find_layers(parts.model)[1])
            growth = (grow.at_step, new_layer_slots(grow.placement, base, grow.target_layers))
        parts.callbacks.append(FFCallback(ff, growth))


EXTENSION = FF()
