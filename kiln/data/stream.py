"""Packed windows over token shards: the pre-training stream, sharded over ranks and DataLoader workers.

The layout is arithmetic, so any process can compute any window without talking to the others:

- epoch e reads the split's shards in a seeded order (`permutation(seed, e)`), as one stream of
  N tokens; window j of the epoch is tokens [j*T, j*T + T + 1): T+1 tokens overlapping the next
  window by one, so every token is an input once and a target once (the last window of an epoch
  may be shorter; its missing targets are IGNORE_INDEX). M = ceil((N - 1) / T) windows per epoch.
- training reads windows k = 0, 1, 2, ... across epochs (k -> epoch k // M, window k % M); global
  batch g is windows [g*B*R, (g+1)*B*R) and rank r takes its r-th slice of B.
- DataLoader worker w of W builds the rank's global batches in runs of K (K = prefetch): runs
  w, w + W, ..., run c being batches start + c*K .. start + c*K + K-1; the DataLoader hands runs
  out round-robin over workers, so a rank sees batches start, start + 1, ... in order whatever W
  is, and the cursor is one number: windows consumed by all ranks (batches the trainer took, not
  ones still waiting in a run).

A batch holds input_ids (B, T) and targets (B, T) (next tokens, IGNORE_INDEX = none) and, when asked
(`within_doc`), position_ids restarting after each EOS: the decoder then keeps attention inside
documents (a block-diagonal causal mask).

Workers do not hand over those int64 tensors: a tensor crossing processes costs a shared-memory
segment and a file descriptor each (~1 ms a batch, more than building it). They hand over packs
instead: the windows as numpy rows of T+1 tokens in the shards' own dtype (uint16/uint32) with
each row's length, several batches at a time, pickled through the worker pipe; the main process
widens a pack into the batches above (`unpack`). The pack is what is read, the batch a pure
function of it, so every worker count gives the same batches.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from kiln.constants import IGNORE_INDEX
from kiln.data.shards import ShardSet
from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.data.raw import RawTokens

Batch = dict[str, torch.Tensor]
# (rows, lengths, sizes): rows (N, T+1) of window tokens in the shards' dtype, padded with EOS;
# lengths (N,) real tokens per row (0 = filler row); sizes: rows per batch, in order, summing to N
Pack = tuple[np.ndarray, np.ndarray, tuple[int, ...]]
_T = TypeVar("_T")


class Windows:
    """The window arithmetic of one split: which tokens window k holds, as a (B, T) batch."""

    def __init__(self, shards: ShardSet | RawTokens, seq_len: int, seed: int = 0, shuffle: bool = True,
                 within_doc: bool = False):
        if seq_len < 1:
            raise KilnError(f"seq_len must be >= 1, got {seq_len}")
        self.shards, self.seq_len, self.seed = shards, seq_len, seed
        self.shuffle, self.within_doc = shuffle, within_doc
        self.tokens = shards.total_tokens
        if self.tokens < 2:
            raise KilnError(f"{shards.root}: split {shards.split!r} has {self.tokens} token(s); a window needs 2")
        self.per_epoch = math.ceil((self.tokens - 1) / seq_len)
        self._layout: tuple[int, np.ndarray, np.ndarray] | None = None

    def order(self, epoch: int) -> np.ndarray:
        """The shard order of `epoch`."""
        n = len(self.shards.lengths)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        if self._layout is None or self._layout[0] != epoch:
            order = self.order(epoch)
            starts = np.concatenate([[0], np.cumsum(self.shards.lengths[order])])
            self._layout = (epoch, order, starts)
        return self._layout[1], self._layout[2]

    def span(self, epoch: int, start: int, end: int, out: np.ndarray | None = None) -> np.ndarray:
        """Tokens [start, end) of the epoch's stream, gathered across shard boundaries, into `out`
        (default: a new array of the shards' dtype)."""
        order, starts = self._epoch(epoch)
        out = np.empty(end - start, dtype=self.shards.dtype) if out is None else out
        i = int(np.searchsorted(starts, start, side="right")) - 1
        pos = start
        while pos < end:
            take = min(end, int(starts[i + 1])) - pos
            lo = pos - int(starts[i])
            out[pos - start: pos - start + take] = self.shards.tokens(int(order[i]))[lo: lo + take]
            pos += take
            i += 1
        return out

    def _bounds(self, k: int) -> tuple[int, int, int]:
        epoch, j = divmod(k, self.per_epoch)
        start = j * self.seq_len
        return epoch, start, min(start + self.seq_len + 1, self.tokens)

    def window(self, k: int) -> np.ndarray:
        """Window k of the endless stream: up to T+1 tokens."""
        return self.span(*self._bounds(k))

    def pack(self, ks: range | list[int | None]) -> Pack:
        """Windows `ks` as one batch's pack (see `Pack`); a None row is filler, for ranks that run out first."""
        rows = np.full((len(ks), self.seq_len + 1), self.shards.eos_id, dtype=self.shards.dtype)
        lengths = np.zeros(len(ks), dtype=np.int64)
        for row, k in enumerate(ks):
            if k is None:
                continue
            epoch, start, end = self._bounds(k)
            self.span(epoch, start, end, out=rows[row, : end - start])
            lengths[row] = end - start
        return rows, lengths, (len(ks),)

    def batch(self, ks: range | list[int | None]) -> Batch:
        """Windows `ks` as rows; a None row is filler (no targets), for ranks that run out first."""
        return unpack(self.pack(ks), self.shards.eos_id, self.within_doc)[0]


def unpack(pack: Pack, eos_id: int, within_doc: bool, pin_memory: bool = False) -> list[Batch]:
    """A pack's batches, widened to the model's int64: input_ids (EOS past a row's end), targets
    (IGNORE_INDEX where a row has no next token) and, `within_doc`, position_ids. Widened as one array and
    split into row-slice views, so a pack of several batches costs one conversion (and one pin)."""
    rows, lengths, sizes = pack
    tokens = rows.astype(np.int64)                  # (N, T+1)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    T = inputs.shape[1]
    if (lengths < T + 1).any():                     # a short last window or filler rows
        real = np.arange(T) < (lengths - 1)[:, None]
        inputs = np.where(real, inputs, eos_id)
        targets = np.where(real, targets, IGNORE_INDEX)
    whole = {"input_ids": torch.from_numpy(np.ascontiguousarray(inputs)),
             "targets": torch.from_numpy(np.ascontiguousarray(targets))}
    if within_doc:
        whole["position_ids"] = torch.from_numpy(doc_positions(inputs, eos_id))
    if pin_memory:
        whole = {k: v.pin_memory() for k, v in whole.items()}
    out, lo = [], 0
    for n in sizes:
        out.append({k: v[lo: lo + n] for k, v in whole.items()})
        lo += n
    return out


def _join(group: list[Pack]) -> Pack:
    """Packs of consecutive batches as one pack: one hand-off."""
    if len(group) == 1:
        return group[0]
    return (np.concatenate([p[0] for p in group]), np.concatenate([p[1] for p in group]),
            tuple(n for p in group for n in p[2]))


def doc_positions(inputs: np.ndarray, eos_id: int) -> np.ndarray:
    """(B, T) positions counting from each document's first token in the window (restart after EOS)."""
    B, T = inputs.shape
    t = np.broadcast_to(np.arange(T), (B, T))
    start = np.zeros((B, T), dtype=bool)
    start[:, 0] = True
    start[:, 1:] = inputs[:, :-1] == eos_id
    return t - np.maximum.accumulate(np.where(start, t, 0), axis=1)


def _worker() -> tuple[int, int]:
    info = get_worker_info()
    return (0, 1) if info is None else (info.id, info.num_workers)


class TrainStream(IterableDataset):
    """Endless batches for one rank from global batch `start_batch` on, as packs of `per_transfer`
    consecutive batches: pack c holds batches start + c*K, ..., start + c*K + K-1 and goes to worker
    c % W, so the DataLoader's round-robin still hands the batches out in order; see the module docstring."""

    def __init__(self, windows: Windows, batch_size: int, rank: int, world_size: int, start_batch: int = 0,
                 per_transfer: int = 1):
        super().__init__()
        self.windows, self.batch_size, self.rank, self.world_size = windows, batch_size, rank, world_size
        self.start_batch, self.per_transfer = start_batch, per_transfer

    def __iter__(self) -> Iterator[Pack]:
        w, num_workers = _worker()
        B, GB, K = self.batch_size, self.batch_size * self.world_size, self.per_transfer
        c = w
        while True:
            firsts = [g * GB + self.rank * B for g in range(self.start_batch + c * K, self.start_batch + c * K + K)]
            yield _join([self.windows.pack(range(first, first + B)) for first in firsts])
            c += num_workers


class EpochStream(IterableDataset):
    """One pass over one epoch's windows (evaluation, or counting): window j goes to rank j % R, then
    this rank's windows in batches of B, as packs of `per_transfer` consecutive batches, pack c to
    worker c % W. The last batch may be short.

    Every rank gets the same number of rows (filler rows without targets where the windows do not
    divide evenly), so collective forwards (DDP, FSDP) stay in step."""

    def __init__(self, windows: Windows, batch_size: int, rank: int = 0, world_size: int = 1, epoch: int = 0,
                 per_transfer: int = 1):
        super().__init__()
        self.windows, self.batch_size, self.rank, self.world_size, self.epoch = \
            windows, batch_size, rank, world_size, epoch
        self.per_transfer = per_transfer

    def __iter__(self) -> Iterator[Pack]:
        w, num_workers = _worker()
        B, K = self.batch_size, self.per_transfer
        base = self.epoch * self.windows.per_epoch
        mine: list[int | None] = list(range(self.rank, self.windows.per_epoch, self.world_size))
        mine += [None] * (-(-self.windows.per_epoch // self.world_size) - len(mine))
        keys = [None if j is None else base + j for j in mine]
        batches = -(-len(keys) // B)
        for c in range(w, -(-batches // K), num_workers):
            yield _join([self.windows.pack(keys[i * B: (i + 1) * B]) for i in range(c * K, min(c * K + K, batches))])


def _as_is(pack: _T) -> _T:
    # the DataLoader's default conversion would turn the pack's arrays into tensors in the worker,
    # which is the costly hand-off this module avoids; module level, so spawned workers can pickle it
    return pack


class PackLoader:
    """A DataLoader over one of our streams, iterated as batches: workers hand over packs of
    `prefetch` batches, one pack in flight per worker, so a worker holds at most `prefetch` batches
    ready (as before, when it held `prefetch` batches of one each); the main process unpacks them
    (`unpack`), pinning there if asked. Without workers, packs hold one batch."""

    def __init__(self, dataset: TrainStream | EpochStream, num_workers: int = 0, prefetch: int = 2,
                 pin_memory: bool = False):
        dataset = copy.copy(dataset)       # the caller's dataset keeps its own per_transfer
        dataset.per_transfer = prefetch if num_workers > 0 else 1
        extra: dict[str, Any] = {"prefetch_factor": 1} if num_workers > 0 else {}
        self.loader = DataLoader(dataset, batch_size=None, num_workers=num_workers, collate_fn=_as_is, **extra)
        self.eos_id, self.within_doc = dataset.windows.shards.eos_id, dataset.windows.within_doc
        self.shards = dataset.windows.shards
        self.pin_memory = pin_memory

    def __iter__(self) -> Iterator[Batch]:
        for pack in self.loader:
            self.shards.check_ids(pack[0])  # an altered shard stops here with a message, not in the embedding
            yield from unpack(pack, self.eos_id, self.within_doc, self.pin_memory)


def data_loader(dataset: TrainStream | EpochStream, num_workers: int = 0, prefetch: int = 2,
                pin_memory: bool = False) -> PackLoader:
    """Our streams' batches through `num_workers` DataLoader workers, `prefetch` batches per worker at most."""
    return PackLoader(dataset, num_workers, prefetch, pin_memory)


class StreamLoader:
    """The Trainer's side of the stream: `next_batch()`, the epoch, and an exact, resumable cursor.

    Rank and world size default to torchrun's RANK / WORLD_SIZE. Workers run ahead by at most
    `prefetch` batches each; the cursor counts only batches handed to the caller, so a state
    saved at any moment resumes at the next batch this rank would have trained on.
    """

    def __init__(self, windows: Windows, batch_size: int, rank: int | None = None, world_size: int | None = None,
                 num_workers: int = 0, prefetch: int = 2, pin_memory: bool | None = None):
        if batch_size < 1 or num_workers < 0 or prefetch < 1:
            raise KilnError(f"batch_size and prefetch must be >= 1 and num_workers >= 0 "
                            f"(got {batch_size}, {prefetch}, {num_workers})")
        self.windows, self.batch_size = windows, batch_size
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self.world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
        self.num_workers, self.prefetch = num_workers, prefetch
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.batches = 0          # global batches handed out (every rank moves in step)
        self._iter: Iterator[Batch] | None = None

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def next_window(self) -> int:
        return self.batches * self.global_batch

    @property
    def epoch(self) -> int:
        return self.next_window // self.windows.per_epoch

    @property
    def batches_per_epoch(self) -> int:
        return max(1, self.windows.per_epoch // self.global_batch)

    def check_size(self) -> None:
        w = self.windows
        if w.per_epoch < self.global_batch:
            raise KilnError(f"{w.shards.root}: split {w.shards.split!r} has {w.tokens} tokens, {w.per_epoch} window(s) "
                            f"of {w.seq_len}+1, fewer than one global batch ({self.batch_size} per process x "
                            f"{self.world_size} processes)")

    def next_batch(self) -> Batch:
        if self._iter is None:
            stream = TrainStream(self.windows, self.batch_size, self.rank, self.world_size, start_batch=self.batches)
            self._iter = iter(data_loader(stream, self.num_workers, self.prefetch, self.pin_memory))
        batch = next(self._iter)
        self.batches += 1
        return batch

    def close(self) -> None:
        """Stop the workers (dropping the iterator shuts them down); the cursor stays."""
        self._iter = None

    def state_dict(self) -> dict[str, Any]:
        w, k = self.windows, self.next_window
        return {"kind": "token-stream", "split": w.shards.split, "seed": w.seed, "seq_len": w.seq_len,
                "tokens": w.tokens, "windows_per_epoch": w.per_epoch, "batch_size": self.batch_size,
                "world_size": self.world_size, "num_workers": self.num_workers,
                "next_window": k, "epoch": self.epoch, "window_in_epoch": k % w.per_epoch,
                "token_offset": (k % w.per_epoch) * w.seq_len, "shard_order": w.order(self.epoch).tolist(),
                "rank_next_window": [k + r * self.batch_size for r in range(self.world_size)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "token-stream":
            raise KilnError(f"the data state is not a token stream's (kind {state.get('kind')!r})")
        w = self.windows
        mine = {"split": w.shards.split, "seed": w.seed, "seq_len": w.seq_len, "tokens": w.tokens,
                "global batch": self.global_batch}
        theirs = {**{k: state[k] for k in ("split", "seed", "seq_len", "tokens")},
                  "global batch": state["batch_size"] * state["world_size"]}
        changed = [f"{k} {theirs[k]!r} -> {mine[k]!r}" for k in mine if mine[k] != theirs[k]]
        if changed:
            raise KilnError("the saved token-stream position does not fit this stream: " + "; ".join(changed))
        assert state["next_window"] % self.global_batch == 0, "a stream cursor always sits on a global batch"
        self.batches = state["next_window"] // self.global_batch
        self.close()
