"""[ff]: Forward-Forward updates of the Mamba skip vectors D between backprop steps (pre-training).

Every step, each trainable Mamba layer's D (one weight per channel, (I,)) gets a local update from a
goodness contrast over the layer's SSM input u (B, T, I):
  positive summary  p = mean over batch and time of u;
  negative summary  n = mean over batch and time of u shifted one step later in time (zero at t=0),
                        times (-1)^(t + d) (the sign alternates over time and channel);
  goodness g(h)     = <h / std(h), D / |D|>;   ff_loss = max(0, 1 - (g(p) - g(n))).
A step that is not a backprop step (all but every `bp_cadence_steps`-th) is only that: D -= ff_lr *
d ff_loss / dD, by plain SGD, no optimizer step, no other weight moves; its batches are drawn from the
loader as usual, so the data cursor advances every step (`FFEngine`, wrapping the run's own engine;
its record's grad_norm is the norm of the FF gradients over all D, its lr is ff_lr). On a backprop step the FF gradient of each D,
scaled by ff_lr / lr, is combined with the backprop gradient by gradient surgery (`surgery`: sum,
pcgrad, gradnorm, cagrad) before clipping and the optimizer step; `conflict_layers` counts the layers
whose two gradients point against each other. How this differs from plain backprop: D also moves on
the FF steps (and only D moves there), and on backprop steps D follows the surgered direction.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from pydantic import model_validator
from torch import nn

from kiln.data.loader import batch_tokens
from kiln.errors import ConfigError
from kiln.models.mamba import MambaMixer
from kiln.train.config import Section
from kiln.train.multiobjective import cagrad, pcgrad
from kiln.train.recipes.base import Extension, RunParts
from kiln.train.engine import StepContext, StepEngine, StepOutcome
from kiln.train.steps import as_sum_and_count
from kiln.train.trainer import Callback, Trainer


class FFSection(Section):
    """Forward-Forward updates of Mamba's D between backprop steps (present = on)."""
    ff_lr: float = 1e-3                 # SGD step of the local FF update
    bp_cadence_steps: int = 4           # every N-th step is a full backprop step (1: every step)
    surgery: Literal["sum", "pcgrad", "gradnorm", "cagrad"] = "pcgrad"  # FF vs backprop gradient of D
    epsilon: float = 1e-8               # keeps the std / norm divisions finite
    gradnorm_alpha: float = 1.0         # gradnorm: how hard both gradients are pulled to their mean norm
    cagrad_lambda: float = 0.5          # cagrad: how far the update may leave the mean gradient

    @model_validator(mode="after")
    def _check(self) -> "FFSection":
        if self.bp_cadence_steps < 1:
            raise ValueError(f"ff.bp_cadence_steps must be >= 1, got {self.bp_cadence_steps}")
        for name in ("ff_lr", "epsilon", "gradnorm_alpha", "cagrad_lambda"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"ff.{name} must be >= 0, got {getattr(self, name)}")
        return self


def summaries(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sums over (batch, time) of u (B, T, I) and of its shifted, sign-alternated copy: (I,), (I,)."""
    B, T, I = u.shape
    shifted = torch.cat([u.new_zeros(B, 1, I), u[:, :-1]], dim=1)                      # u[t-1], 0 at t = 0
    t, d = torch.arange(T, device=u.device), torch.arange(I, device=u.device)
    sign = 1.0 - 2.0 * ((t[:, None] + d[None, :]) % 2).to(u.dtype)                     # (-1)^(t + d), (T, I)
    return u.sum((0, 1)), (shifted * sign).sum((0, 1))


def ff_loss_and_grad(D: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, eps: float) -> tuple[float, torch.Tensor]:
    """ff_loss = max(0, 1 - (g(pos) - g(neg))) and its gradient with respect to D (fp32)."""
    d = D.detach().float().requires_grad_(True)
    unit = d / (d.norm() + eps)

    def goodness(h: torch.Tensor) -> torch.Tensor:
        return (h / (h.std() + eps) * unit).sum()

    loss = torch.relu(1.0 - (goodness(pos.float()) - goodness(neg.float())))
    (grad,) = torch.autograd.grad(loss, d)
    return float(loss.detach()), grad


def surgery(g_bp: torch.Tensor, g_ff: torch.Tensor, method: str, cfg: FFSection, step: int) -> torch.Tensor:
    """One update direction from the backprop and (scaled) FF gradients of one D."""
    grads = torch.stack([g_bp.float(), g_ff.float()])                                # (2, I)
    if method == "sum":
        return grads.sum(0)
    if method == "pcgrad":
        return pcgrad(grads, torch.Generator().manual_seed(step))
    if method == "cagrad":
        return cagrad(grads, cfg.cagrad_lambda) * 2  # cagrad's direction is mean-scaled; the others add up
    norms = grads.norm(dim=1)  # gradnorm, stateless: each gradient pulled toward the mean norm
    weights = (norms.mean() / (norms + cfg.epsilon)) ** cfg.gradnorm_alpha
    return (weights[:, None] * grads).sum(0)


class FFCallback(Callback):
    def __init__(self, cfg: FFSection):
        self.cfg = cfg
        self.mixers: list[MambaMixer] = []
        self.sums: dict[int, list] = {}       # mixer index -> [pos sum, neg sum, count]
        self.capturing = False
        self.conflicts: int | None = None

    def on_setup(self, trainer: Trainer, step: int) -> None:
        if trainer.world.active:
            raise ConfigError("[ff] runs on one process (its local updates are not synchronised across ranks)")
        self.mixers = [m for m in trainer.unwrapped().modules() if isinstance(m, MambaMixer)]
        if not self.mixers:
            raise ConfigError(f"[ff] updates the skip vectors D of Mamba layers; {type(trainer.unwrapped()).__name__} "
                              "has none")
        for i, mixer in enumerate(self.mixers):
            mixer.x_proj.register_forward_pre_hook(lambda _m, args, i=i: self._capture(i, args[0]))

    def _capture(self, i: int, u: torch.Tensor) -> None:
        """x_proj's input is the SSM input u (B, T, I): add its summaries for this step."""
        if not self.capturing:
            return
        with torch.no_grad():
            pos, neg = summaries(u.detach().float())
            acc = self.sums.setdefault(i, [0.0, 0.0, 0])
            acc[0], acc[1], acc[2] = acc[0] + pos, acc[1] + neg, acc[2] + u.shape[0] * u.shape[1]

    def _ff_grads(self) -> list[tuple[MambaMixer, float, torch.Tensor]]:
        """(mixer, ff_loss, FF gradient of D) for each trainable D seen this step."""
        out = []
        for i, mixer in enumerate(self.mixers):
            if not mixer.D.requires_grad or i not in self.sums:
                continue
            pos, neg, n = self.sums[i]
            loss, grad = ff_loss_and_grad(mixer.D, pos / n, neg / n, self.cfg.epsilon)
            out.append((mixer, loss, grad))
        self.sums, self.capturing = {}, False
        return out

    def wrap_engine(self, trainer: Trainer, engine: StepEngine) -> StepEngine:
        return FFEngine(engine, self)

    def before_update(self, trainer: Trainer) -> None:
        grads = self._ff_grads()
        lr = trainer.args.lr  # the base lr: the schedule moves both sides alike
        conflicts = 0
        for mixer, _, g_ff in grads:
            g_bp = mixer.D.grad if mixer.D.grad is not None else torch.zeros_like(mixer.D)
            scaled = g_ff.to(g_bp.device) * (self.cfg.ff_lr / lr)
            conflicts += int(torch.dot(g_bp.float().flatten(), scaled.flatten()) < 0)
            mixer.D.grad = surgery(g_bp, scaled, self.cfg.surgery, self.cfg, trainer.step).to(mixer.D.dtype)
        self.conflicts = conflicts

    def on_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.conflicts is not None:
            record["conflict_layers"] = self.conflicts
            self.conflicts = None


class FFEngine(StepEngine):
    """Every `bp_cadence_steps`-th step is the wrapped engine's backprop step; the others are FF local steps."""

    def __init__(self, inner: StepEngine, ff: FFCallback):
        self.inner, self.ff = inner, ff
        self.keep_grads = inner.keep_grads

    def gradients(self, run: StepContext) -> StepOutcome:
        ff = self.ff
        ff.capturing, ff.sums, ff.conflicts = True, {}, None
        if (run.step + 1) % ff.cfg.bp_cadence_steps == 0:
            return self.inner.gradients(run)  # the hooks gather this step's summaries for before_update
        loss_sum, count, tokens = 0.0, 0.0, 0
        with torch.no_grad():
            for _ in range(run.args.grad_accum):
                batch = run.next_batch()
                tokens += batch_tokens(batch, run.loader)
                with run.autocast():
                    result = run.step_fn(run.model, batch)
                if isinstance(result, dict):
                    result = sum(result[k] for k in sorted(result))
                part, n = as_sum_and_count(result, batch)
                loss_sum, count = loss_sum + float(part), count + float(n)
        grads = ff._ff_grads()
        with torch.no_grad():  # the FF rule is plain SGD on D: no optimizer step, no other weight moves
            for mixer, _, grad in grads:
                mixer.D.sub_(ff.cfg.ff_lr * grad.to(mixer.D.dtype))
        ff_loss = sum(loss for _, loss, _ in grads) / max(len(grads), 1)
        norm = float(torch.stack([g.norm() for _, _, g in grads]).norm()) if grads else 0.0
        return StepOutcome(loss_sum / max(count, 1.0), tokens, run.args.batch_size * run.args.grad_accum,
                           update=False, grad_norm=norm, lr=ff.cfg.ff_lr, extra={"ff_loss": ff_loss})

    def clip(self, run: StepContext, max_norm: float) -> float:
        return self.inner.clip(run, max_norm)

    def state_dict(self, run: StepContext) -> dict[str, Any] | None:
        return self.inner.state_dict(run)

    def load_state_dict(self, run: StepContext, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(run, state)


class FF(Extension):
    section = "ff"
    schema = FFSection
    summary = "Forward-Forward updates of Mamba's D between backprop steps, surgery on backprop steps"
    recipes = ("pretrain",)

    def on_model(self, cfg: Any, model: nn.Module) -> None:
        if not any(isinstance(m, MambaMixer) for m in model.modules()):
            raise ConfigError(f"[ff] updates the skip vectors D of Mamba layers; a {cfg.model.family or 'loaded'} "
                              "model has none")

    def extend(self, cfg: Any, parts: RunParts) -> None:
        parts.callbacks.append(FFCallback(cfg.ff))


EXTENSION = FF()
