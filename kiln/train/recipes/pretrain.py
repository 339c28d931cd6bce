"""pretrain: next-token loss on packed windows of `kiln tokenize` shards, held-out loss and perplexity.

`kiln train` runs it when `data.train` is a shard directory, or raw token ids (a .npy/.bin file or a folder
of them, kiln.data.raw; data.val_fraction holds out a part at train time). From Python:

    from kiln.data.shards import ShardSet
    from kiln.data.stream import StreamLoader, Windows
    from kiln.train import Trainer
    from kiln.train.recipes.pretrain import lm_step

    loader = StreamLoader(Windows(ShardSet("shards", "train"), seq_len=256), batch_size=8, num_workers=2)
    Trainer(model, loader, step=lm_step, steps=1000, out_dir="runs/lm").fit()

The stream's cursor is the loader's `state_dict()`, so it rides in every checkpoint (trainer.json)
and in RUN_DIR/run_state.json; a resumed run reads exactly the windows an uninterrupted one would.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import model_validator
from torch import nn

from kiln.data.raw import RawTokens, max_id, raw_files
from kiln.data.shards import MANIFEST, ShardSet, check_tokenizer, tokenizer_digest
from kiln.data.stream import EpochStream, StreamLoader, Windows, data_loader
from kiln.errors import ConfigError
from kiln.hub.files import file_sha256
from kiln.models.common.config import text_sizes
from kiln.models.common.loss import lm_loss_sum
from kiln.models.common.wrapped import unwrap
from kiln.models.pretrained import PreTrainedModel
from kiln.models.tasks import CAUSAL_LM
from kiln.parallel.config import finite
from kiln.parallel.world import World, all_reduce_sum
from kiln.train.checks import check_model_tokenizer
from kiln.train.config import DataSection, RunConfig
from kiln.train.plans import data_shard
from kiln.train.recipes.base import Evaluate, Recipe, RunParts, Shortcut, build_model
from kiln.train.trainer import Trainer

if TYPE_CHECKING:  # finite() builds an Annotated float at run time; the checker sees the float
    HeldOut = float
else:
    HeldOut = finite(ge=0, lt=1)


class PretrainData(DataSection):
    """[data] of a pretrain run: data.train (and eval) are `kiln tokenize` directories or raw token ids;
    max_length is the window's seq_len."""
    train_split: str = "train"
    eval_split: str = "val"
    within_doc: bool = False             # attention kept inside each document of a packed window
    num_workers: int = 0                 # DataLoader worker processes reading the shards
    prefetch: int = 2                    # batches each worker may hold ready
    # Raw token ids (kiln.data.raw): train is a .npy/.bin file or a folder of them (no manifest).
    dtype: Literal["uint16", "int32", "uint32", "int64"] | None = None  # of .bin files (a .npy says its own)
    extension: str = ".bin"              # a folder's token files end with this (".txt": token text files)
    shuffle_shards: bool = True          # false: every epoch reads the token shards / files in their sorted order
    val_fraction: HeldOut = 0.0          # held out at train time: a flat file's tail, or a folder's last shards

    @model_validator(mode="after")
    def _check_stream(self) -> PretrainData:
        if self.num_workers < 0 or self.prefetch < 1:
            raise ValueError("data.prefetch must be >= 1, data.num_workers >= 0")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be within [0, 1), got {self.val_fraction}")
        return self


def is_shard_dir(path: str | None) -> bool:
    return path is not None and (Path(path) / MANIFEST).is_file()


def _raw(train: object, extension: object) -> list[Path] | None:
    """The raw token files data.train names (None: it names none); `extension` as written, if a string."""
    if not isinstance(train, str):
        return None
    return raw_files(train, extension if isinstance(extension, str) else PretrainData.model_fields["extension"].default)


def _data(cfg: RunConfig) -> PretrainData:
    assert isinstance(cfg.data, PretrainData), f"pretrain builds from its own [data] schema, got {type(cfg.data)}"
    return cfg.data


def lm_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed next-token cross entropy, number of real targets) for one stream batch.

    A causal LM that sums over targets itself (ForCausalLM) is given them, so on its fast path the head
    and the loss run fused, chunk by chunk; any other model (a prototype head) is scored on its logits."""
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch.get("position_ids")}
    if getattr(unwrap(model), "sums_targets", False):
        out = model(**inputs, targets=batch["targets"])  # targets (B, T) are already shifted
        return out.loss_sum, out.loss_count
    return lm_loss_sum(model(**inputs).logits, batch["targets"])


@torch.no_grad()
def evaluate_windows(trainer: Trainer, windows: Windows, batch_size: int) -> dict[str, float]:
    """Loss per target token over one pass of `windows` (all ranks together) and its perplexity.

    A model wrapping an LM (`.inner`, e.g. PrototypeModel) is scored on its own logits (eval_loss) and on
    the inner LM head's (eval_lm_loss), so both objectives of a multi-objective run have a held-out curve."""
    model, world = trainer.model, trainer.world
    scored = {"eval_": model}
    inner = getattr(trainer.unwrapped(), "inner", None)
    if inner is not None:
        scored["eval_lm_"] = inner
    model.eval()
    sums = torch.zeros(len(scored), 2, dtype=torch.float64)
    # tp ranks of one group read the same windows; their duplicate sums leave the ratio unchanged
    batches = data_loader(EpochStream(windows, batch_size, trainer.data_rank, trainer.data_shards))
    for batch in itertools.islice(batches, trainer.args.eval_batches):  # train.eval_batches caps it (None: all)
        batch = {k: v.to(trainer.device) for k, v in batch.items()}
        for i, m in enumerate(scored.values()):
            with trainer.autocast():
                loss_sum, count = lm_step(m, batch)
            sums[i] += torch.tensor([float(loss_sum), float(count)], dtype=torch.float64)
    model.train()
    sums = all_reduce_sum(sums.to(trainer.device), world).cpu()
    out = {}
    for (prefix, _), (total, count) in zip(scored.items(), sums.tolist()):
        loss = total / max(count, 1.0)
        out[f"{prefix}loss"], out[f"{prefix}ppl"] = loss, math.exp(loss) if loss < 700 else float("inf")
    return out


def _open(path: str, split: str, digest: str, source: str, vocab_size: int, world: World) -> ShardSet:
    shards = ShardSet(path, split)  # every shard's header and size checked against the manifest
    check_tokenizer(path, shards.manifest, digest, source)
    if world.main:  # sha256 too, once per run: now if small, else in the background
        shards.start_verify()
    if shards.vocab_size > vocab_size:
        raise ConfigError(f"{Path(path) / MANIFEST}: token ids go up to {shards.vocab_size - 1} but the model's "
                          f"vocab_size is {vocab_size}; set model.config.vocab_size >= {shards.vocab_size}")
    return shards


def _stream(cfg: RunConfig, model: nn.Module, train_ids: ShardSet | RawTokens, held_ids: ShardSet | RawTokens | None,
            world: World) -> tuple[StreamLoader, Evaluate | None]:
    """`world`'s rank's loader over packed windows of `train_ids`, and the held-out evaluation over
    `held_ids` (None: no eval); the model is checked against data.max_length first."""
    d = _data(cfg)
    check_model_tokenizer(model, d.max_length, str(cfg.model.path or cfg.model.family), cfg.train.precision)
    train = Windows(train_ids, d.max_length, seed=cfg.train.seed, shuffle=d.shuffle_shards, within_doc=d.within_doc)
    rank, shards = data_shard(cfg.parallel, world.rank, world.size)
    loader = StreamLoader(train, cfg.train.batch_size, rank=rank, world_size=shards, num_workers=d.num_workers,
                          prefetch=d.prefetch)
    if held_ids is None:
        return loader, None
    held_out = Windows(held_ids, d.max_length, shuffle=False, within_doc=d.within_doc)
    return loader, lambda trainer: evaluate_windows(trainer, held_out, cfg.train.batch_size)


class Pretrain(Recipe):
    name = "pretrain"
    summary = "a causal LM (or Mamba) on `kiln tokenize` token shards"
    when = "data.train is a `kiln tokenize` directory or raw token ids"
    data_schema: type[DataSection] = PretrainData
    # Sizes of a model built from scratch (model.family + model.config), the usual knobs of a pre-training sweep.
    shortcuts = (Shortcut("d_model", "model.config.hidden_size"), Shortcut("d_state", "model.config.state_size"),
                 Shortcut("d_conv", "model.config.conv_kernel"), Shortcut("expand", "model.config.expand"),
                 Shortcut("layers", "model.config.num_hidden_layers"))

    def matches(self, task: str, data: Mapping[str, Any]) -> bool:
        train = data.get("train")
        return (isinstance(train, str) and is_shard_dir(train)) or _raw(train, data.get("extension")) is not None

    def build(self, cfg: RunConfig, on_model: Callable[[nn.Module], None], world: World) -> RunParts:
        d = _data(cfg)
        raw = _raw(d.train, d.extension)
        if raw is not None:
            return self._build_raw(cfg, raw, on_model, world)
        if cfg.model.task != CAUSAL_LM:
            raise ConfigError(f"data.train {d.train} is a token shard directory, which only model.task = "
                              f"{CAUSAL_LM!r} reads (not {cfg.model.task!r})")
        if cfg.lora is not None:
            raise ConfigError("[lora] is for fine-tuning; pre-training from token shards trains every weight")
        if d.eval is not None and not is_shard_dir(d.eval):
            raise ConfigError(f"data.eval {d.eval} must be a token shard directory too (data.train is one)")
        model = build_model(cfg, None)
        assert isinstance(model, PreTrainedModel), "build_model builds a kiln model"
        on_model(model)
        if model.tokenizer is None:
            raise ConfigError(f"{cfg.model.path}: no tokenizer files; the token shards are checked against the "
                              "run's tokenizer")
        source = str(cfg.model.tokenizer or cfg.model.path)
        digest = tokenizer_digest(model.tokenizer.backend.to_str())
        vocab = text_sizes(model.config).vocab_size
        held_out = _open(d.eval, d.eval_split, digest, source, vocab, world) if d.eval is not None else None
        loader, evaluate = _stream(cfg, model, _open(d.train, d.train_split, digest, source, vocab, world), held_out,
                                   world)
        fingerprint = {"train": str(d.train), "manifest_sha256": file_sha256(Path(d.train) / MANIFEST),
                       "split": d.train_split, "seq_len": d.max_length, "within_doc": d.within_doc}
        return RunParts(model, loader, step=lm_step, evaluate=evaluate, fingerprint=fingerprint)

    def _build_raw(self, cfg: RunConfig, files: list[Path], on_model: Callable[[nn.Module], None],
                   world: World) -> RunParts:
        """Raw token ids: no tokenizer or manifest; ids checked against the model's vocabulary."""
        d = _data(cfg)
        if cfg.model.task != CAUSAL_LM:
            raise ConfigError(f"data.train {d.train} holds raw token ids, which only model.task = {CAUSAL_LM!r} "
                              f"reads (not {cfg.model.task!r})")
        if cfg.lora is not None:
            raise ConfigError("[lora] is for fine-tuning; pre-training from token ids trains every weight")
        if d.eval is not None and not (Path(d.eval).exists() or Path(d.eval).is_symlink()):
            raise ConfigError(f"data.eval {d.eval}: no such file or folder")
        eval_files = raw_files(d.eval, d.extension) if d.eval is not None else None
        if d.eval is not None and eval_files is None:
            raise ConfigError(f"data.eval {d.eval} must hold raw token ids too (data.train does)")
        if eval_files is not None and d.val_fraction > 0:
            raise ConfigError("set data.eval or data.val_fraction, not both (each gives the held-out data)")
        if cfg.model.path is None and "vocab_size" not in cfg.model.config:  # from scratch: max id + 1, as the seed
            cfg.model.config["vocab_size"] = max_id(files + (eval_files or []), d.dtype) + 1
            if world.main:
                print(f"data: model.config.vocab_size = {cfg.model.config['vocab_size']}, inferred from the data "
                      f"(largest token id + 1)")
        model = build_model(cfg, None, need_tokenizer=False)
        assert isinstance(model, PreTrainedModel), "build_model builds a kiln model"
        on_model(model)
        vocab = text_sizes(model.config).vocab_size
        eos = getattr(model.config, "eos_token_id", None)
        eos = int(eos[0] if isinstance(eos, (list, tuple)) else eos) if eos is not None else 0  # pads short windows
        train_ids = RawTokens(files, "train", vocab, eos, d.dtype, d.val_fraction)
        held_ids = (RawTokens(eval_files, "train", vocab, eos, d.dtype) if eval_files is not None
                    else RawTokens(files, "val", vocab, eos, d.dtype, d.val_fraction) if d.val_fraction > 0 else None)
        loader, evaluate = _stream(cfg, model, train_ids, held_ids, world)
        fingerprint = {"train": str(d.train), **train_ids.fingerprint(), "val_fraction": d.val_fraction,
                       "seq_len": d.max_length, "within_doc": d.within_doc}
        return RunParts(model, loader, step=lm_step, evaluate=evaluate, fingerprint=fingerprint)


RECIPE = Pretrain()
