"""One decode step's token choice for a batch of sequences, each with its own SamplingParams and generator.

The order is Hugging Face's: penalties on the raw logits (repetition over prompt + output tokens, HF's rule;
presence / frequency over output tokens, OpenAI's rule), then temperature (0 = greedy argmax), top-k, top-p
over the top-k survivors renormalized, min-p relative to the highest probability, and one draw from what is
left. Log-probs are log_softmax of the raw float32 logits (before penalties and temperature): what the training
forward computes and what RL compares.

Each filter is a floor on the row's probabilities (top-k: its k-th; top-p: the last of the most-likely-first
head whose mass reaches top_p of the top-k survivors'; min-p: min_p times the highest), ties at a floor kept
(as HF's top-k keeps them); the row draws from what is >= its highest floor.

Batch invariance: row b's token and log-probs depend only on row b's logits, params, ids and generator, never
on the other rows or on B. Every op here is either exact elementwise arithmetic (sub, div, compare, where),
a kernel that treats each row alone (softmax, log_softmax, topk, sort, cumsum, max / sum over one block of a
row, bincount summing a row's entries in column order), or an index op; a row draws exactly one uniform
number from its own generator per sampled step; which path a row takes depends on its own params and V only.

Speed (V = 151,936): the vocabulary is read in blocks of 1,024; a block's maximum says whether it can hold one
of the k largest (top-k, the top-n log-probs, greedy's argmax), so only those blocks are searched; top-p's cut
comes from a radix select on the float32 bits (masses per bucket of bits), not a sort of the vocabulary. The
(B, V) intermediates live in buffers kept per thread: a fresh 19 MB tensor per step costs more in page faults
than the softmax that fills it.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kiln.engine.params import MAX_TOP_LOGPROBS, SamplingParams
from kiln.errors import KilnError
from kiln.models.generation import inverse_cdf

BLOCK = 1024  # the vocabulary is read in blocks of this many entries (maxima, sums)
SORT_BELOW = 4096  # top-p sorts a row this short; a longer one goes through a radix select


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
           output_ids: Sequence[Sequence[int]], generators: Sequence[torch.Generator | None], *,
           logprobs: bool = True) -> SampleOut:
    """Choose one token per row of `logits` (B, V) float32. Row b uses params[b], its prompt and output ids so
    far (for the penalties) and generators[b] (None: torch's default generator of the logits' device).
    logprobs=False: skip the log-probs (for a caller that computes them itself): SampleOut.logprobs is all NaN
    and top_ids / top_logprobs have no columns, whatever params ask; the tokens are the same."""
    if logits.dim() != 2 or logits.size(0) == 0:
        raise ValueError(f"sample: logits must be (batch>0, vocab), got shape {tuple(logits.shape)}")
    B, _V = logits.shape
    for name, seq in (("params", params), ("prompt_ids", prompt_ids), ("output_ids", output_ids),
                      ("generators", generators)):
        if len(seq) != B:
            raise ValueError(f"sample: {len(seq)} {name} for {B} rows of logits")
    logits = logits.float().contiguous()
    dev = logits.device
    tokens = torch.empty(B, dtype=torch.long, device=dev)
    penalized = _penalize(logits, params, prompt_ids, output_ids)
    greedy = [b for b, p in enumerate(params) if p.temperature == 0.0]
    if greedy:  # penalties change the argmax; the filters never drop it
        idx = torch.tensor(greedy, device=dev)
        tokens.index_copy_(0, idx, _first_argmax(_rows(penalized, greedy, "greedy")))
    sampled = [b for b, p in enumerate(params) if p.temperature != 0.0]
    if sampled:
        u = torch.stack([torch.rand((), generator=generators[b], dtype=torch.float64, device=dev)
                         for b in sampled])  # one uniform per sampled row, from that row's own generator
        idx = torch.tensor(sampled, device=dev)
        tokens.index_copy_(0, idx, _draw(_rows(penalized, sampled, "scaled"), [params[b] for b in sampled], u))
    if not logprobs:
        return SampleOut(tokens, torch.full((B,), float("nan"), device=dev),
                         torch.empty((B, 0), dtype=torch.long, device=dev), torch.empty((B, 0), device=dev))
    return SampleOut(tokens, *_logprobs(logits, params, tokens))


# ---- buffers and blocks ---------------------------------------------------------------------------------------


class _Buffers(threading.local):
    def __init__(self) -> None:
        self.held: dict[tuple, torch.Tensor] = {}


_BUFFERS = _Buffers()


def _buffer(name: str, rows: int, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A (rows, V) scratch tensor kept between calls (per thread, name, device and dtype), grown as needed."""
    dtype = dtype or like.dtype
    key = (name, like.device, dtype)
    n = rows * like.size(1)
    held = _BUFFERS.held.get(key)
    if held is None or held.numel() < n:
        held = _BUFFERS.held[key] = torch.empty(n, dtype=dtype, device=like.device)
    return held[:n].view(rows, like.size(1))


def _rows(x: torch.Tensor, rows: list[int], name: str) -> torch.Tensor:
    """x's `rows` (all of them: x itself), copied into the buffer `name` otherwise."""
    if len(rows) == x.size(0):
        return x
    out = _buffer(name, len(rows), x)
    return torch.index_select(x, 0, torch.tensor(rows, device=x.device), out=out)


def _blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (G, N) contiguous as its whole blocks (G, N // block, block), a view, and the rest (G, N % block)."""
    G, N = x.shape
    full = N // block * block
    return x.as_strided((G, N // block, block), (N, block, 1)), x[:, full:]


def _block_max(x: torch.Tensor) -> torch.Tensor:
    """(G, ceil(N / block)): the maximum of each block of each row (the last block may be short)."""
    whole, rest = _blocks(x, min(BLOCK, x.size(1)))
    out = whole.amax(-1)
    return torch.cat([out, rest.amax(-1, keepdim=True)], 1) if rest.size(1) else out


def _gather_blocks(x: torch.Tensor, row: torch.Tensor, blk: torch.Tensor,
                   fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks (row[i], blk[i]) of x (G, N) (as _block_max numbers them): values (A, block) (`fill` past
    the end) and their columns (A, block)."""
    G, N = x.shape
    block = min(BLOCK, N)
    whole, rest = _blocks(x, block)
    col = blk[:, None] * block + torch.arange(block, device=x.device)  # (A, block)
    if not rest.size(1):
        return whole[row, blk], col
    tail = x.new_full((G, block), fill)
    tail[:, : rest.size(1)] = rest
    short = blk == whole.size(1)  # the short last block, from its padded copy
    vals = x.new_empty(row.numel(), block)
    vals[~short] = whole[row[~short], blk[~short]]
    vals[short] = tail[row[short]]
    return vals, col


def _first_argmax(x: torch.Tensor) -> torch.Tensor:
    """(G,) the first column of each row's maximum (torch.argmax, through the first block holding it)."""
    bmax = _block_max(x)  # (G, blocks)
    best = bmax.amax(-1, keepdim=True)
    if bool(best.isnan().any()):
        raise KilnError(f"sample: row {int(best.isnan().nonzero()[0, 0])} of the greedy rows' logits has a NaN")
    blk = (bmax == best).int().argmax(-1)  # the first block reaching the row's maximum
    vals, col = _gather_blocks(x, torch.arange(x.size(0), device=x.device), blk, fill=-float("inf"))
    return col.gather(1, (vals == best).int().argmax(-1, keepdim=True)).squeeze(1)


def _top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x's k largest values per row (G, k), largest first, and their columns (equal values in column order;
    which of several values equal to the k-th make the list is topk's choice, fixed by the row). Each of the
    k largest lies in one of the k blocks of highest maximum, so only those are searched."""
    bmax = _block_max(x)
    nb = min(k, bmax.size(1))
    blk = bmax.topk(nb, dim=-1).indices.sort(-1).values  # (G, nb) the blocks, in column order
    rows = torch.arange(x.size(0), device=x.device)[:, None].expand(-1, nb).reshape(-1)
    vals, col = _gather_blocks(x, rows, blk.reshape(-1), fill=-float("inf"))
    vals, col = vals.view(x.size(0), -1), col.view(x.size(0), -1)  # (G, nb * block), columns ascending
    top, at = vals.topk(min(k, x.size(1)), dim=-1)
    col = col.gather(1, at)
    short = (col >= x.size(1)).any(-1)  # fewer than k values above -inf: a padding column tied with a real -inf
    if bool(short.any()):
        top[short], col[short] = x[short].topk(top.size(1), dim=-1)
    # canonical order among equal values: by column (topk leaves ties in an order of its own)
    by_col = col.sort(-1).indices
    top, col = top.gather(1, by_col), col.gather(1, by_col)
    order = top.sort(dim=-1, descending=True, stable=True).indices
    return top.gather(1, order), col.gather(1, order)


# ---- log-probs and penalties ----------------------------------------------------------------------------------

def _logprobs(logits: torch.Tensor, params: Sequence[SamplingParams],
              tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log_softmax of the raw logits at the chosen tokens and the top-n alternatives, for the rows that ask."""
    B, _V = logits.shape
    dev = logits.device
    K = max(p.top_logprobs for p in params)
    chosen = torch.full((B,), float("nan"), device=dev)
    top_ids = torch.full((B, K), -1, dtype=torch.long, device=dev)
    top_lp = torch.full((B, K), float("nan"), device=dev)
    rows = [b for b, p in enumerate(params) if p.logprobs or p.top_logprobs]
    if not rows:
        return chosen, top_ids, top_lp
    idx = torch.tensor(rows, device=dev)
    lp = torch.log_softmax(_rows(logits, rows, "scaled"), -1, out=_buffer("probs", len(rows), logits))  # (R, V)
    chosen.index_copy_(0, idx, lp.gather(1, tokens.index_select(0, idx)[:, None]).squeeze(1))
    if K:
        # always the top MAX_TOP_LOGPROBS, then each row's own count: which of several equal log-probs make a
        # row's list must not depend on another row's top_logprobs
        vals, ids = _top(lp, MAX_TOP_LOGPROBS)
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
    out = _buffer("penalized", logits.size(0), logits).copy_(logits)
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
    """(G,) tokens for penalized logits (G, V) with temperature > 0, row g drawn by its uniform u[g]. Each
    filter keeps the probabilities >= a value of the row (top-k: its k-th; top-p: the smallest of the head
    whose mass reaches top_p of the top-k survivors'; min-p: min_p times its highest), so a row keeps those
    >= the largest of its values and draws from them over the whole vocabulary."""
    G, V = logits.shape
    dev = logits.device
    scaled = logits
    if any(p.temperature != 1.0 for p in params):
        # subtract the max before dividing: a tiny temperature then gives -inf, never inf - inf. A row at
        # temperature 1 comes out the same either way: softmax subtracts the max itself (x - m, then - 0)
        scaled = _buffer("scaled", G, logits)
        if scaled.data_ptr() != logits.data_ptr():
            torch.sub(logits, logits.amax(-1, keepdim=True), out=scaled)
        else:
            scaled.sub_(scaled.amax(-1, keepdim=True))
        scaled.div_(torch.tensor([p.temperature for p in params], device=dev)[:, None])  # x / 1 == x
    probs = torch.softmax(scaled, -1, out=_buffer("probs", G, logits))  # (G, V)
    top = probs.amax(-1)  # (G,)
    if not bool(torch.isfinite(top).all()):
        bad = int((~torch.isfinite(top)).nonzero()[0])
        raise KilnError(f"sample: row {bad} of the logits has no finite maximum (all -inf or NaN)")
    floor = torch.tensor([p.min_p for p in params], device=dev) * top  # (G,) keep probabilities >= this
    kth = torch.zeros_like(top)
    with_k = [g for g, p in enumerate(params) if 0 < p.top_k < V]
    with_p = [g for g, p in enumerate(params) if p.top_p < 1.0]
    if with_k:  # top-k: its k-th probability (ties with it are kept, as HF's top-k keeps them)
        idx = torch.tensor(with_k, device=dev)
        k = torch.tensor([params[g].top_k for g in with_k], device=dev)
        vals, _ = _top(_rows(probs, with_k, "scaled"), max(params[g].top_k for g in with_k) + 1)  # (K, kmax + 1)
        kth[idx] = vals.gather(1, (k - 1)[:, None]).squeeze(1)
        floor[idx] = torch.maximum(floor[idx], kth[idx])
        # top-p over the k survivors, read off their sorted list where no tie of the k-th lies past it
        alone = (vals.gather(1, k[:, None]).squeeze(1) < kth[idx]).tolist()
        listed = [i for i, g in enumerate(with_k) if params[g].top_p < 1.0 and alone[i]]
        if listed:
            rows = torch.tensor(listed, device=dev)
            head = vals[rows].masked_fill(torch.arange(vals.size(1), device=dev) >= k[rows][:, None], 0.0)
            frac = torch.tensor([params[with_k[i]].top_p for i in listed], dtype=torch.float64, device=dev)
            at = idx[rows]
            floor[at] = torch.maximum(floor[at], _sorted_threshold(head, frac))
            done = {with_k[i] for i in listed}
            with_p = [g for g in with_p if g not in done]
    if with_p:  # top-p over the top-k survivors (zeroed below the k-th: harmless, they are cut anyway)
        idx = torch.tensor(with_p, device=dev)
        w = _rows(probs, with_p, "scaled")
        if bool((kth[idx] > 0).any()):
            w.masked_fill_(w < kth[idx][:, None], 0.0)
        frac = torch.tensor([params[g].top_p for g in with_p], dtype=torch.float64, device=dev)
        floor[idx] = torch.maximum(floor[idx], _mass_threshold(w, frac))
    if bool((floor > 0).any()):
        probs.masked_fill_(torch.lt(probs, floor[:, None], out=_buffer("mask", G, probs, torch.bool)), 0.0)
    return inverse_cdf(probs, block=BLOCK, u=u)


def _mass_threshold(w: torch.Tensor, frac: torch.Tensor) -> torch.Tensor:
    """(C,) top-p's cut for rows of probabilities w (C, N) in [0, 1] (float32): the largest value v of each
    row such that the entries >= v sum to at least frac times the row's total (the smallest most-likely-first
    head whose mass reaches frac, ties at its end included). A short row is sorted, and so is every row on a
    GPU (whose sort is fast, and whose bincount sums in no fixed order); a long one on the CPU (a real
    vocabulary) goes through a radix select. The path depends on N and the device, never on the other rows."""
    if w.size(1) <= SORT_BELOW or w.device.type != "cpu":
        return _sorted_threshold(w.sort(dim=-1, descending=True).values, frac)
    return _radix_threshold(w, frac)


def _sorted_threshold(vals: torch.Tensor, frac: torch.Tensor) -> torch.Tensor:
    """_mass_threshold of rows already sorted largest first (C, N): the first value whose head reaches it."""
    cum = vals.double().cumsum(-1)
    first = (cum < (frac * cum[:, -1])[:, None]).sum(-1).clamp(max=vals.size(1) - 1)
    return vals.gather(1, first[:, None]).squeeze(1)


def _radix_threshold(w: torch.Tensor, frac: torch.Tensor) -> torch.Tensor:
    """_mass_threshold without a sort: the float32 bits of w >= 0 are in the values' order, so the mass per
    bucket of the top 12 bits (values <= 1: < 1,024 buckets) says which bucket the cut is in, then the next 10
    bits inside it, then the last 10. Each row's masses are summed in its column order (bincount)."""
    C, _N = w.shape
    dev = w.device
    bits = w.view(torch.int32)
    rows = torch.arange(C, device=dev, dtype=torch.int32)[:, None]
    key = torch.bitwise_right_shift(bits, 20, out=_buffer("keys", C, bits)).clamp_(max=1023).add_(rows * 1024)
    hist = torch.bincount(key.view(-1), weights=w.view(-1), minlength=C * 1024).view(C, 1024).double()
    target = frac * hist.cumsum(-1)[:, -1]  # (C,) frac of each row's total
    b1, above = _crossing(hist, target, torch.zeros_like(target))
    r, c = (key == (b1.int() + rows.squeeze(1) * 1024)[:, None]).nonzero(as_tuple=True)  # bucket b1's entries
    vals = w[r, c]
    low = vals.view(torch.int32)
    b2, above = _crossing(_hist(r, (low >> 10) & 1023, vals, C), target, above)
    inside = ((low >> 10) & 1023) == b2[r].int()
    r, vals, low = r[inside], vals[inside], low[inside]
    b3, _ = _crossing(_hist(r, low & 1023, vals, C), target, above)
    return ((b1 << 20) | (b2 << 10) | b3).int().view(torch.float32)


def _hist(row: torch.Tensor, key: torch.Tensor, vals: torch.Tensor, C: int) -> torch.Tensor:
    """(C, 1024) float64: the sum of vals per (row, key), key in [0, 1024)."""
    return torch.bincount(row * 1024 + key.long(), weights=vals.double(), minlength=C * 1024).view(C, 1024)


def _crossing(hist: torch.Tensor, target: torch.Tensor, above: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For bucket masses hist (C, K) (bucket order = value order) under a mass `above` already counted: the
    highest bucket where the running mass from the top reaches target (0 if rounding leaves none), and the
    mass above that bucket."""
    below = hist.cumsum(-1) - hist  # (C, K) the mass under each bucket (rounding keeps it nondecreasing)
    from_top = (below[:, -1:] + hist[:, -1:] - below) + above[:, None]  # (C, K) mass at or above each bucket
    b = ((from_top >= target[:, None]).sum(-1) - 1).clamp(min=0)  # from_top falls with the bucket index
    nxt = (b + 1).clamp(max=hist.size(1) - 1)[:, None]
    return b, torch.where(b + 1 < hist.size(1), from_top.gather(1, nxt).squeeze(1), above)
