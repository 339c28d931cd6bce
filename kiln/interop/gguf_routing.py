"""Routing near-ties for verify-export's greedy check of a mixture-of-experts GGUF.

A top-k router picks experts by comparing scores; where the k-th and (k+1)-th scores at some position are closer
than the type's rounding can move them, llama.cpp (f16 / bf16 activations) may run the other expert there, and the
greedy sequences can then part at a token whose margin is far wider than the rounding of one forward explains. Such
a parting is called a routing tie only when it is explained, not merely possible: kiln's own model is run again with
one near-tie flipped (the (k+1)-th expert in place of the k-th, at one layer and one position at or before the
parting step), and the flipped run must give llama.cpp's token, or leave the two tokens within the rounding error.
A model without top-k routers (every dense family) has no near-ties, so its check is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from kiln.models.common.moe import Router
from kiln.models.pretrained import PreTrainedModel

MAX_FLIPS = 16  # near-ties tried, closest first (each is one forward of kiln's model)


@dataclass(frozen=True)
class NearTie:
    router: int       # the index of the router among the model's Router modules (layer order)
    position: int     # the token position whose k-th and (k+1)-th experts are near-tied
    margin: float     # the router-logit margin between them
    explained: float  # the router-logit error the type's rounding explains at that position


def _routers(model: PreTrainedModel) -> list[Router]:
    return [m for m in model.modules() if isinstance(m, Router)]


def near_ties(model: PreTrainedModel, ids: list[int], error_of) -> list[NearTie]:
    """Every (router, position) of the sequence `ids` whose k-th and (k+1)-th router logits are within
    `error_of(logits)` (the rounding error estimate for a (T, E) array of router logits), closest first."""
    routers = _routers(model)
    if not routers:
        return []
    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda mod, args, out: seen.append(out[0].detach().double())) for r in routers]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    ties = []
    for i, (router, logits) in enumerate(zip(routers, seen)):
        k = router.top_k
        if k >= logits.size(-1):
            continue  # every expert runs: nothing to flip
        top = logits.topk(k + 1, dim=-1).values.numpy()  # (T, k+1), descending
        margin = top[:, k - 1] - top[:, k]
        explained = np.asarray(error_of(logits.numpy()), dtype=np.float64) * np.ones_like(margin)
        ties += [NearTie(i, int(p), float(margin[p]), float(explained[p])) for p in np.flatnonzero(margin <= explained)]
    return sorted(ties, key=lambda t: t.margin / max(t.explained, 1e-30))


def flipped_logits(model: PreTrainedModel, ids: list[int], tie: NearTie) -> np.ndarray:
    """kiln's last-position logits for `ids` with the near-tie flipped: at that router and position the (k+1)-th
    expert runs instead of the k-th, with the routing weights taken from the same softmax (renormalised where
    the router renormalises)."""
    router = _routers(model)[tie.router]

    def flip(mod: Router, args, out):
        logits = out[0]
        probs = F.softmax(logits, dtype=torch.float, dim=-1)
        order = probs.argsort(dim=-1, descending=True)
        index = order[:, : mod.top_k].clone()
        index[tie.position, mod.top_k - 1] = order[tie.position, mod.top_k]
        top = probs.gather(-1, index)
        if mod.norm_topk_prob:
            top = top / top.sum(dim=-1, keepdim=True)
        return logits, top.to(logits.dtype), index

    hook = router.register_forward_hook(flip)
    try:
        with torch.no_grad():
            return model(input_ids=torch.tensor([ids])).logits[0, -1].double().numpy()
    finally:
        hook.remove()


def explain_by_routing(model: PreTrainedModel, ids: list[int], ours: int, theirs: int, token_error: float,
                       router_error_of) -> str | None:
    """Why kiln's greedy token `ours` and llama.cpp's `theirs` after `ids` may differ by routing alone: the first
    near-tie (closest first, at most MAX_FLIPS tried) whose flip makes kiln's margin ours - theirs at most
    `token_error` (so llama.cpp's token, or a rounding tie with it). None when no near-tie explains it."""
    ties = near_ties(model, ids, router_error_of)
    for tie in ties[:MAX_FLIPS]:
        logits = flipped_logits(model, ids, tie)
        margin = float(logits[ours] - logits[theirs])
        if margin <= token_error:
            return (f"routing tie: router {tie.router} at position {tie.position} has its top-k edge experts "
                    f"{tie.margin:.2g} apart in router logit (rounding explains {tie.explained:.2g}); with them "
                    f"swapped kiln's margin becomes {margin:.3g}")
    return None
