"""The one registry: model_type -> family. AutoConfig, AutoModel and AutoModelFor<Task>.

The family comes from config.json's `model_type`; the head from the caller's Auto class, or
else from `architectures`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch

from kiln.errors import ConfigError
from kiln.hub import Tokenizer, read_config
from kiln.hub.bnb4 import bnb4_scheme_from_config
from kiln.hub.fp8 import scheme_from_config
from kiln.hub.index import CheckpointIndex
from kiln.hub.resolve import resolve_model_dir
from kiln.models import (
    albert,
    bert,
    deberta_v2,
    deepseek_v3,
    deepseek_v4,
    deepseek_v32,
    distilbert,
    glm_moe_dsa,
    llama,
    mamba,
    modernbert,
    qwen2,
    qwen3,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
    roberta,
    vit,
    xlm_roberta,
)
from kiln.models.common.fp8 import prepare_fp8
from kiln.models.common.load_plan import LoadPlan
from kiln.models.common.lora import has_adapter, load_adapter
from kiln.models.common.quant4 import prepare_bnb4, quantize_model
from kiln.models.config import FamilyConfig
from kiln.models.loading.plan import build_plan, read_held
from kiln.models.loading.read import materialize
from kiln.models.pretrained import Family, PreTrainedModel
from kiln.models.tasks import (
    BASE,
    CAUSAL_LM,
    IMAGE_CLASSIFICATION,
    MASKED_LM,
    QUESTION_ANSWERING,
    SEQUENCE_CLASSIFICATION,
    TOKEN_CLASSIFICATION,
)

REGISTRY: dict[str, Family] = {
    # encoders
    "bert": bert.FAMILY,
    "roberta": roberta.FAMILY,
    "xlm-roberta": xlm_roberta.FAMILY,
    "distilbert": distilbert.FAMILY,
    "albert": albert.FAMILY,
    "deberta-v2": deberta_v2.FAMILY,
    "modernbert": modernbert.FAMILY,
    # decoder LLMs
    "llama": llama.FAMILY,
    "qwen2": qwen2.FAMILY,
    "qwen3": qwen3.FAMILY,
    "qwen3_moe": qwen3_moe.FAMILY,
    "deepseek_v3": deepseek_v3.FAMILY,
    "deepseek_v32": deepseek_v32.FAMILY,
    "deepseek_v4": deepseek_v4.FAMILY,
    "glm_moe_dsa": glm_moe_dsa.FAMILY,
    "qwen3_next": qwen3_next.FAMILY,
    "qwen3_5_text": qwen3_5.TEXT,
    "qwen3_5_moe_text": qwen3_5.MOE_TEXT,
    "qwen3_5": qwen3_5.FAMILY,
    "qwen3_5_moe": qwen3_5.MOE_FAMILY,
    # state-space models
    "mamba": mamba.FAMILY,
    # vision
    "vit": vit.FAMILY,
}


def family_for(model_type: Any, source: str = "config.json") -> Family:
    if model_type not in REGISTRY:
        raise ConfigError(f"{source}: model_type {model_type!r} is not supported; "
                          f"supported model types: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[model_type]


def load_config(path: str | os.PathLike) -> tuple[Family, FamilyConfig, str | None]:
    """(family, typed config, task named by `architectures` or None) for a model directory or Hub repo id."""
    return config_of_dir(resolve_model_dir(path))


def config_of_dir(path: Path) -> tuple[Family, FamilyConfig, str | None]:
    """`load_config` of a resolved local directory (a load resolves its path once: kiln.hub.index)."""
    raw = read_config(path)
    source = str(Path(path) / "config.json")
    if "model_type" not in raw:
        raise ConfigError(f"{source}: no model_type key; supported model types: {', '.join(sorted(REGISTRY))}")
    family = family_for(raw["model_type"], source)
    config = family.config_cls.from_dict(raw, source=source)
    archs = raw.get("architectures") or []
    source_task = family.task_of(archs[0]) if archs else None
    return family, config, source_task


def apply_changes(config: FamilyConfig, changes: dict[str, Any]) -> FamilyConfig:
    """Caller overrides: `num_labels` / `labels` set the label set; other keys must be config fields."""
    labels = changes.pop("labels", None) or changes.pop("num_labels", None)
    fields = {f.name for f in dataclasses.fields(config)} - {"extra"}
    unknown = sorted(set(changes) - fields)
    if unknown:
        raise ConfigError(f"unknown config key(s) {unknown} for model_type {config.model_type!r}")
    config = config.replace(**changes) if changes else config.replace()
    if labels is not None and labels != config.labels and labels != config.num_labels:
        config.set_labels(labels)
    config.validate()
    return config


def plan_load(path: str | os.PathLike | CheckpointIndex, task: str | None = None, fp8: str = "dequantize",
              quantize: str | None = None, seed: int | None = None, tokenizer: bool = True,
              dtype: torch.dtype | None = None, **changes: Any) -> tuple[PreTrainedModel | None, LoadPlan]:
    """The load plan of an HF directory (or Hub repo id, or its index): the model built on meta holding the plan
    (`deferred_read`), and the plan: one typed source per tensor, or why the checkpoint loads whole
    (kiln.models.loading.plan). Every load reads it: `load_pretrained`, the sharded load, `kiln plan`."""
    index = path if isinstance(path, CheckpointIndex) else CheckpointIndex.open(path)  # the path resolved once
    family, config, source_task = config_of_dir(index.root)
    config = apply_changes(config, dict(changes))
    return build_plan(index, family, config, source_task, task or source_task or BASE, fp8, quantize, seed,
                      tokenizer, dtype)


def read_pretrained(path: str | os.PathLike | CheckpointIndex, device: torch.device | str = "cpu",
                    task: str | None = None, seed: int | None = None, fp8: str = "dequantize",
                    quantize: str | None = None, dtype: torch.dtype | None = None, **changes: Any
                    ) -> PreTrainedModel | None:
    """The model of an HF directory read from its load plan on one process, file -> `device` tensor by tensor (no
    whole copy in host memory), then cast to `dtype`, in eval mode; None where one process loads the checkpoint
    whole (the plan's `whole` says why)."""
    if seed is not None:
        torch.manual_seed(seed)
    model, plan = plan_load(path, task, fp8, quantize, seed, dtype=dtype, **changes)
    if model is None or plan.whole is not None:
        return None
    materialize(model, plan.index, device)
    read_held(model, plan)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def load_pretrained(path: str | os.PathLike, task: str | None = None, dtype: torch.dtype | None = None,
                    seed: int | None = None, fp8: str = "dequantize", quantize: str | None = None,
                    **changes: Any) -> PreTrainedModel:
    """Load an HF directory into kiln's own model code, keeping the stored dtypes.

    `path` may also be a Hub repo id, `org/name[@revision]`, read through the HF cache. `seed` makes
    the initial values of tensors the checkpoint lacks (a new head) reproducible. A block-scaled FP8
    directory is dequantized to `dtype` (default: its non-FP8 tensors' dtype), or with `fp8="keep"`
    held in FP8 modules (kiln.models.common.fp8). A bitsandbytes-4bit directory loads 4-bit as it is;
    `quantize` ("nf4" or "fp4") quantizes a plain one's Linears at load (kiln.models.common.quant4).

    The load plan's path on one process (`read_pretrained`), the same path a sharded load takes on each rank; where
    one process cannot read the plan (kiln.models.loading.plan lists each case and why), `load_whole`.
    """
    rng = torch.get_rng_state()
    index = CheckpointIndex.open(path)  # the path resolved once; each file's header read once, for either path
    model = read_pretrained(index, "cpu", task, seed, fp8, quantize, dtype, **changes)
    if model is None:
        torch.set_rng_state(rng)  # the plan's draws undone: the whole load draws as it always did
        return load_whole(index, task, dtype, seed, fp8, quantize, **changes)
    return model


def load_whole(path: str | os.PathLike | CheckpointIndex, task: str | None = None, dtype: torch.dtype | None = None,
               seed: int | None = None, fp8: str = "dequantize", quantize: str | None = None,
               **changes: Any) -> PreTrainedModel:
    """The whole load: every tensor read, then the model made from them (where the plan's path does not reach)."""
    if seed is not None:
        torch.manual_seed(seed)
    index = path if isinstance(path, CheckpointIndex) else CheckpointIndex.open(path)
    path = index.root
    family, config, source_task = config_of_dir(path)
    task = task or source_task or BASE
    config = apply_changes(config, dict(changes))
    with torch.device("meta"):
        model = family.build(config, task)
    weights = index.load_all()
    q4 = bnb4_scheme_from_config(config.extra, str(Path(path) / "config.json"))
    scheme = None if q4 is not None else scheme_from_config(config.extra, str(Path(path) / "config.json"))
    if scheme is not None:
        weights = prepare_fp8(model, weights, scheme, fp8, dtype, str(path))
    if q4 is not None:
        weights = prepare_bnb4(model, weights, q4, str(path))
    model.load_hf_state_dict(weights, source=str(path), source_task=source_task)
    if quantize is not None:  # before an adapter is put over the Linears
        quantize_model(model, quantize, source=str(path))
    if has_adapter(path):  # a PEFT LoRA adapter saved beside the base weights (kiln LoRA checkpoints)
        load_adapter(model, path)
    if dtype is not None:
        model.to(dtype)
    if Tokenizer.present(path):
        model.tokenizer = Tokenizer.from_dir(path)
    return model.eval()


def from_config(config: FamilyConfig, task: str = BASE, seed: int | None = None) -> PreTrainedModel:
    """A freshly initialised model (HF-style init) for a typed config."""
    family = family_for(config.model_type)
    if seed is not None:
        torch.manual_seed(seed)
    model = family.build(config, task)
    model.init_weights()
    return model


class AutoConfig:
    @staticmethod
    def from_pretrained(path: str | os.PathLike) -> FamilyConfig:
        return load_config(path)[1]

    @staticmethod
    def for_model(model_type: str, **fields: Any) -> FamilyConfig:
        family = family_for(model_type, "AutoConfig.for_model")
        return family.config_cls.from_dict(fields, source=f"{model_type} config")


class _AutoTask:
    task: str | None = None

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | None = None, **changes: Any):
        return load_pretrained(path, task=cls.task, dtype=dtype, **changes)

    @classmethod
    def from_config(cls, config: FamilyConfig, seed: int | None = None):
        return from_config(config, task=cls.task or BASE, seed=seed)


class AutoModel(_AutoTask):
    task = BASE


class AutoModelForSequenceClassification(_AutoTask):
    task = SEQUENCE_CLASSIFICATION


class AutoModelForTokenClassification(_AutoTask):
    task = TOKEN_CLASSIFICATION


class AutoModelForQuestionAnswering(_AutoTask):
    task = QUESTION_ANSWERING


class AutoModelForMaskedLM(_AutoTask):
    task = MASKED_LM


class AutoModelForCausalLM(_AutoTask):
    task = CAUSAL_LM


class AutoModelForImageClassification(_AutoTask):
    task = IMAGE_CLASSIFICATION


class AutoModelForImageTextToText(_AutoTask):
    """Image-text models (transformers' `...ForConditionalGeneration` of qwen3_5, qwen3_5_moe): the causal-LM
    head of a family whose model takes images (`pixel_values`, `image_grid_thw`)."""
    task = CAUSAL_LM

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, dtype: torch.dtype | None = None, **changes: Any):
        return _takes_images(super().from_pretrained(path, dtype=dtype, **changes), str(path))

    @classmethod
    def from_config(cls, config: FamilyConfig, seed: int | None = None):
        return _takes_images(super().from_config(config, seed=seed), f"{config.model_type} config")


def _takes_images(model: PreTrainedModel, source: str) -> PreTrainedModel:
    if not getattr(model, "takes_images", False):
        raise ConfigError(f"{source}: model_type {model.config.model_type!r} has no vision tower; image-text model "
                          f"types: qwen3_5, qwen3_5_moe")
    return model


class AutoModelForTask(_AutoTask):
    """The head named by the directory's `architectures` (base model when it names none)."""
    task = None
