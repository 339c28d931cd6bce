"""fine-tune: a model's task head trained on labelled records (JSONL/CSV): sequence or token
classification, extractive QA. The task encodes the records; the label set comes from the config,
the source checkpoint's head, or the data (sorted)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, Protocol, cast

from torch import nn

from kiln.data import read_records
from kiln.data.hfdata import source_sha256
from kiln.errors import ConfigError
from kiln.models.auto import load_config
from kiln.models.tasks import CAUSAL_LM, Task, get_task
from kiln.parallel.world import World
from kiln.train.checks import check_examples
from kiln.train.config import DataSection, RunConfig
from kiln.train.recipes.base import Recipe, RunParts, add_lora, build_model, check_text_model


class RecordsData(DataSection):
    """[data] of the recipes that read records (fine-tune, sft)."""
    format: Literal["auto", "jsonl", "csv", "datasets"] = "auto"   # datasets: parquet, arrow, JSON, save_to_disk


class FineTuneData(RecordsData):
    """[data] of a fine-tune run: which record fields the task reads."""
    text_field: str = "text"
    text_pair_field: str | None = None   # second segment for pair classification
    label_field: str = "label"           # a label name (or list of tag names for token classification)
    tokens_field: str = "tokens"         # token classification: pre-split words
    question_field: str = "question"     # question answering (SQuAD layout)
    context_field: str = "context"
    answers_field: str = "answers"


class _Labelled(Protocol):
    label_field: str


def label_set(cfg: RunConfig, task: Task, train_records: list) -> list[str] | None:
    """The labels a run trains: model.labels, else the source head's own (same task), else the data's."""
    if task.label_kind is None:
        return None
    if cfg.model.labels is not None:
        return list(cfg.model.labels)  # data labels outside this set are reported per line when encoding
    if cfg.model.path is not None and cfg.model.num_labels is None:
        _, config, source_task = load_config(cfg.model.path)
        if source_task == task and config.id2label:
            return config.labels  # continuing a trained head: keep its label set and order
    if cfg.model.num_labels == 1 and task.label_kind == "sequence":
        return ["LABEL_0"]  # one output is a regression head (as transformers reads it): float labels, no classes
    # a task with labels reads them from a [data] that names their field (FineTuneData, ImageData)
    found = task.collect_labels(train_records, cast(_Labelled, cfg.data).label_field)
    if cfg.model.num_labels is not None and cfg.model.num_labels != len(found):
        raise ConfigError(f"model.num_labels is {cfg.model.num_labels} but {cfg.data.train} uses "
                          f"{len(found)} labels: {', '.join(found)}; set model.labels to name them")
    return found


class FineTune(Recipe):
    name = "fine-tune"
    summary = "a task head on labelled records (classification, token tags, QA)"
    when = f"a task head on records: model.task other than {CAUSAL_LM!r}"
    data_schema: type[DataSection] = FineTuneData

    def matches(self, task: str, data: Mapping[str, Any]) -> bool:
        return True  # the fallback: records in, the task's own encoding

    def fingerprint(self, cfg: RunConfig, labels: list[str] | None) -> dict[str, Any]:
        d = cfg.data
        return {"train": str(d.train), "train_sha256": source_sha256(d.train), "max_length": d.max_length,
                "labels": labels}

    def empty_hint(self, cfg: RunConfig) -> str:
        """Where to look when the encoded data has nothing to learn."""
        return f"labels of tokens past data.max_length = {cfg.data.max_length} are cut off"

    def encode(self, cfg: RunConfig, task: Task, model: nn.Module, records: list, labels: list[str] | None,
               name: str) -> list[dict]:
        """The records as examples: the task's own encoding."""
        return task.encode(records, model.tokenizer, labels, cfg.data, name)

    def build(self, cfg: RunConfig, on_model: Callable[[nn.Module], None], world: World) -> RunParts:
        d = cfg.data
        assert isinstance(d, RecordsData), f"{self.name} builds from its own [data] schema, got {type(d).__name__}"
        task = get_task(cfg.model.task, "model.task")
        train_records = read_records(d.train, d.format)
        eval_records = read_records(d.eval, d.format) if d.eval else None
        labels = label_set(cfg, task, train_records)
        model = build_model(cfg, labels)
        on_model(model)
        check_text_model(cfg, model, d.max_length)
        add_lora(cfg, model)
        train = self.encode(cfg, task, model, train_records, labels, "train")
        evals = self.encode(cfg, task, model, eval_records, labels, "eval") if eval_records else None
        check_examples(train, model, task, f"data.train {d.train}", self.empty_hint(cfg), say=world.main)
        if evals is not None:
            check_examples(evals, model, task, f"data.eval {d.eval}", self.empty_hint(cfg), say=world.main)
        return RunParts(model, train, eval_data=evals, fingerprint=self.fingerprint(cfg, labels))


RECIPE = FineTune()
