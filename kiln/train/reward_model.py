"""A trained reward model as a reward function: `load_reward(DIR)` -> a batched callable of GRPO's reward
signature (`f(prompts, completions, completion_ids, **columns) -> list[float]`, kiln.train.rewards).

DIR is an exported reward model (an HF directory whose head is a one-label sequence classifier, as the
reward-model recipe writes), a checkpoint of such a run (`ckpt-N`, its `model/`), or the run directory (its
newest complete checkpoint). Each completion is scored after its prompt, tokenized as the reward model was
trained (kiln.data.reward.side_ids: a string gets the EOS appended; a conversation goes through the chat
template), in batches of `batch_size`, right-padded with the model's pad id, on `device` (default: this
process's device, as the policy's), frozen and in eval mode.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kiln.data.reward import side_ids
from kiln.errors import KilnError
from kiln.models.auto import load_pretrained
from kiln.models.tasks import SEQUENCE_CLASSIFICATION
from kiln.parallel.world import pick_device
from kiln.train.shares import model_dir_of

__all__ = ["RewardModelFn", "load_reward", "reward_model_dir"]


def reward_model_dir(path: str | os.PathLike, search: Sequence[Path] = ()) -> Path:
    """The HF directory of `path`: itself, a checkpoint's `model/`, or a run's newest checkpoint's (kiln.train.shares)."""
    return model_dir_of(path, search, "reward model")


class RewardModelFn:
    """A frozen one-label sequence classifier scoring prompt + completion; one call scores a whole list."""

    def __init__(self, model: torch.nn.Module, source: Path, batch_size: int):
        self.model, self.source, self.batch_size = model, source, batch_size
        self.__name__ = f"model_{source.parent.name if source.name == 'model' else source.name}"  # reward/<name>
        self.device = next(model.parameters()).device
        self.limit = getattr(model.config, "max_position_embeddings", None)
        self.template = None

    def ids(self, prompt: Any, completion: Any, where: str) -> list[int]:
        if isinstance(prompt, str) != isinstance(completion, str):
            raise KilnError(f"{where}: the prompt and the completion must both be strings or both message lists "
                            f"(got {type(prompt).__name__} and {type(completion).__name__})")
        if not isinstance(prompt, str) and self.template is None:
            self.template = self.model.tokenizer.chat()
        seq = side_ids(self.model.tokenizer, prompt + completion, where, self.template)
        if self.limit is not None and len(seq) > self.limit:
            raise KilnError(f"{where}: prompt + completion is {len(seq)} tokens, beyond the reward model's "
                            f"{self.limit} positions ({self.source})")
        return seq

    @torch.no_grad()
    def __call__(self, prompts: Sequence[Any], completions: Sequence[Any], completion_ids: Any = None,
                 **_: Any) -> list[float]:
        if len(prompts) != len(completions):
            raise KilnError(f"reward model {self.source}: {len(prompts)} prompts for {len(completions)} completions")
        seqs = [self.ids(p, c, f"reward model {self.source}, completion {i}")
                for i, (p, c) in enumerate(zip(prompts, completions))]
        pad = self.model.config.pad_token_id
        out: list[float] = []
        for s in range(0, len(seqs), self.batch_size):
            part = seqs[s:s + self.batch_size]
            width = max(len(x) for x in part)
            ids = torch.full((len(part), width), pad, dtype=torch.long)
            attn = torch.zeros((len(part), width), dtype=torch.long)
            for i, x in enumerate(part):
                ids[i, :len(x)], attn[i, :len(x)] = torch.tensor(x), 1
            logits = self.model(input_ids=ids.to(self.device), attention_mask=attn.to(self.device)).logits
            out += logits[:, 0].float().cpu().tolist()
        return out


def load_reward(path: str | os.PathLike, *, device: str | torch.device | None = None, batch_size: int = 16,
                search: Sequence[Path] = ()) -> RewardModelFn:
    """The reward model at `path` (see reward_model_dir) as a batched reward function on `device` (default:
    this process's, LOCAL_RANK's GPU where there is one)."""
    if batch_size < 1:
        raise KilnError(f"reward model batch_size must be >= 1, got {batch_size}")
    src = reward_model_dir(path, search)
    model = load_pretrained(src)
    if model.task != SEQUENCE_CLASSIFICATION or model.config.num_labels != 1:
        raise KilnError(f"{src}: not a reward model: a one-label sequence classifier is scored, this is a "
                        f"{model.task!r} head with {model.config.num_labels} outputs")
    if model.tokenizer is None:
        raise KilnError(f"{src}: no tokenizer files; the reward model tokenizes the completions itself")
    if model.config.pad_token_id is None:
        raise KilnError(f"{src}: config.json has no pad_token_id, which the score is read past")
    dev = torch.device(device) if device is not None else pick_device("auto", int(os.environ.get("LOCAL_RANK", "0")))
    model = model.to(dev).eval().requires_grad_(False)
    return RewardModelFn(model, src, batch_size)
