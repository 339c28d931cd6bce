"""From a validated run config to a ready Trainer: model, tokenizer, labels, encoded data.

This is what `kiln train --config run.toml` runs; Python users can call `build_trainer` too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.data import Fields, collect_labels, encode_records, read_records
from kiln.errors import ConfigError, KilnError
from kiln.hub import Tokenizer
from kiln.hub.files import file_sha256
from kiln.models.auto import AutoConfig, from_config, load_config, load_pretrained
from kiln.train.config import RunConfig
from kiln.train.pretrain import build_pretrain_trainer, is_shard_dir
from kiln.train.trainer import Trainer


def _fields(cfg: RunConfig) -> Fields:
    d = cfg.data
    return Fields(text=d.text_field, text_pair=d.text_pair_field, label=d.label_field, tokens=d.tokens_field,
                  question=d.question_field, context=d.context_field, answers=d.answers_field)


def _labels(cfg: RunConfig, train_records: list) -> list[str] | None:
    if cfg.model.task in ("question-answering", "causal-lm"):
        return None
    found = collect_labels(train_records, cfg.model.task, _fields(cfg))
    if cfg.model.labels is not None:
        return list(cfg.model.labels)  # data labels outside this set are reported per line when encoding
    if cfg.model.path is not None and cfg.model.num_labels is None:
        _, config, source_task = load_config(cfg.model.path)
        if source_task == cfg.model.task and config.id2label:
            return config.labels  # continuing a trained head: keep its label set and order
    if cfg.model.num_labels is not None and cfg.model.num_labels != len(found):
        raise ConfigError(f"model.num_labels is {cfg.model.num_labels} but {cfg.data.train} uses "
                          f"{len(found)} labels: {', '.join(found)}; set model.labels to name them")
    return found


def build_model(cfg: RunConfig, labels: list[str] | None) -> Any:
    m = cfg.model
    changes: dict[str, Any] = {"labels": labels} if labels else {}
    if m.path is not None:
        return load_pretrained(m.path, task=m.task, seed=m.init_seed, **changes)
    config = AutoConfig.for_model(m.family, **m.config)
    if labels:
        config.set_labels(labels)
    model = from_config(config, task=m.task, seed=m.init_seed)
    if m.tokenizer is None:
        raise ConfigError("model.family builds a model from scratch; set model.tokenizer to a directory "
                          "with tokenizer.json or vocab.txt")
    model.tokenizer = Tokenizer.from_dir(m.tokenizer)
    return model


def _sft_data(cfg: RunConfig, model: Any, train_records: list, eval_records: list | None) -> tuple[list, list | None]:
    """Chat JSONL -> SFT examples (assistant-only loss unless data.train_on = "all"); reports truncation."""
    from kiln.data.sft import encode_sft

    d = cfg.data
    train, stats = encode_sft(train_records, model.tokenizer, d.max_length, d.train_on, d.pack)
    print(f"train data: {stats.line()}")
    evals = None
    if eval_records:
        evals, eval_stats = encode_sft(eval_records, model.tokenizer, d.max_length, d.train_on, d.pack)
        print(f"eval data: {eval_stats.line()}")
    return train, evals


def build_trainer(cfg: RunConfig, resume: str | Path | None = None) -> Trainer:
    """Load the model and data a run config names and return a Trainer for it."""
    d = cfg.data
    if is_shard_dir(d.train):  # `kiln tokenize` output: pre-training on the token stream
        return build_pretrain_trainer(cfg, lambda: build_model(cfg, None), resume)
    train_records = read_records(d.train, d.format)
    eval_records = read_records(d.eval, d.format) if d.eval else None
    labels = _labels(cfg, train_records)
    model = build_model(cfg, labels)
    if model.tokenizer is None:
        raise KilnError(f"{cfg.model.path}: no tokenizer files (tokenizer.json or vocab.txt) in the model directory")
    if cfg.lora is not None:
        from kiln.models.common.lora import LoraConfig, apply_lora

        apply_lora(model, LoraConfig(cfg.lora.r, cfg.lora.alpha, cfg.lora.dropout, cfg.lora.targets, cfg.lora.use_rslora))
    if cfg.model.task == "causal-lm":
        train, evals = _sft_data(cfg, model, train_records, eval_records)
    else:
        fields = _fields(cfg)
        train = encode_records(train_records, cfg.model.task, model.tokenizer, labels, fields, d.max_length)
        evals = encode_records(eval_records, cfg.model.task, model.tokenizer, labels, fields, d.max_length) \
            if eval_records else None
    fingerprint = {"train": str(d.train), "train_sha256": file_sha256(d.train), "max_length": d.max_length,
                   "labels": labels, **({"train_on": d.train_on, "pack": d.pack} if cfg.model.task == "causal-lm" else {})}
    args = cfg.train
    if resume is not None:
        args = args.model_copy(update={"out_dir": str(resume)})
    return Trainer(model, train, eval_data=evals, args=args, resume=resume,
                   run_config=cfg.model_dump(mode="json"), data_fingerprint=fingerprint, parallel=cfg.parallel)
