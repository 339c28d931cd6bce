"""What a run checks before any work: settings that cannot train, and a model, tokenizer and data
that do not fit each other. Each check fails with a message naming the key, file or tensor, so a bad
run stops in seconds instead of with an IndexError at step N.

    check_train_args(args)                          # lr, decay, betas, eps, clipping, epochs, cadences
    check_model_tokenizer(model, max_length, src)   # vocabularies, positions, dtypes vs precision
    check_examples(examples, model, task, what)     # ids, token types, lengths, something to learn
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import cast

import torch
from torch import nn

from kiln.constants import IGNORE_INDEX
from kiln.errors import ConfigError, KilnError
from kiln.hub.outdir import describe, holdings
from kiln.models.tasks import Task
from kiln.train.config import TrainSection
from kiln.train.trackers import check_trackers


def check_train_args(args: TrainSection) -> None:
    """The [train] numbers that would make the optimizer or the schedule misbehave without an error."""
    def bad(name: str, value: object, want: str) -> None:
        raise ConfigError(f"train.{name} must be {want}, got {value}")

    for name in ("lr", "weight_decay"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value >= 0):
            bad(name, value, "a finite number >= 0")
    if not (math.isfinite(args.eps) and args.eps > 0):
        bad("eps", args.eps, "a finite number > 0")
    if not all(math.isfinite(b) and 0.0 <= b < 1.0 for b in args.betas):
        bad("betas", list(args.betas), "two numbers within [0, 1)")
    if args.clip_grad_norm is not None and not (math.isfinite(args.clip_grad_norm) and args.clip_grad_norm >= 0):
        bad("clip_grad_norm", args.clip_grad_norm, "a finite number >= 0 (0 or unset: no clipping)")
    if args.epochs is not None and not (math.isfinite(args.epochs) and args.epochs > 0):
        bad("epochs", args.epochs, "a finite number > 0")
    # seed: numpy's generators (data order) take no negative seed (exit 70 from deep inside numpy before)
    for name in ("warmup_steps", "eval_every", "save_every", "early_stopping_patience", "seed"):
        if getattr(args, name) < 0:
            bad(name, getattr(args, name), ">= 0")
    if args.steps is not None and args.warmup_steps > args.steps:
        bad("warmup_steps", args.warmup_steps, f"at most train.steps ({args.steps})")
    check_trackers(args.report_to)  # a missing tracker library is named now, not at the first log line


def check_out_dir(out_dir: str | Path) -> None:
    """A new run's train.out_dir: no run there (that is a resume), nor a model, tokenizer or shard set."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"train.out_dir {out}: is a file, not a directory")
    found = holdings(out)
    if found.pop("a training run", None):
        from kiln.train.checkpoint import list_paths

        used = [p.name for p in (out / "metrics.jsonl", *list_paths(out)) if p.exists()]
        raise ConfigError(f"{out} already holds a run ({', '.join(used[:3]) or 'run_state.json'}); continue it "
                          "with --resume, or choose another train.out_dir")
    if found:
        raise ConfigError(f"train.out_dir {out}: already holds {describe(found)}; a run writes checkpoints and "
                          "metrics there, so choose an empty or new directory")


def position_limit(model: nn.Module) -> int | None:
    """How many tokens a learned position table lets the model read (None: no table, e.g. rotary)."""
    limit: int | None = None
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "position_embeddings" and isinstance(module, nn.Embedding):
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            # RoBERTa-style positions start after the padding index
            offset = cast(int, parent.pad_token_id) + 1 if getattr(parent, "padding_positions", False) else 0
            usable = module.num_embeddings - offset
            limit = usable if limit is None else min(limit, usable)
    return limit


def _table_size(model: nn.Module, leaf: str) -> int | None:
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == leaf and isinstance(module, nn.Embedding):
            return module.num_embeddings
    return None


def _vocab(model: nn.Module) -> int | None:
    return getattr(getattr(model, "config", None), "vocab_size", None)


def check_model_tokenizer(model: nn.Module, max_length: int | None, source: str, precision: str = "fp32") -> None:
    """The tokenizer's ids and the data's lengths fit the model; its dtypes fit the precision."""
    vocab, tok = _vocab(model), getattr(model, "tokenizer", None)
    if tok is not None and vocab is not None and tok.vocab_size > vocab:
        raise ConfigError(f"{source}: the tokenizer has {tok.vocab_size} tokens but the model's vocab_size is "
                          f"{vocab}; ids {vocab}..{tok.vocab_size - 1} would index past its embedding table. "
                          "Use the model's own tokenizer, or a model with vocab_size >= the tokenizer's")
    limit = position_limit(model)
    if max_length is not None and limit is not None and max_length > limit:
        raise ConfigError(f"data.max_length {max_length} is more than the {limit} positions the model of {source} "
                          f"has (max_position_embeddings); set data.max_length <= {limit}")
    if precision == "fp16":
        half = [n for n, p in model.named_parameters() if p.requires_grad and p.dtype == torch.float16]
        if half:
            raise ConfigError(f"train.precision = 'fp16' needs fp32 weights to scale gradients, but {source} holds "
                              f"fp16 parameters ({half[0]}, ...); use precision 'bf16' or 'fp32', or convert the "
                              "weights to fp32")


def _targets(task: Task, example: dict) -> int:
    """How many units of `example` carry a loss (token-level labels: those not ignored, after the task's shift)."""
    n = 0
    shift = getattr(task, "targets", None)  # token-level tasks map labels to the targets the loss sees
    for key in task.target_keys:
        t = example.get(key)
        if not isinstance(t, torch.Tensor):
            continue
        if shift is not None and t.dtype == torch.long and t.dim() == 1:
            t = shift(t.unsqueeze(0))
        n += int((t != IGNORE_INDEX).sum()) if t.dtype == torch.long else t.numel()
    return n


def check_examples(examples: Sequence[dict], model: nn.Module, task: Task, what: str, hint: str = "",
                   say: bool = True) -> None:
    """Encoded examples: something to learn, ids inside the vocabulary, token types and lengths the model has.
    Some examples with no target (an SFT reply cut off by max_length) are counted in one warning (`say`: this
    process is the one that speaks)."""
    if not examples:
        raise KilnError(f"{what}: no examples after encoding")
    empty = sum(_targets(task, ex) == 0 for ex in examples)
    if empty == len(examples):
        raise KilnError(f"{what}: nothing to learn: every target of its {len(examples)} example(s) is ignored"
                        + (f" ({hint})" if hint else ""))
    if empty and say:
        print(f"warning: {what}: {empty} of {len(examples)} example(s) have every target ignored, so nothing is "
              f"learned from them{f' ({hint})' if hint else ''}; {len(examples) - empty} carry signal",
              file=sys.stderr)
    vocab, types, limit = _vocab(model), _table_size(model, "token_type_embeddings"), position_limit(model)
    for i, ex in enumerate(examples):
        ids = ex.get("input_ids")
        if ids is None:
            continue
        if vocab is not None and ids.numel() and int(ids.max()) >= vocab:
            raise KilnError(f"{what}: example {i + 1} holds token id {int(ids.max())}, past the model's vocab_size "
                            f"{vocab}; the tokenizer and the model do not belong together")
        tt = ex.get("token_type_ids")
        if types is not None and tt is not None and tt.numel() and int(tt.max()) >= types:
            raise KilnError(f"{what}: example {i + 1} uses token type {int(tt.max())} but the model has "
                            f"type_vocab_size {types} (it takes no text pairs); drop data.text_pair_field")
        if limit is not None and ids.shape[-1] > limit:
            raise KilnError(f"{what}: example {i + 1} is {ids.shape[-1]} tokens, more than the model's {limit} "
                            f"positions; set data.max_length <= {limit}")
