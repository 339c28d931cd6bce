"""The part every runner of a family with recurrent state shares (kiln.engine.hybrid, kiln.engine.mamba): how
a run finds each sequence's state.

A step hands `_run` a `states(layer)` callable: per sequence of the call, its rows and a copy of its state
tensors from the pool's slot (kiln.engine.cache), and a function that writes the state after its last token
back into that slot. The scoring forward hands one sequence from zeroed state, written nowhere. The layers
update a state by value, never in place, so the scoring forward stays differentiable.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from kiln.engine.cache import BlockPool
from kiln.engine.runner import DecoderRunner, Piece

# per layer with state, one entry per sequence of the call: (row start, row end, its state tensors, write back,
# engfeat: row -> a function keeping the state after that row (a prefix boundary: kiln.engine.prefix_state) or None)
States = Callable[[int], list[tuple[int, int, list[torch.Tensor], Callable | None, dict[int, Callable] | None]]]


class StateRunner(DecoderRunner, ABC):
    """A runner whose layers (some or all) keep a state per sequence; `state_shapes(i)` says which (each
    registered subclass defines it: an abstract method, so a subclass without it cannot be made)."""

    @classmethod
    def accepts(cls, model) -> bool:
        return False  # a base: the registered subclasses say which models they run

    @abstractmethod
    def state_shapes(self, i: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Layer i's state tensors per sequence ([] for a layer without state)."""

    def state_pool(self, num_blocks: int, block_size: int, seqs: int,
                   slots: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> BlockPool:
        """The pool with per-token `slots` and a state slot per seat."""
        return BlockPool(num_blocks, block_size, slots, self.dtype, self.device,
                         [self.state_shapes(i) for i in range(self.num_layers)], seqs)

    def _step_extras(self, pieces: list[Piece], rows: dict[int, tuple[int, int]], pool: BlockPool) -> tuple:
        snaps = pool.snapshots  # engfeat

        def states(i: int):
            layer = pool.states[i]
            out = []
            for j, p in enumerate(pieces):
                def back(new: list[torch.Tensor], slot: int = p.state) -> None:
                    for t, v in zip(layer, new):
                        t[slot].copy_(v)

                marks = snaps.savers(i, p.state, rows[j][0]) if snaps is not None else None  # engfeat
                out.append((*rows[j], [t[p.state].clone() for t in layer], back, marks))
            return out

        return (states,)

    def _packed_extras(self, bounds: list[tuple[int, int]]) -> tuple:
        def states(i: int):  # each sequence from its own zeroed state, written nowhere
            return [(s, e, [torch.zeros(shape, dtype=dt, device=self.device)
                            for shape, dt in self.state_shapes(i)], None, None) for s, e in bounds]

        return (states,)

    def _recur(self, i: int, rows: torch.Tensor, out_width: int, states: States,
               token: Callable[[list[torch.Tensor], torch.Tensor], tuple[list[torch.Tensor], torch.Tensor]]
               ) -> torch.Tensor:
        """Layer i's outputs (N, out_width) from its projected rows (N, .): `token(state, row)` -> (new state,
        output) for one token of one sequence at a time (fixed shapes), in each sequence's order."""
        y = rows.new_empty((rows.shape[0], out_width))
        for s, e, state, back, marks in states(i):
            outs = []
            for t in range(s, e):
                state, o = token(state, rows[t])
                outs.append(o)
                if marks and t in marks:  # engfeat: the state at a prefix boundary, kept for later prompts
                    marks[t](state)
            if outs:
                y[s:e] = torch.stack(outs)
            if back is not None:
                back(state)
        return y
