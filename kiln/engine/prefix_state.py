"""Prefix reuse for the families with recurrent state (Gated DeltaNet: Qwen3-Next, Qwen3.5 / 3.6; Mamba).

An attention layer's keys after a prefix are in the prefix's blocks, which the pool remembers by content
(kiln.engine.cache). A recurrent layer's state after a prefix is one tensor set per sequence, overwritten token by
token, so the blocks alone cannot stand for a prefix. `StateSnapshots` keeps copies of the whole per-sequence state
(every layer's conv window and recurrent state) at some block boundaries, under the content key of the block that
ends there (the same key the attention blocks are remembered by: the tokens up to the boundary and the digests of
the images among them, kiln.engine.scheduler.block_key):

- which boundaries (`plan`, when the scheduler makes a piece): in the prompt, every `every`-th block boundary and
  the prompt's last full-block boundary (the deepest a request with the same prompt can take: one token must run for its
  logits), so a repeated prompt, a GRPO group sent as separate requests, a common system prompt and a chat's
  earlier turns are found;
- when: inside the step, the runner copies the state after the boundary's token into a reserved snapshot slot
  (kiln.engine.state: `_recur` calls the slot's saver at that row), so no prefill chunk is cut for it; after the
  step, `commit` files the slot under the block's key;
- reuse (`start`, for a sequence about to prefill from nothing): the deepest boundary whose blocks are all still
  remembered and whose snapshot is kept; those blocks are shared, the snapshot is copied into the sequence's state
  slot, and the prefill starts there. The state is copied by value (no rounding), and a token's numbers do not
  depend on where a piece started, so a reused prefix gives the bits the full prefill gives.

Memory is bounded: `count` snapshot slots (default: what 256 MiB holds, at most 4 per seat), least recently used
dropped first; a slot reserved for a step in flight is never dropped. Nothing is held for a request: a snapshot
belongs to the engine, like a remembered block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kiln.engine.cache import BlockPool
    from kiln.engine.scheduler import Scheduler, Sequence

SNAPSHOT_BYTES = 256 << 20  # the default bound on the snapshots' memory
EVERY_BLOCKS = 4            # a snapshot every this many blocks (besides each prompt's last full block)


class StateSnapshots:
    """Copies of per-sequence recurrent state at block boundaries, by the boundary block's content key."""

    def __init__(self, pool: BlockPool, count: int, every: int = EVERY_BLOCKS):
        if count < 1 or every < 1:
            raise ValueError(f"state snapshots need count >= 1 and every >= 1, got {count} and {every}")
        self.pool, self.count, self.every = pool, count, every
        self.layers = [[torch.zeros((count, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in layer]
                       for layer in pool.states]
        self.free = list(range(count))
        self.kept: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        # per state slot of a sequence in this step: (row offset in its piece, snapshot slot, boundary position)
        self.pending: dict[int, list[tuple[int, int, int]]] = {}
        self.written: dict[int, int] = {}  # snapshot slot -> layers that saved into it this step
        self.hits = 0           # sequences that started from a snapshot
        self.reused_tokens = 0  # prompt tokens not run again thanks to them
        self.saved = 0          # snapshots filed

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer)

    # ---- saving -------------------------------------------------------------------------------------------
    def _reserve(self) -> int | None:
        if self.free:
            return self.free.pop()
        if not self.kept:
            return None  # every slot is reserved by this step already
        _, slot = self.kept.popitem(last=False)
        return slot

    def plan(self, s: Sequence, n: int) -> None:
        """Reserve a slot for each boundary the piece of s's next n tokens crosses that is kept."""
        bs = self.pool.block_size
        prompt_end = (len(s.request.prompt_ids) - 1) // bs * bs
        marks = []
        # prompt tokens only: decode boundaries (each sequence's own) would churn out the shared prompts' states
        for b in range((s.computed // bs + 1) * bs, min(s.computed + n, len(s.request.prompt_ids)) + 1, bs):
            if b % (bs * self.every) and b != prompt_end:
                continue
            slot = self._reserve()
            if slot is None:
                break
            marks.append((b - s.computed - 1, slot, b))
        if marks and s.state is not None:
            self.pending[s.state] = marks
        else:
            self.free += [slot for _, slot, _ in marks]

    def savers(self, layer: int, state_slot: int | None, row0: int) -> dict[int, Callable] | None:
        """For layer `layer` of the sequence in `state_slot` (its piece's rows from `row0`): packed row -> a function
        copying the state after that row into its snapshot slot (kiln.engine.state._recur)."""
        marks = self.pending.get(state_slot) if state_slot is not None else None
        if not marks or not self.layers[layer]:
            return None

        def saver(slot: int) -> Callable[[list[torch.Tensor]], None]:
            def save(state: list[torch.Tensor]) -> None:
                for dst, v in zip(self.layers[layer], state):
                    dst[slot].copy_(v)
                self.written[slot] = self.written.get(slot, 0) + 1
            return save

        return {row0 + off: saver(slot) for off, slot, _ in marks}

    def commit(self, s: Sequence) -> None:
        """After the step (s's block keys made): file s's snapshots under their blocks' keys."""
        stateful = sum(1 for layer in self.layers if layer)
        for _, slot, b in self.pending.pop(s.state, []) if s.state is not None else []:
            key = s.keys[b // self.pool.block_size - 1]
            if self.written.pop(slot, 0) != stateful:  # not every layer saved its state: nothing to file
                self.free.append(slot)
                continue
            if key in self.kept:  # the same prefix twice in one step
                self.free.append(slot)
                self.kept.move_to_end(key)
                continue
            self.kept[key] = slot
            self.saved += 1

    def drop_pending(self) -> None:
        """A step that did not run (it raised): its reserved slots back."""
        for marks in self.pending.values():
            self.free += [slot for _, slot, _ in marks]
        self.pending.clear()
        self.written.clear()

    def forget(self) -> None:
        self.drop_pending()
        self.free += list(self.kept.values())
        self.kept.clear()

    # ---- reuse --------------------------------------------------------------------------------------------
    def start(self, scheduler: Scheduler, s: Sequence) -> None:
        """s (a zeroed state slot lent) begins at the deepest kept boundary of its tokens: the remembered blocks up
        to it shared, the snapshot copied into its state slot; at least its last token is left to run."""
        bs, pool = self.pool.block_size, self.pool
        keys: list[bytes] = []
        best = None
        for j in range((len(s.tokens) - 1) // bs):
            s.keys = keys  # block_key reads the keys before block j
            key = scheduler.block_key(s, j)
            if key not in pool.known:
                break
            keys.append(key)
            if key in self.kept:
                best = j
        s.keys = []
        if best is None or s.state is None:
            return
        for key in keys[:best + 1]:
            block = pool.reuse(key)
            assert block is not None
            s.table.append(block)
            s.keys.append(key)
        slot = self.kept[keys[best]]
        self.kept.move_to_end(keys[best])
        for layer, snaps in zip(pool.states, self.layers):
            for t, snap in zip(layer, snaps):
                t[s.state].copy_(snap[slot])
        s.computed = (best + 1) * bs
        self.hits += 1
        self.reused_tokens += s.computed


def enable(pool: BlockPool, runner: object = None, count: int | None = None, every: int = EVERY_BLOCKS) -> None:
    """Give a pool with recurrent state its snapshots (`count` None: what SNAPSHOT_BYTES holds, at most 4 per state
    slot, at least 1); a pool without state gets none, and so does one whose runner (when given) does not keep its
    state through kiln.engine.state's `_recur` (its class says `keeps_prefix_state`)."""
    if not pool.has_states or (runner is not None and not getattr(type(runner), "keeps_prefix_state", False)):
        return
    if count is None:
        per = max(1, pool.bytes_per_state())
        count = max(1, min(4 * max(1, len(pool.free_states)), SNAPSHOT_BYTES // per))
    pool.snapshots = StateSnapshots(pool, count, every)
