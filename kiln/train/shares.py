"""What the post-training recipes share: each rank's share of the eval examples in equal batch counts, the step's
real token count for the metrics record, and the model directory a DIR_OR_RUN names (a teacher, a reward model).

Ranks get equally many eval batches (sharded weights gather in every forward), the short ones repeating an
example whose `weight` is 0, so sums over `weight` count every example once.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kiln.data.loader import pad_collate
from kiln.errors import KilnError

Example = dict[str, torch.Tensor]


def eval_share(examples: list[Example], rank: int, shards: int, batch_size: int, device: torch.device,
               limit: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's batches of `examples` (with a float64 `weight` per row: 1, or 0 for a repeat) on `device`."""
    total = len(examples)
    per_rank = math.ceil(total / shards)
    mine = list(range(rank, total, shards))
    weights = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))
    mine += [mine[-1] if mine else 0] * (per_rank - len(mine))
    for b, s in enumerate(range(0, per_rank, batch_size)):
        if limit is not None and b >= limit:
            return
        batch = pad_collate([examples[i] for i in mine[s:s + batch_size]])
        batch["weight"] = torch.tensor(weights[s:s + batch_size], dtype=torch.float64)
        yield {k: v.to(device) for k, v in batch.items()}


def record_tokens(record: dict[str, Any], samples: float, tokens: float) -> None:
    """The loader counts no tokens in pair or unpaired-preference examples: the step's real ones (all ranks)."""
    seconds = samples / record["samples_per_s"] if record.get("samples_per_s") else math.nan
    record["tokens"], record["tokens_per_s"] = int(tokens), tokens / seconds


def model_dir_of(path: str | os.PathLike, search: Sequence[Path] = (), what: str = "model") -> Path:
    """The HF directory `path` names: itself (config.json), a checkpoint's `model/`, or a run directory's newest
    complete checkpoint's; a relative path is looked for under each of `search` first, then as given."""
    from kiln.train.checkpoint import latest_checkpoint

    p = Path(path)
    if not p.is_absolute():
        p = next((s / p for s in search if (s / p).exists()), p)
    if (p / "config.json").is_file():
        return p
    if (p / "model" / "config.json").is_file():
        return p / "model"
    if p.is_dir() and any(p.glob("ckpt-*")):
        ckpt = latest_checkpoint(p)
        if ckpt is not None:
            return ckpt / "model"
    raise KilnError(f"{path}: no {what} here (an HF directory with config.json, a checkpoint ckpt-N or a run "
                    "directory with checkpoints)")
