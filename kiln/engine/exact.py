"""Batch-invariant kernels: a token's numbers never depend on which other tokens share the call.

On a CPU a matrix product's per-row result can depend on the row count (BLAS picks gemv for one row, other
blockings for others), and an elementwise op's on where the row sits (torch runs full SIMD blocks through the
vector code and the tail, or a thread's chunk edge, through the scalar code: exp, sin and friends may differ by
an ulp between the two). So every op here has a shape that depends on nothing but the model:

- `tiled`: row-wise work (norms, projections, the MLP) runs on tiles of exactly `TILE` rows, zero-padded; a
  product's row depends on its own row and the product's (M, N, K), which is fixed;
- the LM head, the costly product (rows x hidden x a vocabulary of up to 150k): a call has HEAD_TILE rows or
  another row count that `head_tiles` proved, on this machine and model, to give HEAD_TILE's bits (none proven:
  HEAD_TILE alone), through oneDNN's matrix product on the weight reordered once (`pack_head`, a float32 CPU
  weight: one call over the whole vocabulary, its blocking chosen for the packed layout, and on the machines
  measured the same bits at every row count, 1 included) or else `vocab_product` (products of (rows, hidden)
  by fixed column blocks of VOCAB_CHUNK vocabulary rows, each read from memory once for all the call's rows);
- `lanewise`: a transcendental elementwise op runs on a flat copy padded to whole SIMD blocks, in calls small
  enough never to be split between threads, so every element goes through the same vector code;
- `attend`: each query row is its own (groups x D) @ (D x block) product against each key block; the softmax
  is taken in two passes whose sums run in a fixed sequential order (cumsum) over block-sized pieces, so a key
  block past a row's position adds exact zeros and chunked prefill, decode and a whole-sequence scoring
  forward give the same bits;
- rotary angles come from one table built once per engine, so a position's cos/sin never depend on the call.

What this rests on: a product computes each output row from that row and the right operand alone with an
order fixed by (M, N, K) (no BLAS mixes rows), and SIMD lanes compute independently. Both hold by how the
kernels are built; the tests compare a request alone with the same request among 31 others.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F

TILE = 16            # rows per row-wise call (the M of every projection)
HEAD_TILE = 8        # rows per LM-head call when no other size is proven equal (see `head_tiles`)
HEAD_SIZES = (1, 2, 4, 16, 24, 32, 48, 64)  # other LM-head row counts `head_tiles` may prove equal to HEAD_TILE
VOCAB_CHUNK = 2048   # vocabulary rows of the head's weight per product (2 MiB of a 256-wide fp32 weight: cached)
LANES = 64           # a multiple of every SIMD block torch uses (2 x 16 floats with AVX-512)
SERIAL = 32768 // LANES * LANES  # torch's grain size: a smaller elementwise call is never split between threads


def tiled(fn: Callable[..., torch.Tensor], *xs: torch.Tensor, tile: int = TILE) -> torch.Tensor:
    """fn applied to row-aligned xs (N, ...) in tiles of exactly `tile` rows (the last zero-padded): (N, ...)."""
    n = xs[0].shape[0]
    pad = -n % tile
    if pad:
        xs = tuple(torch.cat([x, x.new_zeros((pad,) + tuple(x.shape[1:]))]) for x in xs)
    outs = [fn(*(x[s:s + tile] for x in xs)) for s in range(0, n + pad, tile)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[:n] if pad else out


def vocab_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x (M, C) @ weight (V, C)^T -> (M, V) in x's dtype, as one (M, C) x (C, VOCAB_CHUNK) product per block of
    the weight's rows (the last block: V % VOCAB_CHUNK rows), written into the output's columns. Each product's
    shape depends on M and the model alone, so with M fixed a row's bits depend on nothing else; a block is
    read once for all M rows (one call over the whole weight takes other kernels by row count, and a call per
    row tile re-reads the whole weight per tile)."""
    V = weight.shape[0]
    out = x.new_empty((x.shape[0], V))
    for v in range(0, V, VOCAB_CHUNK):
        torch.mm(x, weight[v:v + VOCAB_CHUNK].t(), out=out[:, v:v + VOCAB_CHUNK])
    return out


def pack_head(weight: torch.Tensor) -> torch.Tensor | None:
    """weight (V, C) reordered once for oneDNN's matrix product (`packed_product`), or None where that path is
    not there (not a float32 CPU weight, a torch without oneDNN or its linear ops): the caller then takes
    `vocab_product`. The packed copy is the weight's size; it holds the weight's values when made (a caller
    remakes it when the weight changes)."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    ops = torch.ops.mkldnn
    if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return None
    try:
        with torch.no_grad():
            return ops._reorder_linear_weight(weight.detach().contiguous(), HEAD_TILE)
    except RuntimeError:  # a build whose oneDNN refuses the shape or the machine: the blocked product instead
        return None


def packed_product(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x (M, C) @ weight^T -> (M, V) through oneDNN on `pack_head(weight)`: one call over the whole vocabulary
    (the packed weight is read once for all M rows). Whether a row's bits depend on M is for `head_tiles` to
    prove on the machine, as for any product."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")


def head_tiles(fn: Callable[[torch.Tensor], torch.Tensor], width: int, dtype: torch.dtype,
               device: torch.device, limit: int = max(HEAD_SIZES)) -> tuple[int, ...]:
    """The LM head's row counts up to `limit` that give the bits of HEAD_TILE-row calls on this machine,
    HEAD_TILE first.

    The head's (rows x vocab) product dominates a decode step, and its per-row cost falls steeply with the row
    count, so one call per step of about the running rows is worth having. A row count joins only if calls of
    that many rows reproduce HEAD_TILE-row calls bit for bit on random rows (a product that orders a row's sum
    differently differs on nearly every one of the rows x vocab outputs). Unproven sizes are never used, so
    the guarantee stays that of fixed shapes."""
    sizes = tuple(m for m in HEAD_SIZES if m <= max(limit, min(HEAD_SIZES)))
    rows = max((HEAD_TILE,) + sizes)
    g = torch.Generator(device="cpu").manual_seed(0)
    probe = torch.randn(rows, width, generator=g).to(device=device, dtype=dtype)
    with torch.no_grad():
        ref = tiled(fn, probe, tile=HEAD_TILE)
        # a size is tried on max(size, HEAD_TILE) rows: one call of it, or several covering a HEAD_TILE call's
        # rows (each call reads the whole weight: proving small sizes on every probe row would cost dozens)
        return (HEAD_TILE,) + tuple(m for m in sizes if torch.equal(tiled(fn, probe[:max(m, HEAD_TILE)], tile=m),
                                                                    ref[:max(m, HEAD_TILE)]))


def tiled_menu(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """fn over x (N, ...) in calls whose row counts come from `sizes` (each proven to give the same bits): the
    smallest size that holds what is left, or the largest, zero-padded."""
    sizes = tuple(sorted(sizes))
    outs, s, n = [], 0, x.shape[0]
    while s < n:
        m = next((k for k in sizes if k >= n - s), sizes[-1])
        outs.append(tiled(fn, x[s:s + m], tile=m))
        s += m
    return outs[0] if len(outs) == 1 else torch.cat(outs) if outs else fn(x)


def lanewise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """An elementwise fn with every element through the same vector code: x flattened, padded to whole blocks
    of LANES, in calls of at most SERIAL elements (one thread each)."""
    flat = x.reshape(-1)
    n = flat.numel()
    pad = -n % LANES
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    outs = [fn(flat[s:s + SERIAL]) for s in range(0, n + pad, SERIAL)]
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out[:n].view(x.shape)


def seqsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The sum over `dim` in index order (cumsum is a sequential loop on the CPU): trailing exact zeros leave it
    unchanged, so its value does not depend on how far the dimension runs past the nonzero entries."""
    return x.cumsum(dim).select(dim, -1)


def rope_table(rotary: torch.nn.Module, length: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin (length, D) for positions 0..length-1 from the model's rotary module, in one call."""
    pos = torch.arange(length, device=like.device)[None]  # (1, L)
    cos, sin = rotary(like, pos)
    return cos[0].contiguous(), sin[0].contiguous()


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor, scale: float,
           keep: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of queries over key blocks.

    q (T, KVH, G, D) (query head kvh * G + g reads kv head kvh, transformers' repeat_kv order); keys
    (X, NB, BS, KVH, D) and values (X, NB, BS, KVH, DV) with X = 1 (every query reads the same sequence's
    blocks) or X = T (row t its own), block j holding positions j * BS ...; q_pos (T,) each query's position
    (it sees keys at positions <= its own: blocks past it, a padding of the block list included, add exact
    zeros). A slot past every query that reads it is never written for them (a stale freed block, the padding,
    the unfilled rest of a block) and may hold inf or NaN: its score is masked to -inf and its values to 0, so
    0 * inf never makes a NaN. `keep` (T, NB * BS) bool, when given, masks every key it does not hold (sparse
    attention's choice, `top_keys`). Returns (T, KVH * G, DV) in q's dtype."""
    T, KVH, G, _D = q.shape
    NB, BS = keys.shape[1:3]
    k = keys.permute(0, 1, 3, 4, 2)  # (X, NB, KVH, D, BS)
    v = values.permute(0, 1, 3, 2, 4)  # (X, NB, KVH, BS, D)
    s = torch.matmul(q[:, None].float(), k.float()) * scale
    # s (T, NB, KVH, G, BS): one (G x D) @ (D x BS) product per query row, block and kv head
    key_pos = torch.arange(NB * BS, device=q.device).view(1, NB, 1, 1, BS)
    s = s.masked_fill(key_pos > q_pos.view(T, 1, 1, 1, 1), float("-inf"))
    if keep is not None:
        s = s.masked_fill(~keep.view(T, NB, 1, 1, BS), float("-inf"))
    m = s.amax(dim=(1, 4), keepdim=True)  # (T, 1, KVH, G, 1): a max is exact in any order
    p = lanewise(torch.exp, s - m)        # masked keys give exactly 0
    l = seqsum(seqsum(p, 4), 1)           # (T, KVH, G)
    # the values at key positions past the last query reading them: exact 0 (one row each, or all rows' last)
    last = q_pos.view(T, 1, 1, 1, 1) if values.shape[0] == T else q_pos.max()
    v = v.float().masked_fill(key_pos.view(1, NB, 1, BS, 1) > last, 0.0)
    o = seqsum(torch.matmul(p, v), 1)  # (T, KVH, G, D): (G x BS) @ (BS x D) per block, summed in order
    return (o / l[..., None]).reshape(T, KVH * G, -1).to(q.dtype)


def top_keys(scores: torch.Tensor, q_pos: torch.Tensor, k: int) -> torch.Tensor:
    """Each query row's k best keys (T, K) bool from scores (T, K) over key positions 0..K-1 (sparse attention's
    choice): keys past the row's position never count, and equal scores go to the earlier key (a stable sort),
    so the choice does not depend on how far K runs past the row (a decode's padded block list, a chunk, the
    whole sequence). A row with fewer than k keys at or before it keeps them all."""
    K = scores.shape[1]
    future = torch.arange(K, device=scores.device)[None] > q_pos[:, None]
    order = torch.sort(scores.masked_fill(future, float("-inf")), dim=1, descending=True, stable=True).indices
    return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(1, order[:, :k], True)


def log_softmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """float32 log_softmax of each row (N, V) in its own (1, V) call: a row's values never see the row count."""
    return torch.cat([F.log_softmax(logits[i:i + 1].float(), -1) for i in range(logits.shape[0])]) \
        if logits.shape[0] else logits.float()
