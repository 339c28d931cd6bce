"""Hyperspherical prototype head (Mettes et al., NeurIPS 2019, "Hyperspherical Prototype Networks").

Choices:
- outputs: logits = scale * cos(normalise(W h), normalise(p_k)) for every class/vocab item k, where W is
  a bias-free projection hidden -> proto_dim and p_k one prototype per class (a (K, proto_dim) matrix);
- prototypes: `fixed` (a buffer, spread over the sphere before training and never updated) or
  `learnable` (a parameter starting from the same spread);
- spreading: projected gradient descent (momentum SGD, renormalise each step) on the mean over
  prototypes of a soft maximum (temperature annealed 0.1 -> 0.01) of each one's cosines to the
  others, which reaches the regular simplex (min angle arccos(-1/(K-1))) whenever K <= proto_dim + 1;
  row blocks keep memory at (block, K), so vocabulary-sized K fits;
- loss: `ce` = cross entropy over the scaled cosines; `cosine` = mean squared cosine distance
  (1 - cos(z, p_target))^2, the paper's loss. Targets equal to `ignore_index` are left out of both.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from kiln.constants import IGNORE_INDEX
from kiln.errors import ConfigError

PROTOTYPE_MODES = ("fixed", "learnable")
LOSSES = ("ce", "cosine")


@torch.no_grad()
def spread_prototypes(num: int, dim: int, steps: int = 300, lr: float = 0.1, momentum: float = 0.9, seed: int = 0,
                      block: int = 2048) -> torch.Tensor:
    """(num, dim) float32 unit vectors pushed apart on the sphere; `steps=0` leaves them random."""
    if num < 2 or dim < 2:
        raise ConfigError(f"prototypes need at least 2 classes and 2 dimensions, got {num} x {dim}")
    g = torch.Generator().manual_seed(seed)
    P = F.normalize(torch.randn(num, dim, generator=g, dtype=torch.float64), dim=1)  # (K, D)
    velocity = torch.zeros_like(P)
    for s in range(steps):
        temp = 0.1 * 0.1 ** (s / max(1, steps - 1))  # soft max sharpens towards the true max
        grad = torch.zeros_like(P)
        for i in range(0, num, block):
            rows = P[i:i + block]  # (b, D)
            cos = rows @ P.T  # (b, K)
            cos[torch.arange(rows.shape[0]), torch.arange(i, i + rows.shape[0])] = -math.inf  # not itself
            w = torch.softmax(cos / temp, dim=1)  # d softmax-max / d cos
            grad[i:i + block] += w @ P  # through p_i in cos(p_i, p_j)
            grad += w.T @ rows  # through p_j
        velocity = momentum * velocity + grad / num
        P = F.normalize(P - lr * velocity, dim=1)
    return P.float()


def min_pairwise_angle(prototypes: torch.Tensor) -> float:
    """The smallest angle (degrees) between any two rows."""
    P = F.normalize(prototypes.double(), dim=1)
    cos = P @ P.T
    cos.fill_diagonal_(-1.0)
    return math.degrees(math.acos(float(cos.max().clamp(-1.0, 1.0))))


def simplex_angle(num: int) -> float:
    """The best possible min angle for `num` <= dim + 1 points: the regular simplex."""
    return math.degrees(math.acos(-1.0 / (num - 1)))


class PrototypeHead(nn.Module):
    """hidden (..., dim) -> scaled cosines (..., K) against K prototypes; `loss` for either objective."""

    def __init__(self, dim: int, num_classes: int, proto_dim: int | None = None, scale: float = 10.0,
                 mode: str = "fixed", loss: str = "ce", spread_steps: int = 300, seed: int = 0):
        super().__init__()
        if mode not in PROTOTYPE_MODES:
            raise ConfigError(f"prototype mode {mode!r} is not one of: {', '.join(PROTOTYPE_MODES)}")
        if loss not in LOSSES:
            raise ConfigError(f"prototype loss {loss!r} is not one of: {', '.join(LOSSES)}")
        if scale <= 0:
            raise ConfigError(f"prototype scale must be > 0, got {scale}")
        proto_dim = proto_dim or dim
        self.proj = nn.Linear(dim, proto_dim, bias=False)
        protos = spread_prototypes(num_classes, proto_dim, steps=spread_steps, seed=seed)  # (K, P)
        if mode == "fixed":
            self.register_buffer("prototypes", protos)  # saved with the model, never trained
        else:
            self.prototypes = nn.Parameter(protos)
        self.scale, self.mode, self.loss_kind = float(scale), mode, loss

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        z = F.normalize(self.proj(hidden), dim=-1)  # (..., P) on the unit sphere
        p = F.normalize(self.prototypes, dim=-1)  # (K, P); learnable rows drift off the sphere, so renormalise
        return self.scale * (z @ p.T)  # (..., K)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
        """logits (..., K) from forward, labels (...) class ids -> the mean loss over kept targets."""
        logits, labels = logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1)
        if self.loss_kind == "ce":
            return F.cross_entropy(logits, labels, ignore_index=ignore_index)
        keep = labels != ignore_index
        cos = logits[keep].gather(1, labels[keep, None])[:, 0] / self.scale  # (n,) cosine to the target
        return ((1.0 - cos) ** 2).mean()

    def extra_repr(self) -> str:
        K, P = self.prototypes.shape
        return f"classes={K}, proto_dim={P}, scale={self.scale}, mode={self.mode}, loss={self.loss_kind}"
