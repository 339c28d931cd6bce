"""The paged KV cache: fixed-size blocks of key/value slots in one pool per layer, lent to sequences.

A sequence holds a block table (block ids in position order); token t lives in slot t % block_size of block
table[t // block_size]. Blocks are reference-counted: the n completions of one request share the prompt's full
blocks (the prompt is stored and prefilled once); a block is written only by a sequence that holds it alone
(the prompt's last, partly filled block is copied for each completion when they part: copy-on-write). A block
returns to the free list when its last holder lets go (finish, cancel, preemption).

Full prompt blocks are also remembered by their content (a digest of every token up to the block's end): a
later request whose prompt starts the same (a common system prompt, the same question again) takes those blocks
instead of prefilling them. A freed block keeps its content until it is lent again (the least recently freed
first), so a remembered block may outlive its request. Reusing keys is exact: a token's keys do not depend on
what was computed beside it.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.engine.prefix_state import StateSnapshots  # engfeat

# tokens per block by default (Engine, token_logps): a sequence's last block is on average half empty, so a block
# of 8 keeps chat-length sequences (tens of tokens) near 1.1x slots per token held where 16 gives 1.2-1.3x; the
# attention's extra per-block products cost little beside the LM head
BLOCK_SIZE = 8


class BlockPool:
    """keys / values per layer: (num_blocks, block_size, *slot shape), zeros at first. Each layer names its own
    key and value slot shapes (`slots`): (kv_heads, head_dim) each for an attention decoder, (1, kv_lora_rank)
    and (1, qk_rope_head_dim) for latent attention (kiln.engine.mla). A block is not
    cleared when freed or lent again, and the decode step pads its block tables with block 0 (any sequence's):
    a slot a query may read without it being written for that sequence can hold another request's numbers, inf
    or NaN included. `exact.attend` masks both the score and the values of every slot past the query's
    position, so such numbers never reach a row."""

    def __init__(self, num_blocks: int, block_size: int, slots: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
                 dtype: torch.dtype, device: torch.device,
                 states: Sequence[Sequence[tuple[tuple[int, ...], torch.dtype]]] = (), num_states: int = 0):
        if num_blocks < 1 or block_size < 1:
            raise KilnError(f"the KV cache needs kv_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.keys = [torch.zeros((num_blocks, block_size, *k), dtype=dtype, device=device) for k, _ in slots]
        self.values = [torch.zeros((num_blocks, block_size, *v), dtype=dtype, device=device) for _, v in slots]
        self.block_size, self.num_blocks = block_size, num_blocks
        self.refs = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))  # lent from the left: the least recently freed first
        self.known: dict[bytes, int] = {}   # prefix digest -> the block holding that prefix's last block
        self.key_of: dict[int, bytes] = {}
        # per-sequence recurrent state (kiln.engine.hybrid): per layer, its tensors (num_states, *shape), none for
        # an attention layer; a slot is lent to one sequence at a time, zeroed when lent
        self.states = [[torch.zeros((num_states, *shape), dtype=dt, device=device) for shape, dt in layer]
                       for layer in states]
        self.free_states: deque[int] = deque(range(num_states) if any(self.states) else ())
        self.snapshots: StateSnapshots | None = None  # engfeat: states at prefix boundaries (kiln.engine.prefix_state)

    @property
    def has_states(self) -> bool:
        """Whether sequences hold recurrent state: their keys alone do not say what follows a block, so a prefix
        is reused only up to a boundary whose state was kept (engfeat: kiln.engine.prefix_state) and no completion
        joins another's recomputed prompt (kiln.engine.scheduler)."""
        return any(self.states)

    def allocate_state(self) -> int:
        if not self.free_states:
            raise KilnError("the engine is out of state slots")  # one per seat: an internal slip
        i = self.free_states.popleft()
        for layer in self.states:
            for t in layer:
                t[i].zero_()
        return i

    def release_state(self, i: int) -> None:
        assert i not in self.free_states, f"state slot {i} released twice"
        self.free_states.append(i)

    def copy_state(self, src: int, dst: int) -> None:
        """A fork: the leader's state (after the prompt) into each completion's own slot."""
        for layer in self.states:
            for t in layer:
                t[dst].copy_(t[src])

    @property
    def num_free(self) -> int:
        return len(self.free)

    def bytes_per_block(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (*self.keys, *self.values))

    def bytes_per_state(self) -> int:
        return sum(t[0].numel() * t.element_size() for layer in self.states for t in layer)

    def allocate(self) -> int:
        if not self.free:
            raise KilnError("the KV cache is out of blocks")  # the scheduler checks first; an internal slip
        b = self.free.popleft()
        key = self.key_of.pop(b, None)
        if key is not None:  # its remembered content is overwritten from now on
            del self.known[key]
        self.refs[b] = 1
        return b

    @staticmethod
    def digest(prev: bytes, tokens: list[int]) -> bytes:
        """The key of a full block: its tokens after the key of the prefix before it."""
        return hashlib.blake2b(prev + b"|" + ",".join(map(str, tokens)).encode(), digest_size=16).digest()

    def remember(self, block: int, key: bytes) -> None:
        # (engfeat) with recurrent state too: a prefix is taken only up to a block whose state snapshot is kept
        if key not in self.known and block not in self.key_of:
            self.known[key], self.key_of[block] = block, key

    def forget(self) -> None:
        """Drop every remembered prefix (the model's weights changed: the keys they hold are stale)."""
        self.known.clear()
        self.key_of.clear()
        if self.snapshots is not None:  # engfeat
            self.snapshots.forget()

    def reuse(self, key: bytes) -> int | None:
        """The block remembered under `key`, now held once more, or None."""
        b = self.known.get(key)
        if b is None:
            return None
        if self.refs[b] == 0:
            self.free.remove(b)
        self.refs[b] += 1
        return b

    def share(self, block: int) -> None:
        assert self.refs[block] > 0, f"block {block} is not held"
        self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self.refs[b] > 0, f"block {b} released twice"
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)

    def copy(self, src: int, dst: int) -> None:
        """src's keys and values into dst, a block already lent (copy-on-write of a shared, partly filled block:
        the scheduler lends dst beforehand, so a fork never runs out of blocks halfway)."""
        assert self.refs[dst] > 0, f"block {dst} is not held"
        for pool in (*self.keys, *self.values):
            pool[dst].copy_(pool[src])

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (N, *the layer's slot shapes) into flat slots (N,) = block * block_size + offset."""
        self.keys[layer].view(-1, *k.shape[1:])[slots] = k.to(self.keys[layer].dtype)
        self.values[layer].view(-1, *v.shape[1:])[slots] = v.to(self.values[layer].dtype)

    def gather(self, layer: int, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's blocks (NB, block_size, *slot shape) of keys and values, contiguous, for `exact.attend`."""
        return self.keys[layer].index_select(0, table), self.values[layer].index_select(0, table)

    def held(self) -> int:
        return self.num_blocks - len(self.free)
