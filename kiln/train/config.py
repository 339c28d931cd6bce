"""The run config: one TOML file, every key validated by pydantic (`extra="forbid"`).

The core sections are [model], [data], [train], [lora] and [parallel]; each recipe extension adds its
own table ([hpn], [grow], ...: kiln.train.recipes), joined into the schema by `run_config_model()`.
An unknown or mistyped key, a wrong type or a bad value is a `ConfigError` naming the file, the
section.key and, for unknown keys, the line it sits on.
"""

from __future__ import annotations

import functools
import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, ValidationError, create_model, field_validator, model_validator

from kiln.errors import ConfigError
from kiln.hub.resolve import parse_repo_id
from kiln.models.tasks import SEQUENCE_CLASSIFICATION, get_task


class Section(BaseModel):
    """A TOML table: unknown keys are errors, assignments are validated."""
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(Section):
    path: str | None = None            # an HF model directory; or family + config to build from scratch
    family: str | None = None
    config: dict[str, Any] = {}        # family config fields when building from scratch
    tokenizer: str | None = None       # a directory with tokenizer files, for a model built from scratch
    task: str = SEQUENCE_CLASSIFICATION  # a name from kiln.models.tasks.TASKS
    num_labels: int | None = None
    labels: list[str] | None = None    # label names; default: read from the training data, sorted
    init_seed: int = 0                 # seed for freshly initialised weights (heads, scratch models)
    fp8: Literal["dequantize", "keep"] = "dequantize"  # an FP8 block-scaled model.path: dequantized on load, or
                                       # kept FP8 in memory (frozen base, e.g. under [lora]; ~1 byte per weight)

    @field_validator("task")
    @classmethod
    def _task(cls, value: str) -> str:
        try:
            return get_task(value, "model.task")
        except ConfigError as e:
            raise ValueError(str(e).removeprefix("model.task: ")) from None

    @model_validator(mode="after")
    def _source(self) -> "ModelSection":
        if (self.path is None) == (self.family is None):
            raise ValueError("set exactly one of model.path (an HF directory) or model.family (build from scratch)")
        if self.labels is not None and self.num_labels is not None and len(self.labels) != self.num_labels:
            raise ValueError(f"model.labels has {len(self.labels)} names but model.num_labels is {self.num_labels}")
        return self


class DataSection(Section):
    train: str
    eval: str | None = None
    format: Literal["auto", "jsonl", "csv", "datasets"] = "auto"   # datasets: parquet, arrow, JSON, save_to_disk
    text_field: str = "text"
    text_pair_field: str | None = None   # second segment for pair classification
    label_field: str = "label"           # a label name (or list of tag names for token classification)
    tokens_field: str = "tokens"         # token classification: pre-split words
    question_field: str = "question"     # question answering (SQuAD layout)
    context_field: str = "context"
    answers_field: str = "answers"
    max_length: int = 128
    train_on: Literal["assistant", "all"] = "assistant"  # causal-lm SFT: loss on replies (+ EOS) or on all
    pack: bool = True                    # causal-lm SFT: several samples per row, attention kept per sample
                                         # (where the model cannot keep them apart, rows stay one sample each)
    # Pre-training, when train (and eval) are `kiln tokenize` directories; max_length is the window's seq_len.
    train_split: str = "train"
    eval_split: str = "val"
    within_doc: bool = False             # attention kept inside each document of a packed window
    num_workers: int = 0                 # DataLoader worker processes reading the shards
    prefetch: int = 2                    # batches each worker may hold ready
    # Pre-training from raw token ids (kiln.data.raw): train is a .npy/.bin file or a folder of them (no manifest).
    dtype: Literal["uint16", "int32", "uint32", "int64"] | None = None  # of .bin files (a .npy says its own)
    extension: str = ".bin"              # a folder's token files end with this
    val_fraction: float = 0.0            # held out at train time: a flat file's tail, or a folder's last shards

    @model_validator(mode="after")
    def _check(self) -> "DataSection":
        if self.max_length < 1 or self.num_workers < 0 or self.prefetch < 1:
            raise ValueError("data.max_length and data.prefetch must be >= 1, data.num_workers >= 0")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be within [0, 1), got {self.val_fraction}")
        return self


class TrainSection(Section):
    out_dir: str = "runs/run"
    seed: int = 42
    steps: int | None = None
    epochs: float | None = None
    batch_size: int = 16                  # per process, per micro-batch
    grad_accum: int = 1
    lr: float = 5e-5
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0             # the schedule's floor, as a fraction of lr
    clip_grad_norm: float | None = 1.0
    eval_every: int = 0                   # 0: only at the end (when there is eval data)
    eval_batches: int | None = None       # at most this many batches per evaluation; None: all of the eval data
    save_every: int = 0                   # 0: only at the end
    save_at_end: bool = True
    keep_last: int = 3
    best_metric: str | None = None        # e.g. "eval_accuracy" or "eval_loss"
    best_mode: Literal["max", "min"] = "max"
    early_stopping_patience: int = 0      # evals without improvement of best_metric; 0 = off
    non_finite: Literal["skip", "fail"] = "skip"
    device: str = "auto"                  # auto, cpu, cuda, cuda:1, mps
    precision: Literal["fp32", "bf16", "fp16", "fp8"] = "fp32"   # fp8: the blocks' Linears in block-scaled FP8,
    fp8_recipe: Literal["blockwise", "torchao"] = "blockwise"     # the rest in bf16 (models/common/fp8_train.py)
    freeze: list[str] = []                # name prefixes or globs ("model.embeddings*"), first:N, last:N,
                                          # layers:i,j, embeddings (kiln.train.freeze)
    log_every: int = 1
    progress: bool = True
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = []  # experiment trackers (kiln.train.trackers)
    project: str = "kiln"                 # the W&B / Trackio project; the run is named after out_dir's folder
    tensorboard: bool = False             # deprecated: report_to = ["tensorboard"]
    exact: bool = False                   # true: bit-exact with transformers; false: the fast path (within fp32 rounding)
    group_by_length: bool = True          # fine-tuning data: batches of similar lengths, padded to their longest

    @field_validator("freeze")
    @classmethod
    def _freeze(cls, value: list[str]) -> list[str]:
        return check_freeze_specs(value)

    @model_validator(mode="after")
    def _check(self) -> "TrainSection":
        if self.steps is None and self.epochs is None:
            raise ValueError("set train.steps or train.epochs")
        if self.eval_batches is not None and self.eval_batches < 1:
            raise ValueError(f"train.eval_batches must be >= 1 (unset: all of the eval data), got {self.eval_batches}")
        for name in ("batch_size", "grad_accum", "keep_last", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"train.steps must be >= 1, got {self.steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"train.min_lr_ratio must be within [0, 1], got {self.min_lr_ratio}")
        if self.early_stopping_patience and not self.best_metric:
            raise ValueError("train.early_stopping_patience needs train.best_metric to watch")
        if self.tensorboard and "tensorboard" not in self.report_to:  # the old switch, kept as an alias
            self.report_to = [*self.report_to, "tensorboard"]
        return self


def check_freeze_specs(specs: list[str]) -> list[str]:
    """Freeze specs whose form is wrong fail at load (their fit to the model is checked once it is built)."""
    from kiln.train.freeze import spec_error

    problems = [e for e in map(spec_error, specs) if e]
    if problems:
        raise ValueError(problems[0])
    return specs


class LoraSection(Section):
    r: int = 16
    alpha: float = 32
    dropout: float = 0.0
    targets: list[str] | Literal["all-linear"] = ["q_proj", "v_proj"]  # module names, or every Linear
    use_rslora: bool = False             # scaling alpha / sqrt(r) instead of alpha / r


class CadenceSection(Section):
    """Adaptive sync cadence for mixed devices (kiln.parallel.cadence); present = on."""
    anchor: int = 1                      # batches per sync of the slowest rank, to start with; then tuned
    target_sync_share: float = 0.1       # the anchor grows until syncing takes at most this share of the time
    max_staleness: int = 16              # no rank runs more batches than this between two syncs
    max_batch_diff: int = 8              # a fast rank runs at most this many batches more than the anchor; 0 = lockstep
    average: Literal["params", "grads"] = "params"  # what is averaged (weighted by batches done) at a sync

    @model_validator(mode="after")
    def _check(self) -> "CadenceSection":
        if not 1 <= self.anchor <= self.max_staleness:
            raise ValueError(f"parallel.cadence.anchor must be within 1..max_staleness ({self.max_staleness}), "
                             f"got {self.anchor}")
        if not 0.0 < self.target_sync_share < 1.0:
            raise ValueError(f"parallel.cadence.target_sync_share must be within (0, 1), got {self.target_sync_share}")
        if self.max_batch_diff < 0:
            raise ValueError(f"parallel.cadence.max_batch_diff must be >= 0, got {self.max_batch_diff}")
        return self


class ParallelSection(Section):
    """Degrees multiply to the world size (dp 0 = what is left); kiln.parallel.mesh checks them at launch."""
    dp: int = 0          # 0: the world size / (tp * ep)
    tp: int = 1          # tensor parallel: attention heads and MLP columns split over tp ranks
    ep: int = 1          # expert parallel: MoE experts split over ep ranks (which also split the batch)
    pp: int = 1          # pipeline parallel: the blocks split into pp stages, one per rank group
    pp_schedule: Literal["gpipe", "1f1b", "interleaved"] = "1f1b"
    microbatches: int = 0                # pp: micro-batches per batch (0: 2 x pp)
    pp_stages: list[int] | None = None   # pp: blocks per stage (None: as even as the blocks allow)
    cp: int = 1          # context parallel: each sequence split over cp ranks (load-balanced causal chunks)
    cp_method: Literal["allgather", "ring"] = "allgather"  # cp: keys/values all-gathered, or passed around a ring
    fsdp: bool = False   # shard parameters, gradients and optimizer state over the dp ranks (FSDP2)
    offload: bool = False                # fsdp: keep sharded parameters and optimizer state in CPU memory
    param_dtype: Literal["fp32", "bf16", "fp16"] | None = None   # fsdp compute dtype; None: the parameters' own (autocast still applies train.precision)
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"       # fsdp gradient reduction dtype
    sequence_parallel: bool = True       # tp: norms and residuals sharded along the sequence
    activation_checkpointing: Literal["none", "block", "selective"] = "none"
    checkpoint_every: int = 1            # block: checkpoint every n-th block (1 = all of them)
    compile: bool = False                # torch.compile each block
    compile_backend: Literal["inductor", "aot_eager", "eager"] = "inductor"  # aot_eager: no codegen (tests)
    cadence: CadenceSection | None = None

    @model_validator(mode="after")
    def _check(self) -> "ParallelSection":
        for name in ("tp", "ep", "pp", "cp", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.dp < 0:
            raise ValueError(f"parallel.dp must be >= 0 (0: the rest of the world size), got {self.dp}")
        if self.offload and not self.fsdp:
            raise ValueError("parallel.offload needs parallel.fsdp = true (it offloads FSDP's shards)")
        if self.cadence is not None and (self.tp > 1 or self.ep > 1 or self.pp > 1 or self.cp > 1 or self.fsdp):
            raise ValueError("parallel.cadence is a data-parallel mode; it cannot be combined with tp, ep, pp, cp "
                             "or fsdp")
        if self.microbatches < 0:
            raise ValueError(f"parallel.microbatches must be >= 0 (0: 2 x pp), got {self.microbatches}")
        if self.pp_stages is not None:
            if len(self.pp_stages) != self.pp:
                raise ValueError(f"parallel.pp_stages has {len(self.pp_stages)} entries but parallel.pp = {self.pp}; "
                                 f"give one block count per stage")
            if min(self.pp_stages) < 1:
                raise ValueError(f"parallel.pp_stages {self.pp_stages}: every stage needs at least one block")
        return self


class RunConfig(Section):
    """The core tables; `run_config_model()` adds one optional table per recipe extension."""
    model: ModelSection
    data: DataSection
    train: TrainSection
    lora: LoraSection | None = None
    parallel: ParallelSection = ParallelSection()


@functools.cache
def run_config_model() -> type[RunConfig]:
    """RunConfig plus an optional table for each registered extension (kiln.train.recipes.EXTENSIONS)."""
    from kiln.train.recipes import EXTENSIONS

    tables: dict[str, Any] = {name: (ext.schema | None, None) for name, ext in EXTENSIONS.items()}
    return create_model("RunConfig", __base__=RunConfig, __module__=__name__, **tables)


def _line_of(text: str, section: str | None, key: str) -> int | None:
    """The line of `key` inside `[section]` (top level if None) in a TOML text, for error messages."""
    current: str | None = None
    for no, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        header = re.match(r"^\[\s*([^\]]+?)\s*\]", stripped)
        if header:
            current = header.group(1)
            if section is None and current == key:
                return no
            continue
        if current == section and re.match(rf"^{re.escape(key)}\s*=", stripped):
            return no
    return None


def parse_override(arg: str) -> tuple[str, Any]:
    """`section.key=value` (a `--set` argument) -> (dotted key, value); the value is read as a TOML value
    (64, 1e-3, true, ["first:1"]) and kept as a plain string when it is not one (insert:1, fixed)."""
    key, eq, raw = arg.partition("=")
    key = key.strip()
    if not eq or not key or "." not in key:
        raise ConfigError(f"--set {arg!r}: expected section.key=value, e.g. --set grow.placement=insert:1")
    try:
        return key, tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return key, raw


def apply_overrides(data: dict[str, Any], overrides: Sequence[tuple[str, Any]]) -> None:
    """Set each dotted key of `overrides` in the parsed TOML `data` (sections made as needed), before validation."""
    for key, value in overrides:
        *parents, leaf = key.split(".")
        node = data
        for depth, part in enumerate(parents):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {'.'.join(parents[:depth + 1])} is a value, not a section")
        node[leaf] = value


def parse_run_config(data: dict[str, Any], source: str = "run config", text: str = "",
                     overridden: Sequence[str] = ()) -> RunConfig:
    """Validate a parsed run config; errors name `source` (or the command line for `overridden` keys),
    the key and (given `text`) its line."""
    try:
        return run_config_model().model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = [str(p) for p in err["loc"]]
            key = ".".join(loc)
            section, leaf = (loc[0], loc[-1]) if len(loc) > 1 else (None, loc[0] if loc else "")
            line = _line_of(text, section, leaf) if text and leaf else None
            where = f"{source}:{line}" if line else source
            if any(key == o or key.startswith(o + ".") or o.startswith(key + ".") for o in overridden):
                where = "command line"  # the TOML line holds the value the flag replaced, not the bad one
            if err["type"] == "extra_forbidden":
                problems.append(f"{where}: unknown key {key!r}")
            elif err["type"] == "missing":
                problems.append(f"{where}: missing key {key!r}")
            else:
                msg = err["msg"].removeprefix("Value error, ")
                problems.append(f"{where}: {key + ': ' if key else ''}{msg}")
        raise ConfigError("; ".join(problems)) from None


def load_run_config(path: str | os.PathLike, overrides: Sequence[tuple[str, Any]] = ()) -> RunConfig:
    """Read and validate a run TOML, with `overrides` ((dotted key, value), e.g. from `kiln train --set`)
    applied on top; relative model/data paths resolve against the file's folder (so a config travels
    with its data), those given as overrides against the working directory; out_dir stays relative
    to the working directory. A model.path that is no such path but reads as a Hub repo id (org/name[@rev])
    stays as it is."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such run config file")
    text = path.read_text(encoding="utf-8")
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    apply_overrides(data, overrides)
    overridden = [k for k, _ in overrides]
    cfg = parse_run_config(data, str(path), text, overridden)
    for section, key in (("model", "path"), ("model", "tokenizer"), ("data", "train"), ("data", "eval")):
        obj = getattr(cfg, section)
        value = getattr(obj, key)
        base = Path.cwd() if f"{section}.{key}" in overridden else path.resolve().parent
        if value is None or os.path.isabs(value):
            continue
        joined = base / value
        if key == "path" and not joined.exists() and parse_repo_id(value) is not None:
            continue  # model.path = "org/name": a Hub repo id, resolved through the HF cache when loaded
        setattr(obj, key, str(joined))
    return cfg
