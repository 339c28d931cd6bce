"""A resumable, seeded, rank-sharded batch loader over an in-memory dataset.

Epoch e visits the examples in `randperm(n, seed + e)` order, global batch after global batch
(batch_size x world_size, the last partial one dropped); rank r takes its slice of each global
batch. The whole position is two integers (epoch, cursor), so a checkpoint stores it exactly and
a resumed run sees the very batches an uninterrupted run would.

With `group_by_length` (fine-tuning data of varied lengths) the epoch's permutation is regrouped so
batches hold examples of similar length and dynamic padding wastes little: the shuffled order is cut
into mega-batches of `MEGA` optimizer steps, each sorted by length (stable, longest first) and cut
into steps (`window` global batches: one optimizer step's micro-batches together, so grad_accum
k x b and one batch of k*b see the same examples), whose order is then shuffled. It is still a pure
function of (seed, epoch), so the cursor resumes it exactly, and it covers the same examples per epoch.
`take_pad_fraction()` reports the share of padded slots in the batches drawn since its last call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from kiln.constants import IGNORE_INDEX
from kiln.errors import KilnError

Batch = dict[str, torch.Tensor]
PAD_VALUES = {"labels": IGNORE_INDEX, "attention_mask": 0, "token_type_ids": 0}
IMAGE_PATCH_KEYS = ("pixel_values", "image_grid_thw")  # (patches, D) and (images, 3): concatenated, not stacked
MEGA = 50  # optimizer steps per length-sorted mega-batch: long enough to group well, short enough to stay random


def pad_collate(examples: Sequence[dict[str, torch.Tensor]], pad_id: int = 0) -> Batch:
    """Stack 0-d tensors; right-pad 1-D ones (input_ids with `pad_id`, labels with -100); add attention_mask.

    Image-text rows (`image_grid_thw`) put their images' patches and grids one after another.
    Packed rows (examples with position_ids) get no attention_mask: their positions mark where each
    sample starts, and the padding tail counts 0, 1, ... as one more sample of its own.
    """
    batch: Batch = {}
    concat = IMAGE_PATCH_KEYS if "image_grid_thw" in examples[0] else ()
    for key in examples[0]:
        values = [ex[key] for ex in examples]
        if key in concat:  # images as patches (image-text rows): every row's images, in row order
            batch[key] = torch.cat(values)
            continue
        if values[0].dim() == 0 or values[0].dim() > 1:  # scalars; images (C, H, W) of one size
            batch[key] = torch.stack(values)
            continue
        width = max(v.size(0) for v in values)
        fill = pad_id if key == "input_ids" else PAD_VALUES.get(key, 0)
        out = torch.full((len(values), width), fill, dtype=values[0].dtype)
        for i, v in enumerate(values):
            out[i, : v.size(0)] = v
            if key == "position_ids":
                out[i, v.size(0):] = torch.arange(width - v.size(0))
        batch[key] = out
    if "input_ids" in batch and "attention_mask" not in batch and "position_ids" not in batch:
        lengths = torch.tensor([ex["input_ids"].size(0) for ex in examples])
        batch["attention_mask"] = (torch.arange(batch["input_ids"].size(1))[None, :] < lengths[:, None]).long()
    return batch


def batch_tokens(batch: dict[str, torch.Tensor], loader: Any) -> int:
    """Real tokens in a batch just drawn from `loader`: what the loader counted (a packed row's padding tail
    left out), else the attention mask's, else the masks of every side of a paired batch (`anchor_attention_mask`,
    ...: sentence pairs), else every input id (token streams have no padding)."""
    counted = getattr(loader, "last_tokens", None)
    if counted is not None:
        return int(counted)
    if "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    sides = [v for k, v in batch.items() if k.endswith("_attention_mask") and isinstance(v, torch.Tensor)]
    if sides:
        return sum(int(m.sum()) for m in sides)
    return batch["input_ids"].numel() if "input_ids" in batch else 0


class Loader:
    """Batches of `dataset` for one rank, with `state_dict()` / `load_state_dict()` for exact resume."""

    def __init__(self, dataset: Sequence[Any], batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, collate: Callable[[list[Any]], Any] | None = None, pad_id: int = 0,
                 group_by_length: bool = False, window: int = 1):
        self.dataset, self.batch_size, self.seed = dataset, batch_size, seed
        self.rank, self.world_size, self.shuffle = rank, world_size, shuffle
        self.collate = collate or (lambda exs: pad_collate(exs, pad_id))
        self.group_by_length, self.window = group_by_length and shuffle, window  # window: micro-batches per step
        self.epoch, self.cursor = 0, 0   # cursor: examples of this epoch consumed by all ranks together
        self._order: tuple[int, torch.Tensor] | None = None
        self._lengths: torch.Tensor | None = None
        self._padding = [0, 0]  # padded slots, all slots: since the last take_pad_fraction()

    def check_size(self) -> None:
        """Training needs at least one full global batch per epoch."""
        if len(self.dataset) < self.global_batch:
            raise KilnError(f"the training data has {len(self.dataset)} examples, fewer than one global batch "
                            f"({self.batch_size} per process x {self.world_size} processes)")

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    @property
    def batches_per_epoch(self) -> int:
        return len(self.dataset) // self.global_batch

    def _epoch_order(self) -> torch.Tensor:
        if self._order is None or self._order[0] != self.epoch:
            n = len(self.dataset)
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                order = torch.randperm(n, generator=g)
                if self.group_by_length:
                    order = self._grouped(order, g)
            else:
                order = torch.arange(n)
            self._order = (self.epoch, order)
        return self._order[1]

    def lengths(self) -> torch.Tensor:
        """Tokens per example (input_ids length; 1 for examples without them), read once."""
        if self._lengths is None:
            self._lengths = torch.tensor([_length(ex) for ex in self.dataset], dtype=torch.long)
        return self._lengths

    def _grouped(self, order: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """`order` regrouped: mega-batches sorted by length, cut into steps, steps shuffled within each."""
        step = self.global_batch * self.window
        lengths = self.lengths()
        out = []
        for mega in order.split(step * MEGA):
            mega = mega[torch.sort(lengths[mega], descending=True, stable=True).indices]
            full = len(mega) // step
            steps = list(mega[: full * step].split(step))
            out += [steps[i] for i in torch.randperm(full, generator=g).tolist()]
            out.append(mega[full * step:])  # a partial step stays last, so step boundaries stay aligned
        return torch.cat(out)

    def next_batch(self) -> Any:
        """The next batch for this rank, rolling over to the next epoch when this one runs out."""
        if self.cursor + self.global_batch > len(self.dataset):
            self.epoch, self.cursor = self.epoch + 1, 0
        order = self._epoch_order()
        start = self.cursor + self.rank * self.batch_size
        idx = order[start: start + self.batch_size].tolist()
        self.cursor += self.global_batch
        examples = [self.dataset[i] for i in idx]
        sizes = [_length(ex) for ex in examples]
        self._padding[0] += len(sizes) * max(sizes) - sum(sizes)
        self._padding[1] += len(sizes) * max(sizes)
        self.last_tokens = sum(sizes)  # real tokens of this batch (a packed row's padding tail left out)
        return self.collate(examples)

    def take_pad_fraction(self) -> float | None:
        """Padded share of the token slots of the batches drawn since the last call (None: none drawn)."""
        pad, slots = self._padding
        self._padding = [0, 0]
        return pad / slots if slots else None

    def __iter__(self) -> Iterator[Any]:
        """One pass over everything, in order, this rank's share only, the last batch possibly short (eval)."""
        mine = list(range(self.rank, len(self.dataset), self.world_size))
        for i in range(0, len(mine), self.batch_size):
            yield self.collate([self.dataset[j] for j in mine[i: i + self.batch_size]])

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed, "size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["size"] != len(self.dataset) or state["seed"] != self.seed:
            raise KilnError(f"the data loader state is for {state['size']} examples with seed {state['seed']}; "
                            f"this data has {len(self.dataset)} examples with seed {self.seed}")
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def _length(example: Any) -> int:
    ids = example.get("input_ids") if isinstance(example, dict) else None
    return int(ids.shape[0]) if isinstance(ids, torch.Tensor) and ids.dim() == 1 else 1
