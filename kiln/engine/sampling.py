"""One decode step's token choice for a batch of sequences, each with its own SamplingParams and generator.

The order is Hugging Face's: penalties on the raw logits (repetition over prompt + output tokens, HF's rule;
presence / frequency over output tokens, OpenAI's rule), then temperature (0 = greedy argmax), top-k, top-p
over the top-k survivors renormalized, min-p relative to the highest probability, and one draw from what is
left. Log-probs are log_softmax of the raw float32 logits (before penalties and temperature): what the training
forward computes and what RL compares.

Batch invariance: row b's token and log-probs depend only on row b's logits, params, ids and generator, never
on the other rows or on B. Every op here is either exact elementwise arithmetic (sub, div, compare, where),
a kernel that treats each row alone (softmax, log_softmax, topk, sort, cumsum and sums along the last dim), or
an index op; a row draws exactly one uniform number from its own generator per sampled step; and the
candidate list a row's top-k / top-p is read from is fixed by that row alone, in a canonical order.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch

from kiln.engine.params import MAX_TOP_LOGPROBS, SamplingParams
from kiln.errors import KilnError

# top-k / top-p read the sorted head of the distribution: a row sorts its tokens of probability >= e^-10 times
# its highest, then >= e^-20 times, and all of them only when its cut is not decided inside those (a flat
# distribution, a big top_k, top_p within ~1e-4 of 1)
CANDIDATES = (4.5399929762484854e-05, 2.061153622438558e-09)  # e^-10, e^-20
BLOCK = 1024  # the full-vocabulary draw's first level: blocks of this many entries


@dataclass
class SampleOut:
    tokens: torch.Tensor        # (B,) long
    logprobs: torch.Tensor      # (B,) float32: log_softmax(raw logits)[token]; NaN where params.logprobs is off
    top_ids: torch.Tensor       # (B, K) long, K = the batch's largest top_logprobs; -1 past a row's own count
    top_logprobs: torch.Tensor  # (B, K) float32, most likely first; NaN past a row's own count


def request_generator(seed: int | None, index: int, device: torch.device | str) -> torch.Generator:
    """The generator of completion `index` of a request: a stream fixed by (seed, index), distinct for each
    index. seed None: a seed drawn once from torch's default generator, so the run's global seed decides it."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (), dtype=torch.long))
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little"))


@torch.no_grad()
def sample(logits: torch.Tensor, params: Sequence[SamplingParams], prompt_ids: Sequence[Sequence[int]],
           output_ids: Sequence[Sequence[int]], generators: Sequence[torch.Generator | None]) -> SampleOut:
    """Choose one token per row of `logits` (B, V) float32. Row b uses params[b], its prompt and output ids so
    far (for the penalties) and generators[b] (None: torch's default generator of the logits' device)."""
    if logits.dim() != 2 or logits.size(0) == 0:
        raise ValueError(f"sample: logits must be (batch>0, vocab), got shape {tuple(logits.shape)}")
    B, V = logits.shape
    for name, seq in (("params", params), ("prompt_ids", prompt_ids), ("output_ids", output_ids),
                      ("generators", generators)):
        if len(seq) != B:
            raise ValueError(f"sample: {len(seq)} {name} for {B} rows of logits")
    logits = logits.float()
    dev = logits.device
    tokens = torch.empty(B, dtype=torch.long, device=dev)
    penalized = _penalize(logits, params, prompt_ids, output_ids)
    greedy = [b for b, p in enumerate(params) if p.temperature == 0.0]
    if greedy:  # penalties change the argmax; the filters never drop it
        idx = torch.tensor(greedy, device=dev)
        tokens.index_copy_(0, idx, penalized.index_select(0, idx).argmax(-1))
    sampled = [b for b, p in enumerate(params) if p.temperature != 0.0]
    if sampled:
        u = torch.stack([torch.rand((), generator=generators[b], dtype=torch.float64, device=dev)
                         for b in sampled])  # one uniform per sampled row, from that row's own generator
        idx = torch.tensor(sampled, device=dev)
        tokens.index_copy_(0, idx, _draw(penalized.index_select(0, idx), [params[b] for b in sampled], u))
    return SampleOut(tokens, *_logprobs(logits, params, tokens))


def _logprobs(logits: torch.Tensor, params: Sequence[SamplingParams],
              tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax of the raw logits at the chosen tokens and the top-n alternatives, for the rows that ask."""
    B, V = logits.shape
    dev = logits.device
    K = max(p.top_logprobs for p in params)
    chosen = torch.full((B,), float("nan"), device=dev)
    top_ids = torch.full((B, K), -1, dtype=torch.long, device=dev)
    top_lp = torch.full((B, K), float("nan"), device=dev)
    rows = [b for b, p in enumerate(params) if p.logprobs or p.top_logprobs]
    if not rows:
        return chosen, top_ids, top_lp
    idx = torch.tensor(rows, device=dev)
    lp = logits.index_select(0, idx).log_softmax(-1)  # (R, V)
    chosen.index_copy_(0, idx, lp.gather(1, tokens.index_select(0, idx)[:, None]).squeeze(1))
    if K:
        # always the top MAX_TOP_LOGPROBS, then each row's own count: a row's order among equal log-probs
        # must not depend on another row's top_logprobs
        vals, ids = lp.topk(min(MAX_TOP_LOGPROBS, V), dim=-1)
        vals, ids = vals[:, :K], ids[:, :K]
        counts = torch.tensor([params[b].top_logprobs for b in rows], device=dev)[:, None]
        past = torch.arange(vals.size(1), device=dev) >= counts
        top_lp[:, : vals.size(1)].index_copy_(0, idx, vals.masked_fill(past, float("nan")))
        top_ids[:, : ids.size(1)].index_copy_(0, idx, ids.masked_fill(past, -1))
    return chosen, top_ids, top_lp


def _penalize(logits: torch.Tensor, params: Sequence[SamplingParams], prompt_ids: Sequence[Sequence[int]],
              output_ids: Sequence[Sequence[int]]) -> torch.Tensor:
    """The logits with each row's penalties applied (the input itself when no row has any): repetition (HF:
    a seen token's logit divided by the penalty when positive, multiplied when negative, over prompt + output),
    then frequency and presence (OpenAI: minus frequency * count, minus presence once if it occurred, over the
    output)."""
    rows = [b for b, p in enumerate(params) if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0
            or p.frequency_penalty != 0.0]
    if not rows:
        return logits
    out = logits.clone()
    dev = logits.device
    for b in rows:
        p, row = params[b], out[b]
        outs = torch.as_tensor(list(output_ids[b]), dtype=torch.long, device=dev)
        if p.repetition_penalty != 1.0:
            seen = torch.cat([torch.as_tensor(list(prompt_ids[b]), dtype=torch.long, device=dev), outs]).unique()
            x = row[seen]
            row[seen] = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and outs.numel():
            ids, counts = outs.unique(return_counts=True)
            x = row[ids] - p.frequency_penalty * counts.float()
            row[ids] = x - p.presence_penalty
    return out


def _draw(logits: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor) -> torch.Tensor:
    """(G,) tokens for penalized logits (G, V) with temperature > 0, row g drawn by its uniform u[g]."""
    G, V = logits.shape
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev)[:, None]
    # subtract the max before dividing: a tiny temperature then gives -inf, never inf - inf
    probs = ((logits - logits.amax(-1, keepdim=True)) / temp).softmax(-1)  # (G, V)
    if not bool(torch.isfinite(probs[:, :1]).all()):
        bad = int((~torch.isfinite(probs[:, 0])).nonzero()[0])
        raise KilnError(f"sample: row {bad} of the logits has no finite maximum (all -inf or NaN)")
    min_p = torch.tensor([p.min_p for p in params], device=dev)
    floor = min_p * probs.amax(-1)  # (G,) min-p: keep probabilities >= min_p * the highest
    tokens = torch.empty(G, dtype=torch.long, device=dev)
    cut = [g for g, p in enumerate(params) if 0 < p.top_k < V or p.top_p < 1.0]
    whole = [g for g, p in enumerate(params) if not (0 < p.top_k < V or p.top_p < 1.0)]
    if whole:
        idx = torch.tensor(whole, device=dev)
        q = probs.index_select(0, idx)
        if any(params[g].min_p > 0 for g in whole):
            q = q.masked_fill(q < floor.index_select(0, idx)[:, None], 0.0)
        tokens.index_copy_(0, idx, _inverse_cdf(q, u.index_select(0, idx)))
    for stage, ratio in enumerate((*CANDIDATES, 0.0)):  # each row widens its list until its cut is decided
        if not cut:
            break
        idx = torch.tensor(cut, device=dev)
        vals, ids, count = _upper_set(probs.index_select(0, idx), ratio)
        thr, done = _top_k_p(vals, count, [params[g] for g in cut], V, whole=ratio == 0.0)
        keep = vals.masked_fill(vals < torch.maximum(thr, floor.index_select(0, idx))[:, None], 0.0)
        drawn = ids.gather(1, _inverse_cdf(keep, u.index_select(0, idx), block=vals.size(1))[:, None]).squeeze(1)
        ready = done.nonzero().squeeze(1)
        tokens.index_copy_(0, idx[ready], drawn[ready])
        cut = [g for g, d in zip(cut, done.tolist()) if not d]
    return tokens


def _upper_set(probs: torch.Tensor, ratio: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's tokens of probability >= ratio * its highest (ratio 0: > 0), sorted most likely first, equal
    probabilities by token id: vals (C, N) and ids (C, N), zero-padded past a row's count (C,). Every token
    outside a row's list is less likely than every token in it, so a top-k / top-p cut that falls inside the
    list is the cut over the whole vocabulary. The order is canonical (not the order some selection kernel
    leaves ties in), so a row's list is the same whatever the other rows are."""
    C = probs.size(0)
    lo = probs.amax(-1, keepdim=True) * ratio  # (C, 1)
    mask = probs >= lo if ratio > 0 else probs > 0
    row, col = mask.nonzero(as_tuple=True)  # row-major: each row's ids ascending
    count = mask.sum(-1)  # (C,)
    start = count.cumsum(0) - count
    pos = torch.arange(row.numel(), device=probs.device) - start[row]
    width = int(count.max())
    vals = probs.new_zeros(C, width)
    ids = torch.zeros(C, width, dtype=torch.long, device=probs.device)
    vals[row, pos] = probs[row, col]
    ids[row, pos] = col
    vals, order = vals.sort(dim=-1, descending=True, stable=True)  # zero padding stays last; ties keep id order
    return vals, ids.gather(1, order), count


def _top_k_p(vals: torch.Tensor, count: torch.Tensor, params: Sequence[SamplingParams], V: int,
             whole: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """For each row's upper set vals (C, N) (sorted, count[c] of them real, the rest 0; `whole`: every token
    of positive probability): the probability the row keeps down to (top-k's k-th value, then top-p's: the
    smallest head of the top-k survivors whose mass reaches top_p of theirs; ties at a cut are kept, as HF's
    top-k keeps them), and whether the list decides it."""
    dev = vals.device
    top_k = [p.top_k if 0 < p.top_k < V else 0 for p in params]  # top_k >= V cuts nothing
    has_k = torch.tensor([k > 0 for k in top_k], device=dev)
    want = torch.tensor(top_k, device=dev)
    in_list = want <= count
    k = torch.where(has_k, torch.minimum(want, count), count).clamp(min=1)  # (C,)
    kth = vals.gather(1, (k - 1)[:, None]).squeeze(1)  # top-k's cut (no top-k: the last candidate)
    cum = vals.double().cumsum(-1)  # (C, N) mass of each head
    survivors = (vals >= kth[:, None]).sum(-1)  # top-k's survivors, its ties at the cut included
    # top-p's mass is relative to the top-k survivors (renormalized, as HF's top-p after top-k); without top-k
    # it is relative to the whole distribution, which softmax made 1
    mass = torch.where(has_k, cum.gather(1, (survivors - 1)[:, None]).squeeze(1), torch.ones_like(cum[:, 0]))
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=dev)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], 1)  # the mass strictly above each one
    m = torch.minimum((before < (top_p * mass)[:, None]).sum(-1), survivors).clamp(min=1)  # kept head length
    m = torch.where(top_p >= 1.0, survivors, m)  # top-k alone: all its survivors, however small
    thr = vals.gather(1, (m - 1)[:, None]).squeeze(1)
    # decided: the whole vocabulary, or top-k's k-th token is in the list (its survivors, then top-p's head
    # among them, are), or top-p's head stops before the list's end
    done = (has_k & in_list) | (~has_k & (m < count)) | whole
    return thr, done


def _inverse_cdf(q: torch.Tensor, u: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """(G,) indices, row g's drawn with probability q[g] / q[g].sum() (q (G, N) >= 0, some > 0 in each row) by
    its uniform u[g] in [0, 1): a block of `block` entries by the float64 running sum of the blocks' float32
    sums, then an entry by the float64 running sum inside that block (as kiln.models.generation.inverse_cdf,
    with each row's uniform given). An entry of probability 0 is never drawn."""
    G, N = q.shape
    block = min(block, N)
    full = N // block * block
    sums = q[:, :full].reshape(G, -1, block).sum(-1)  # (G, N // block), each block summed alone
    if full < N:
        sums = torch.cat([sums, q[:, full:].sum(-1, keepdim=True)], 1)
    cdf = sums.double().cumsum(-1)  # (G, blocks)
    total = cdf[:, -1:]
    if not bool((total > 0).all()):
        raise KilnError("sample: a row has no token of positive probability left after its filters")
    target = u[:, None] * total  # (G, 1)
    # the first block whose running sum passes the target (u * total may round up to the total: the last
    # block of positive mass then)
    blk = torch.minimum(torch.searchsorted(cdf, target, right=True), (cdf < total).sum(-1, keepdim=True))
    before = torch.where(blk > 0, cdf.gather(1, (blk - 1).clamp(min=0)), 0.0)
    col = blk * block + torch.arange(block, device=q.device)  # (G, block)
    inside = q.gather(1, col.clamp(max=N - 1)).masked_fill(col >= N, 0.0).double().cumsum(-1)
    last = inside[:, -1:]
    rest = (target - before) / (cdf.gather(1, blk) - before) * last  # the target's place on the block's own sum
    entry = torch.minimum(torch.searchsorted(inside, rest, right=True), (inside < last).sum(-1, keepdim=True))
    return (blk * block + entry).squeeze(1)
