"""Several losses in one step: combine their gradients by sum, PCGrad, GradNorm or CAGrad.

A step function returns `{name: mean loss}` (e.g. `losses_step` for PrototypeModel's LM + prototype
objectives); the Trainer hands that dict to `GradientCombiner.backward`, which accumulates the
combined gradient into `.grad` of the trainable parameters. Choices:
- per-objective gradients are flattened over all trainable parameters (no model-specific "shared
  layer"); a parameter one objective does not touch has a zero there, which leaves dot products alone;
- `sum`: one backward of the summed losses (the plain multi-loss step);
- `pcgrad` (Yu et al. 2020): each g_i, visiting the others in a random order (seeded by seed + step so
  a resumed run repeats it), drops its component along any g_j it conflicts with (g_i . g_j < 0); sum;
- `gradnorm` (Chen et al. 2018): weights w_i (sum K) scale the gradients; after each step they move
  by lr * sign(w_i|g_i| - target_i) |g_i| with target_i = mean_j(w_j|g_j|) * r_i^alpha and r_i the
  loss ratio L_i/L_i(0) over its mean; norms are over all trainable parameters; state is checkpointed;
- `cagrad` (Liu et al. 2021): g0 = mean g_i, w on the simplex minimising w^T G g0 + c|g0| |G^T w|
  (exponentiated gradient, float64), d = g0 + c|g0| / |g_w| g_w, returned as d / (1 + c^2) as the paper's code does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kiln.errors import ConfigError, KilnError
from kiln.train.steps import sum_losses

METHODS = ("sum", "pcgrad", "gradnorm", "cagrad")


def losses_step(model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    """A Trainer step for models whose output carries `losses` (e.g. kiln.models.hpn.PrototypeModel)."""
    out = model(**batch)
    losses = getattr(out, "losses", None)
    if not losses:
        raise KilnError(f"{type(getattr(model, 'module', model)).__name__} returned no `losses` dict for this "
                        "batch; give the batch labels, or use a single-loss step")
    return losses


def pcgrad(grads: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """grads (K, P) -> (P,): the sum of each gradient with its conflicting components projected away."""
    out = grads.clone()
    sq = grads.pow(2).sum(1)  # (K,) |g_j|^2
    for i in range(grads.shape[0]):
        for j in torch.randperm(grads.shape[0], generator=generator).tolist():
            if j == i or sq[j] == 0:
                continue
            dot = out[i] @ grads[j]
            if dot < 0:
                out[i] -= dot / sq[j] * grads[j]
    return out.sum(0)


def cagrad(grads: torch.Tensor, c: float = 0.5, iters: int = 300) -> torch.Tensor:
    """grads (K, P) -> (P,): the conflict-averse direction (mean scale), rescaled by 1 / (1 + c^2)."""
    G = grads.double()
    K = G.shape[0]
    GG = G @ G.T  # (K, K)
    g0_norm = (GG.mean() + 1e-8).sqrt()  # |mean g_i|
    radius = c * g0_norm
    b = torch.full((K,), 1.0 / K, dtype=torch.float64)
    w = b.clone()
    for _ in range(iters):  # exponentiated gradient on the simplex; the objective is convex in w
        quad = (w @ GG @ w + 1e-8).sqrt()
        grad = GG @ b + radius * (GG @ w) / quad
        w = w * torch.exp(-grad / (grad.abs().max() + 1e-12))
        w = w / w.sum()
    gw = w @ G  # (P,)
    d = G.mean(0) + radius / (gw.norm() + 1e-8) * gw
    return (d / (1.0 + c ** 2)).to(grads.dtype)


class GradientCombiner:
    def __init__(self, method: str = "sum", *, seed: int = 0, cagrad_c: float = 0.5, gradnorm_alpha: float = 1.5,
                 gradnorm_lr: float = 0.025):
        if method not in METHODS:
            raise ConfigError(f"multi-objective method {method!r} is not one of: {', '.join(METHODS)}")
        self.method, self.seed = method, seed
        self.cagrad_c, self.alpha, self.gn_lr = cagrad_c, gradnorm_alpha, gradnorm_lr
        self.names: list[str] | None = None
        self.weights: torch.Tensor | None = None   # GradNorm's w_i
        self.initial: torch.Tensor | None = None   # GradNorm's L_i(0)

    def backward(self, losses: dict[str, torch.Tensor], params: list[nn.Parameter], step: int) -> torch.Tensor:
        """Accumulate the combined gradient into each param's .grad; returns the summed loss (detached)."""
        names = sorted(losses)
        if self.names is not None and names != self.names:
            raise KilnError(f"the step returned losses {names}, earlier steps returned {self.names}")
        self.names = names
        total = sum_losses(losses)
        if self.method == "sum":
            total.backward()
            return total.detach()
        params = [p for p in params if p.requires_grad]
        flat = []
        for i, n in enumerate(names):
            gs = torch.autograd.grad(losses[n], params, retain_graph=i < len(names) - 1, allow_unused=True)
            flat.append(torch.cat([(g if g is not None else torch.zeros_like(p)).reshape(-1) for g, p in zip(gs, params)]))
        grads = torch.stack(flat)  # (K, P)
        values = torch.stack([losses[n].detach().float() for n in names]).cpu()
        combined = self.combine(grads, values, step)
        offset = 0
        for p in params:
            g = combined[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
            p.grad = g.clone() if p.grad is None else p.grad.add_(g)
        return total.detach()

    def combine(self, grads: torch.Tensor, losses: torch.Tensor, step: int) -> torch.Tensor:
        """grads (K, P), losses (K,) -> the update direction (P,) by this combiner's method."""
        if self.method == "sum":
            return grads.sum(0)
        if self.method == "pcgrad":
            return pcgrad(grads, torch.Generator().manual_seed(self.seed * 1_000_003 + step))
        if self.method == "cagrad":
            return cagrad(grads, self.cagrad_c)
        return self._gradnorm(grads, losses)

    def _gradnorm(self, grads: torch.Tensor, losses: torch.Tensor) -> torch.Tensor:
        K = grads.shape[0]
        if self.weights is None or self.initial is None:
            self.weights, self.initial = torch.ones(K), losses.clone().clamp(min=1e-12)
        w = self.weights
        combined = (w.to(grads)[:, None] * grads).sum(0)
        norms = grads.norm(dim=1).float().cpu()  # (K,) |g_i|
        G = w * norms
        ratio = losses / self.initial
        target = G.mean() * (ratio / ratio.mean()) ** self.alpha
        w = (w - self.gn_lr * torch.sign(G - target) * norms).clamp(min=1e-4)
        self.weights = w * K / w.sum()  # the weights keep summing to K
        return combined

    def state_dict(self) -> dict[str, Any]:
        return {"method": self.method, "names": self.names,
                "weights": None if self.weights is None else self.weights.tolist(),
                "initial": None if self.initial is None else self.initial.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["method"] != self.method:
            raise KilnError(f"the checkpoint combined objectives by {state['method']!r}, this run by {self.method!r}")
        self.names = state["names"]
        self.weights = None if state["weights"] is None else torch.tensor(state["weights"])
        self.initial = None if state["initial"] is None else torch.tensor(state["initial"])
