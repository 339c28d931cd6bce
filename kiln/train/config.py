"""The run config: one TOML file, every key validated by pydantic (`extra="forbid"`).

Sections follow DESIGN.md: [model], [data], [train], [lora], [parallel]. An unknown or mistyped
key, a wrong type or a bad value is a `ConfigError` naming the file, the section.key and, for
unknown keys, the line it sits on.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal, Sequence

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from kiln.errors import ConfigError

TASKS = ("sequence-classification", "token-classification", "question-answering", "masked-lm")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(_Section):
    path: str | None = None            # an HF model directory; or family + config to build from scratch
    family: str | None = None
    config: dict[str, Any] = {}        # family config fields when building from scratch
    tokenizer: str | None = None       # a directory with tokenizer files, for a model built from scratch
    task: Literal["sequence-classification", "token-classification", "question-answering", "masked-lm",
                  "causal-lm"] = "sequence-classification"
    num_labels: int | None = None
    labels: list[str] | None = None    # label names; default: read from the training data, sorted
    init_seed: int = 0                 # seed for freshly initialised weights (heads, scratch models)

    @model_validator(mode="after")
    def _source(self) -> "ModelSection":
        if (self.path is None) == (self.family is None):
            raise ValueError("set exactly one of model.path (an HF directory) or model.family (build from scratch)")
        if self.labels is not None and self.num_labels is not None and len(self.labels) != self.num_labels:
            raise ValueError(f"model.labels has {len(self.labels)} names but model.num_labels is {self.num_labels}")
        return self


class DataSection(_Section):
    train: str
    eval: str | None = None
    format: Literal["auto", "jsonl", "csv"] = "auto"
    text_field: str = "text"
    text_pair_field: str | None = None   # second segment for pair classification
    label_field: str = "label"           # a label name (or list of tag names for token classification)
    tokens_field: str = "tokens"         # token classification: pre-split words
    question_field: str = "question"     # question answering (SQuAD layout)
    context_field: str = "context"
    answers_field: str = "answers"
    max_length: int = 128
    train_on: Literal["assistant", "all"] = "assistant"  # causal-lm SFT: loss on replies (+ EOS) or on all
    pack: bool = False                   # causal-lm SFT: several samples per row, attention kept per sample
    # Pre-training, when train (and eval) are `kiln tokenize` directories; max_length is the window's seq_len.
    train_split: str = "train"
    eval_split: str = "val"
    within_doc: bool = False             # attention kept inside each document of a packed window
    num_workers: int = 0                 # DataLoader worker processes reading the shards
    prefetch: int = 2                    # batches each worker may hold ready

    @model_validator(mode="after")
    def _check(self) -> "DataSection":
        if self.max_length < 1 or self.num_workers < 0 or self.prefetch < 1:
            raise ValueError("data.max_length and data.prefetch must be >= 1, data.num_workers >= 0")
        return self


class TrainSection(_Section):
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
    save_every: int = 0                   # 0: only at the end
    save_at_end: bool = True
    keep_last: int = 3
    best_metric: str | None = None        # e.g. "eval_accuracy" or "eval_loss"
    best_mode: Literal["max", "min"] = "max"
    early_stopping_patience: int = 0      # evals without improvement of best_metric; 0 = off
    non_finite: Literal["skip", "fail"] = "skip"
    device: str = "auto"                  # auto, cpu, cuda, cuda:1, mps
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    freeze: list[str] = []                # parameter name prefixes or globs ("model.embeddings*")
    log_every: int = 1
    progress: bool = True
    tensorboard: bool = False

    @model_validator(mode="after")
    def _check(self) -> "TrainSection":
        if self.steps is None and self.epochs is None:
            raise ValueError("set train.steps or train.epochs")
        for name in ("batch_size", "grad_accum", "keep_last", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"train.steps must be >= 1, got {self.steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"train.min_lr_ratio must be within [0, 1], got {self.min_lr_ratio}")
        if self.early_stopping_patience and not self.best_metric:
            raise ValueError("train.early_stopping_patience needs train.best_metric to watch")
        return self


class LoraSection(_Section):
    r: int = 16
    alpha: float = 32
    dropout: float = 0.0
    targets: list[str] | Literal["all-linear"] = ["q_proj", "v_proj"]  # module names, or every Linear
    use_rslora: bool = False             # scaling alpha / sqrt(r) instead of alpha / r


class CadenceSection(_Section):
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


class ParallelSection(_Section):
    """Degrees multiply to the world size (dp 0 = what is left); kiln.parallel.mesh checks them at launch."""
    dp: int = 0          # 0: the world size / (tp * ep)
    tp: int = 1          # tensor parallel: attention heads and MLP columns split over tp ranks
    ep: int = 1          # expert parallel: MoE experts split over ep ranks (which also split the batch)
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
        for name in ("tp", "ep", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"parallel.{name} must be >= 1, got {getattr(self, name)}")
        if self.dp < 0:
            raise ValueError(f"parallel.dp must be >= 0 (0: the rest of the world size), got {self.dp}")
        if self.offload and not self.fsdp:
            raise ValueError("parallel.offload needs parallel.fsdp = true (it offloads FSDP's shards)")
        if self.cadence is not None and (self.tp > 1 or self.ep > 1 or self.fsdp):
            raise ValueError("parallel.cadence is a data-parallel mode; it cannot be combined with tp, ep or fsdp")
        return self


class HpnSection(_Section):
    """A hyperspherical prototype head over the vocabulary on top of the causal LM (kiln.models.hpn)."""
    proto_dim: int | None = None       # default: the model's hidden size
    scale: float = 10.0
    mode: Literal["fixed", "learnable"] = "fixed"
    loss: Literal["ce", "cosine"] = "cosine"
    spread_steps: int = 300
    lm_loss: bool = True               # keep the LM head's loss as a second objective
    objectives: Literal["sum", "pcgrad", "gradnorm", "cagrad"] = "sum"


# The shapes of grow.placement and the freeze policies; kiln.train.grow checks the indices against
# the layer counts, which only the built model knows. Checked here so a typo fails before step 1.
_PLACEMENT = re.compile(r"append|prepend|insert:\d+|specific:\d+(,\d+)*")
_FREEZE = re.compile(r"embeddings|(first|last):\d+|layers:\d+(,\d+)*")


class GrowSection(_Section):
    """Staged expansion (kiln.train.grow): grow after `at_step` optimizer steps."""
    at_step: int
    target_layers: int
    placement: str = "append"          # append, prepend, insert:N, specific:i,j,...
    freeze: list[str] = []             # from the start: first:N, last:N, layers:i,j, embeddings
    freeze_after: list[str] = []       # applied to the grown stack

    @field_validator("placement")
    @classmethod
    def _placement(cls, value: str) -> str:
        if not _PLACEMENT.fullmatch(value):
            raise ValueError(f"{value!r} is not a placement: use append, prepend, insert:N or specific:i,j,...")
        return value

    @field_validator("freeze", "freeze_after")
    @classmethod
    def _freeze(cls, value: list[str]) -> list[str]:
        bad = [v for v in value if not _FREEZE.fullmatch(v)]
        if bad:
            raise ValueError(f"{bad[0]!r} is not a freeze policy: use first:N, last:N, layers:i,j,... or embeddings")
        return value

    @model_validator(mode="after")
    def _check(self) -> "GrowSection":
        if self.at_step < 1 or self.target_layers < 1:
            raise ValueError(f"grow.at_step and grow.target_layers must be >= 1, got {self.at_step} and "
                             f"{self.target_layers}")
        return self


class RunConfig(_Section):
    model: ModelSection
    data: DataSection
    train: TrainSection
    hpn: HpnSection | None = None
    grow: GrowSection | None = None
    lora: LoraSection | None = None
    parallel: ParallelSection = ParallelSection()

    def fingerprint(self) -> dict[str, Any]:
        """What a resume must not change: model source and shape, data source, dtype."""
        return {"model": self.model.model_dump(mode="json"),
                "data": {"train": self.data.train, "max_length": self.data.max_length},
                "precision": self.train.precision}


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
        return RunConfig.model_validate(data)
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
    to the working directory."""
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
        if value is not None and not os.path.isabs(value):
            setattr(obj, key, str(base / value))
    return cfg
