"""Which tokens run in a step: continuous batching under a token budget, blocks lent per sequence.

Every sequence feeds tokens[computed:] (the tokens whose keys are not yet in the cache): one token while it
decodes, a chunk while its prompt is prefilled. A step takes every decoding sequence first (one token each),
then prefill chunks in arrival order until `step_tokens` is spent, so a long prompt never stalls the running
decodes. A request with n completions is admitted as one sequence that prefills the prompt once; when its last
prompt token's logits come, it forks into n (kiln.engine.engine). When the pool runs dry the youngest request
is preempted: its blocks are freed and it recomputes later (bit-identical: a token's numbers do not depend on
the batch). The blocks for the fork's copies of the prompt's partly filled last block are lent with the prompt's
last piece (the fork itself never allocates); a preempted, forked request recomputes the prompt once, its other
completions taking its full blocks, so no request ever holds more than the peak `add_request` checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.engine.cache import BlockPool
from kiln.engine.runner import Piece


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: Any                       # kiln.engine.params.SamplingParams
    order: int                        # arrival number (FIFO, preemption picks the largest)
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False              # the n completions exist (the prompt's logits came)
    copies: list[int] = field(default_factory=list)  # blocks lent for the fork's copies of the prompt's last block
    images: Any = None                # engvis: kiln.engine.vision.ImagePrompt of an image-text prompt


@dataclass
class Sequence:
    request: Request
    index: int
    tokens: list[int]
    generator: torch.Generator | None = None
    detok: Any = None
    table: list[int] = field(default_factory=list)
    computed: int = 0                 # tokens whose keys/values are in the pool
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    keys: list[bytes] = field(default_factory=list)  # content keys of its full blocks (kiln.engine.cache)
    state: int | None = None          # its recurrent-state slot (families with state: kiln.engine.hybrid)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.request.prompt_ids):]


class Scheduler:
    def __init__(self, pool: BlockPool, max_seqs: int, step_tokens: int):
        self.pool, self.max_seqs, self.step_tokens = pool, max_seqs, step_tokens
        self.waiting: list[Request] = []
        self.running: list[Request] = []  # admitted, in arrival order
        self.preemptions = 0              # requests preempted so far (their blocks freed, recomputed later)

    def seats(self) -> int:
        return sum(r.params.n for r in self.running)  # a request holds its n seats from admission on

    def blocks_for(self, tokens: int) -> int:
        return (tokens + self.pool.block_size - 1) // self.pool.block_size

    def peak_blocks(self, prompt: int, n: int, total: int) -> int:
        """The most blocks a request holds running alone: its prompt's full blocks once (shared), then each
        completion's own blocks (the copy of the prompt's partly filled last block among them) up to its last
        fed token (the last of `total` tokens is sampled, never fed). With recurrent state a preempted
        completion recomputes its prompt in blocks of its own (`_waits`): the prompt counts once per completion."""
        full = 0 if self.pool.has_states else prompt // self.pool.block_size
        return full + n * (self.blocks_for(total - 1) - full)

    def fork_copies(self, r: Request) -> int:
        """Blocks r's fork still needs: a copy of the prompt's partly filled last block per completion but one."""
        if r.forked or len(r.prompt_ids) % self.pool.block_size == 0:
            return 0
        return r.params.n - 1 - len(r.copies)

    def _need(self, r: Request) -> int:
        """Blocks r needs to run its next tokens and grow each completion once (its prompt's full blocks once)."""
        if not r.forked:
            return self.blocks_for(len(r.prompt_ids)) + self.fork_copies(r) + r.params.n
        live = [s for s in r.seqs if s.finish_reason is None]
        full = 0 if self.pool.has_states else len(r.prompt_ids) // self.pool.block_size
        return full + sum(self.blocks_for(len(s.tokens)) - full + 1 for s in live)

    def _admit(self) -> None:
        free = self.pool.num_free  # less what this call has admitted already: they take blocks in this step too
        while self.waiting:
            r = self.waiting[0]
            need = self._need(r)
            if self.seats() + r.params.n > self.max_seqs or (self.running and need > free):
                return
            free -= need
            self.running.append(self.waiting.pop(0))

    def preempt(self, victim: Request) -> None:
        """Free the request's blocks; its sequences recompute their tokens when they run again."""
        self.preemptions += 1
        for s in victim.seqs:
            self.pool.release(s.table)
            s.table, s.computed, s.keys = [], 0, []
            self._drop_state(s)
        self.pool.release(victim.copies)
        victim.copies = []
        self.running.remove(victim)
        self.waiting.insert(0, victim)

    def _grow(self, s: Sequence, upto: int) -> bool:
        """Blocks for tokens[:upto], and for the fork's copies when they end an unforked prompt (so the fork
        after the step never allocates); False, changing nothing, when the pool is dry."""
        need = self.blocks_for(upto) - len(s.table)
        copies = self.fork_copies(s.request) if upto == len(s.tokens) else 0
        if need + copies > self.pool.num_free:
            return False
        s.table += [self.pool.allocate() for _ in range(need)]
        s.request.copies += [self.pool.allocate() for _ in range(copies)]
        return True

    def _drop_state(self, s: Sequence) -> None:
        if s.state is not None:
            self.pool.release_state(s.state)
            s.state = None

    def _start(self, s: Sequence) -> None:
        """A sequence about to prefill from nothing: a zeroed state slot where the family keeps state (nothing
        is reused), else the remembered blocks its tokens start with (at least its last token is left to run:
        its logits are wanted)."""
        if self.pool.has_states:
            if s.state is None:
                s.state = self.pool.allocate_state()
                if self.pool.snapshots is not None:  # engfeat: from a kept prefix's state (kiln.engine.prefix_state)
                    self.pool.snapshots.start(self, s)
            return
        bs = self.pool.block_size
        for j in range((len(s.tokens) - 1) // bs):
            key = self.block_key(s, j)  # engvis
            block = self.pool.reuse(key)
            if block is None:
                break
            s.table.append(block)
            s.keys.append(key)
        s.computed = len(s.table) * bs

    def _waits(self, s: Sequence) -> bool:
        """A completion of a preempted, forked request holds nothing until the first live one has recomputed the
        prompt's full blocks, then takes them (the prompt is stored once, as at the fork: the add-time peak
        holds, rather than n copies of the prompt that could leave every completion waiting for a block). With
        recurrent state each recomputes alone: the state after the prompt's full blocks is nowhere kept."""
        r = s.request
        if not r.forked or s.table or s.computed or self.pool.has_states:
            return False
        lead = next(q for q in r.seqs if q.finish_reason is None)
        return s is not lead and lead.computed < len(r.prompt_ids) // self.pool.block_size * self.pool.block_size

    def remember(self, s: Sequence) -> None:
        """Remember s's full blocks whose keys are all in the pool now."""
        bs = self.pool.block_size
        for j in range(len(s.keys), s.computed // bs):
            s.keys.append(self.block_key(s, j))  # engvis
            self.pool.remember(s.table[j], s.keys[-1])
        if self.pool.snapshots is not None:  # engfeat: the states this step kept at its boundaries, filed by key
            self.pool.snapshots.commit(s)

    def schedule(self) -> list[tuple[Sequence, Piece]]:
        """This step's pieces. Decodes first, then prefill chunks, within the budget and the pool."""
        self._admit()
        for r in self.running:
            for s in r.seqs:
                if s.finish_reason is None and s.computed == 0 and not s.table and not self._waits(s):
                    self._start(s)
        while True:
            live = [s for r in self.running for s in r.seqs if s.finish_reason is None and not self._waits(s)]
            decodes = [s for s in live if len(s.tokens) - s.computed == 1]
            prefills = [s for s in live if len(s.tokens) - s.computed > 1]
            plan: list[tuple[Sequence, int]] = []
            budget = self.step_tokens
            dry = None
            for s in decodes + prefills:
                n = min(len(s.tokens) - s.computed, budget)
                if n <= 0:
                    break
                if not self._grow(s, s.computed + n):
                    dry = s
                    continue  # the sequences after it may still fit (this one waits for a freed block)
                plan.append((s, n))
                budget -= n
            if dry is None or len(self.running) == 1:
                break
            # out of blocks: the youngest request waits and recomputes later (plan again without it)
            self.preempt(max(self.running, key=lambda r: r.order))
        if self.pool.snapshots is not None:  # engfeat: slots for the states at the boundaries these pieces cross
            for s, n in plan:
                self.pool.snapshots.plan(s, n)
        return [(s, Piece(s.tokens[s.computed:s.computed + n], s.computed, s.table,
                          s.computed + n == len(s.tokens), s.state)) for s, n in plan]

    def finish(self, s: Sequence, reason: str) -> None:
        s.finish_reason = reason
        self.pool.release(s.table)
        s.table = []
        self._drop_state(s)
        r = s.request
        if r.forked and all(q.finish_reason is not None for q in r.seqs):
            self.running.remove(r)

    def block_key(self, s: Sequence, j: int) -> bytes:  # engvis
        """The content key of s's full block j: its tokens after the key of the prefix before it, and the digests
        of the images whose placeholders it holds (kiln.engine.vision): the same tokens with other images are
        other content."""
        bs = self.pool.block_size
        prev = s.keys[j - 1] if j else b""
        if s.request.images is not None:
            prev += s.request.images.salt(j * bs, (j + 1) * bs)
        return self.pool.digest(prev, s.tokens[j * bs:(j + 1) * bs])
