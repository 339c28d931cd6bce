"""The run config: one TOML file, every key validated by pydantic (`extra="forbid"`).

The core sections are [model], [data] (the keys every recipe reads), [train], [lora] and [parallel]
(kiln.parallel.config). Each recipe adds its own [data] keys and each recipe extension its own table
([hpn], [grow], ...); the recipe registry (kiln.train.recipes) assembles the full model per recipe and
installs itself here (`use_run_schema`), so this module knows no recipe. An unknown or mistyped key
(or a key of another recipe), a wrong type or a bad value is a `ConfigError` naming the file, the
section.key and, for unknown keys, the line it sits on.

Values keep their kind: a boolean is not a number (`steps = true` is refused, not one step) and text
is not a number (`lr = "1e-3"` is refused), whatever pydantic's lax mode would coerce. `model.config`
beside `model.path` applies only keys that leave every stored weight's shape as it is (dropout, eps,
...), as transformers' `from_pretrained(path, **kwargs)` does; a key that would reshape a weight is
refused (`model_config_overrides`).
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, SerializeAsAny, ValidationError, field_validator, model_validator

from kiln.errors import ConfigError, KilnError
from kiln.hub.resolve import parse_repo_id
from kiln.models.tasks import SEQUENCE_CLASSIFICATION, get_task

# The [parallel] table lives beside the plans it configures; re-exported as part of the run config.
from kiln.parallel.config import (
    CadenceSection,
    Dropout,
    Finite,
    Fraction,
    NonNegative,
    ParallelSection,
    Positive,
    Section,
    finite,
)

if typing.TYPE_CHECKING:  # finite() builds an Annotated float at run time; the checker sees the float
    Beta = float
else:
    Beta = finite(ge=0, lt=1)  # an Adam moment's decay

__all__ = [
    "CadenceSection",
    "DataSection",
    "Dropout",
    "Finite",
    "Fraction",
    "LoraSection",
    "ModelSection",
    "NonNegative",
    "ParallelSection",
    "Positive",
    "RunConfig",
    "RunSchema",
    "Section",
    "TrainSection",
    "apply_overrides",
    "check_freeze_specs",
    "finite",
    "load_run_config",
    "model_config_overrides",
    "parse_override",
    "parse_run_config",
    "use_run_schema",
]  # bounded floats, from [parallel]


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
    quantize: str | None = None        # "nf4" | "fp4": a bf16/fp32 model.path's Linears held 4-bit (QLoRA base;
                                       # bitsandbytes' bytes, double-quantized absmax); a 4-bit directory needs none

    @field_validator("task")
    @classmethod
    def _task(cls, value: str) -> str:
        try:
            return get_task(value, "model.task")
        except ConfigError as e:
            raise ValueError(str(e).removeprefix("model.task: ")) from None

    @model_validator(mode="after")
    def _source(self) -> ModelSection:
        if (self.path is None) == (self.family is None):
            raise ValueError("set exactly one of model.path (an HF directory) or model.family (build from scratch)")
        if self.labels is not None and self.num_labels is not None and len(self.labels) != self.num_labels:
            raise ValueError(f"model.labels has {len(self.labels)} names but model.num_labels is {self.num_labels}")
        return self


class DataSection(Section):
    """The [data] keys every recipe reads. A recipe's own keys (SFT's pack and train_on, pre-training's
    within_doc, dtype, val_fraction, ...) live in its data schema, a subclass of this (kiln.train.recipes)."""
    train: str                           # records, a `kiln tokenize` directory or raw token ids: the recipe says
    eval: str | None = None
    max_length: int = 128                # tokens per example (pre-training: per window)

    @model_validator(mode="after")
    def _check(self) -> DataSection:
        if self.max_length < 1:
            raise ValueError(f"data.max_length must be >= 1, got {self.max_length}")
        return self


class TrainSection(Section):
    out_dir: str = "runs/run"
    seed: int = 42
    steps: int | None = None
    epochs: Positive | None = None
    batch_size: int = 16                  # per process, per micro-batch
    grad_accum: int = 1
    lr: NonNegative = 5e-5
    weight_decay: NonNegative = 0.01
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    eps: Positive = 1e-8
    schedule: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int = 0
    min_lr_ratio: Fraction = 0.0             # the schedule's floor, as a fraction of lr
    clip_grad_norm: NonNegative | None = 1.0
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
    stop_save: bool = True                # SIGTERM / SIGINT / max_time: checkpoint the step where the run stops
    max_time: str | None = None           # "3h50m": stop cleanly before this much wall clock (kiln.train.preempt)

    @field_validator("out_dir")
    @classmethod
    def _out_dir(cls, value: str) -> str:
        if not value.strip():  # "" would train into the working directory
            raise ValueError(f"must be a folder path, got {value!r}")
        return value

    @field_validator("freeze")
    @classmethod
    def _freeze(cls, value: list[str]) -> list[str]:
        return check_freeze_specs(value)

    @model_validator(mode="after")
    def _check(self) -> TrainSection:
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
        if self.max_time is not None:
            from kiln.train.preempt import parse_duration

            parse_duration(self.max_time)  # refused here, naming train.max_time, not hours into the run
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
    alpha: Finite = 32
    dropout: Dropout = 0.0
    targets: list[str] | Literal["all-linear"] = ["q_proj", "v_proj"]  # module names, or every Linear
    use_rslora: bool = False             # scaling alpha / sqrt(r) instead of alpha / r
    target_parameters: list[str] = []    # stacked routed-expert weights by name, PEFT's form ("experts.gate_up_proj")


class RunConfig(Section):
    """The core tables. The recipe registry subclasses it once per recipe (`recipe` names it): `data` typed
    as that recipe's data schema, plus one optional table per recipe extension."""
    recipe: ClassVar[str] = ""           # the recipe whose data schema `data` holds; "" for the core model
    model: ModelSection
    data: SerializeAsAny[DataSection]    # dumped with the recipe's own keys, which a resume compares
    train: TrainSection
    lora: LoraSection | None = None
    parallel: ParallelSection = ParallelSection()


class RunSchema(Protocol):
    """What turns a parsed TOML table into a run-config model: kiln.train.recipes.SCHEMA."""

    def model_for(self, table: Mapping[str, Any]) -> type[RunConfig]:
        """The model (core tables, the matching recipe's [data] schema, the extensions' tables) for `table`."""

    def misplaced(self, table: Mapping[str, Any], model: type[RunConfig], key: str) -> str | None:
        """For a dotted `key` of `table` that `model` does not know: which recipe it belongs to, if any, as a hint."""


_schema: RunSchema | None = None


def use_run_schema(schema: RunSchema) -> None:
    """Install the registry that assembles run-config models (kiln.train.recipes does, on import)."""
    global _schema
    _schema = schema


def _run_schema() -> RunSchema:
    if _schema is None:  # kiln/train/__init__.py imports the registry, so any import of kiln.train installs it
        raise KilnError("no run-config schema installed: import kiln.train.recipes (the recipe registry) first")
    return _schema


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
                     overridden: Sequence[str] = (), schema: RunSchema | None = None) -> RunConfig:
    """Validate a parsed run config against the model `schema` (default: the recipe registry's) picks for
    it; errors name `source` (or the command line for `overridden` keys), the key and (given `text`) its line."""
    schema = schema or _run_schema()
    model = schema.model_for(data)
    try:
        miscast = _miscast(model, data)
        if miscast:
            raise ConfigError("; ".join(f"{_where(source, text, key, overridden)}: {key}: {why}"
                                        for key, why in miscast))
        return model.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            loc = [str(p) for p in err["loc"]]
            key = ".".join(loc)
            named = list(loc)
            while len(named) > 2 and named[-1].isdigit():  # train.betas.1: the line of train.betas
                named.pop()
            section, leaf = (loc[0], named[-1]) if len(named) > 1 else (None, named[0] if named else "")
            line = None
            if text and leaf:  # [parallel.cadence] target_sync_share, else a key of the top table
                line = _line_of(text, ".".join(named[:-1]), leaf) or _line_of(text, section, leaf)
            where = f"{source}:{line}" if line else source
            if any(key == o or key.startswith(o + ".") or o.startswith(key + ".") for o in overridden):
                where = "command line"  # the TOML line holds the value the flag replaced, not the bad one
            if err["type"] == "extra_forbidden":
                hint = schema.misplaced(data, model, key)
                problems.append(f"{where}: unknown key {key!r}" + (f" ({hint})" if hint else ""))
            elif err["type"] == "missing":
                problems.append(f"{where}: missing key {key!r}")
            else:
                msg = err["msg"].removeprefix("Value error, ")
                # a range check reads as a sentence ("train.lr must be a finite number >= 0, got nan")
                joint = " " if msg.startswith("must be a finite number") else ": "
                problems.append(f"{where}: {key + joint if key else ''}{msg}")
        raise ConfigError("; ".join(problems)) from None


def _where(source: str, text: str, key: str, overridden: Sequence[str]) -> str:
    if any(key == o or key.startswith(o + ".") for o in overridden):
        return "command line"
    parts = key.split(".")
    while len(parts) > 1 and parts[-1].isdigit():  # train.betas.1: the line of train.betas
        parts.pop()
    section, _, leaf = ".".join(parts).rpartition(".")
    line = _line_of(text, section.split(".")[0] if section else None, leaf) if text else None
    return f"{source}:{line}" if line else source


def _leaf_types(annotation: Any) -> set[Any]:
    """The plain types a field annotation admits (through Optional, unions, lists, Literal)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:  # a checked float (kiln.parallel.config.finite) is a float
        return _leaf_types(typing.get_args(annotation)[0])
    if origin is Literal:
        return {type(a) for a in typing.get_args(annotation)}
    if origin in (typing.Union, types.UnionType, list, tuple, set, dict) or (
            origin is not None and typing.get_args(annotation)):
        out: set[Any] = set()
        for a in typing.get_args(annotation):
            if a is not Ellipsis:
                out |= _leaf_types(a)
        return out
    return {annotation}


def _miscast(model: type[BaseModel], data: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(key, why) for each value pydantic's lax mode would quietly convert: a boolean where the field takes
    no boolean (true would be 1), text where it takes only numbers ("1e-3" would be 0.001)."""
    if not isinstance(data, dict):
        return []
    out: list[tuple[str, str]] = []
    for key, value in data.items():
        field = model.model_fields.get(key)
        if field is None:
            continue  # unknown keys are validation's to name
        leaves = _leaf_types(field.annotation)
        if Any in leaves or typing.Any in leaves:
            continue
        sub = [t for t in leaves if isinstance(t, type) and issubclass(t, BaseModel)]
        if isinstance(value, dict) and sub:
            out += _miscast(sub[0], value, f"{prefix}{key}.")
            continue
        items = value if isinstance(value, list) else [value]
        numbers_only = bool(leaves) and leaves <= {int, float, type(None)}
        for item in items:
            if isinstance(item, bool) and bool not in leaves and leaves & {int, float}:
                out.append((f"{prefix}{key}", f"a boolean ({str(item).lower()}) is not a number; write the "
                                              "number itself"))
                break
            if isinstance(item, str) and numbers_only:
                quoted = _is_number(item)  # "3e-4" in quotes: the fix is the quotes; "abc": the value  # sweep
                out.append((f"{prefix}{key}", f"Input should be a valid number, not text: got {item!r}"
                                              + (" (drop the quotes)" if quoted else "")))
                break
    return out


def _is_number(text: str) -> bool:  # sweep
    try:
        float(text)
    except ValueError:
        return False
    return True


def model_config_overrides(m: ModelSection) -> dict[str, Any]:
    """`model.config` beside `model.path`: the keys a load applies on top of the stored config.json, as
    transformers' from_pretrained(path, **kwargs) does, when each changes no stored weight's shape
    (dropout, eps, ...). A key that is no field of the family, holds a value of another kind, or would
    reshape a weight (layers, sizes, vocabulary: the stored weights could not load) is a ConfigError
    naming it and why."""
    if m.path is None or not m.config:
        return {}
    import torch

    from kiln.models.auto import apply_changes, load_config

    family, config, _ = load_config(m.path)
    fields = {f.name for f in dataclasses.fields(config)} - {"extra"}

    def shapes(c: Any) -> tuple[dict[str, tuple[int, ...]], dict[str, int]]:
        """The stored weights' shapes, and every integer a module holds (heads, head size, padding row...):
        a key can keep each shape and still change how the weights are read (num_attention_heads re-splits
        the same projections into other heads)."""
        with torch.device("meta"):
            built = family.build(c, m.task)
        layout = {f"{name}.{attr}" if name else attr: value for name, module in built.named_modules()
                  for attr, value in vars(module).items()
                  if type(value) is int and not attr.startswith("_")}
        return {k: tuple(v.shape) for k, v in built.state_dict().items()}, layout

    base, base_layout = shapes(config)
    for key, value in m.config.items():
        where = f"model.config.{key} = {value!r} beside model.path"
        if key not in fields:
            raise ConfigError(f"{where}: {key!r} is not a config field of model_type {config.model_type!r}")
        stored = getattr(config, key)
        kinds = [(bool,), (int, float), (str,), (list, tuple), (dict,)]
        kind = next((k for k in kinds if isinstance(stored, k)), None)
        if stored is not None and kind is not None and (not isinstance(value, kind) or (
                isinstance(value, bool) and bool not in kind)):
            raise ConfigError(f"{where}: {m.path}/config.json has {key} = {stored!r}; a {type(value).__name__} "
                              "cannot replace it")
        try:
            changed = apply_changes(config, {key: value})
        except (ConfigError, ValueError, TypeError) as e:
            raise ConfigError(f"{where}: {e}") from None
        changed_shapes, layout = shapes(changed)
        if changed_shapes != base:
            raise ConfigError(f"{where}: changes the shape of weights stored in {m.path} ({key} is {stored!r} "
                              "there), so they could not load; a load applies only keys that keep every weight's "
                              "shape (dropout, eps, ...). Build a different architecture from model.family + "
                              "model.config, or grow this one with the grow recipe")
        moved = [f"{k} {base_layout[k]} -> {v}" for k, v in layout.items() if k in base_layout and base_layout[k] != v]
        if moved:
            raise ConfigError(f"{where}: keeps every stored weight's shape but changes how {m.path}'s weights are "
                              f"read ({key} is {stored!r} there; {', '.join(moved[:3])}"
                              f"{f' and {len(moved) - 3} more' if len(moved) > 3 else ''}), so the loaded model "
                              "would not be the stored one; a load applies only keys such as dropout and eps. "
                              "Build a different architecture from model.family + model.config")
    return dict(m.config)


def _link_loop(path: str) -> bool:
    """Whether following the link `path` comes back around (ELOOP) rather than to a missing target."""
    try:
        os.stat(path)
    except OSError as e:
        return e.errno == errno.ELOOP
    return False


def load_run_config(path: str | os.PathLike[str], overrides: Sequence[tuple[str, Any]] = ()) -> RunConfig:
    """Read and validate a run TOML, with `overrides` ((dotted key, value), e.g. from `kiln train --set`)
    applied on top; relative model/data paths resolve against the file's folder (so a config travels
    with its data), those given as overrides against the working directory; out_dir stays relative
    to the working directory. A model.path that is no such path but reads as a Hub repo id (org/name[@rev])
    stays as it is."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{path}: is a folder, not a run config file (a .toml)")
    if not path.is_file():
        raise ConfigError(f"{path}: no such run config file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:  # the boundary's own message for this names no file
        raise ConfigError(f"{path}: not valid UTF-8 (byte {e.start}); TOML files are UTF-8: re-encode it") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None
    apply_overrides(data, overrides)
    overridden = [k for k, _ in overrides]
    # Before validation: which recipe runs (and so which [data] keys are valid) depends on what data.train is.
    for section, key in (("model", "path"), ("model", "tokenizer"), ("data", "train"), ("data", "eval")):
        table = data.get(section)
        value = table.get(key) if isinstance(table, dict) else None
        if not isinstance(table, dict) or not isinstance(value, str) or os.path.isabs(value):
            continue  # unset, absolute, or not a string (validation names the bad type)
        base = Path.cwd() if f"{section}.{key}" in overridden else path.resolve().parent
        joined = base / value
        if key == "path" and not joined.exists() and parse_repo_id(value) is not None:
            continue  # model.path = "org/name": a Hub repo id, resolved through the HF cache when loaded
        table[key] = str(joined)
    for key in ("train", "eval"):  # before a recipe is picked by what the path is: a dangling link is no kind of data
        value = data.get("data", {}).get(key) if isinstance(data.get("data"), dict) else None
        if isinstance(value, str) and os.path.islink(value) and not os.path.exists(value):
            if _link_loop(value):
                raise ConfigError(f"data.{key} {value}: a symbolic link that leads back to itself (to "
                                  f"{os.readlink(value)}); point it at the data")
            raise ConfigError(f"data.{key} {value}: a dangling symbolic link (to {os.readlink(value)}, which does "
                              "not exist: an unmounted share?)")
    return parse_run_config(data, str(path), text, overridden)
