"""sft: a causal LM fine-tuned (fully or with [lora]) on chat JSONL: `{"messages": [...]}` rendered
through the tokenizer's chat template, or `{"prompt", "response"}`; loss on the assistant replies
(data.train_on = "assistant") or on every token; data.pack (on by default) puts several samples in one
row with attention kept inside each, where the model keeps them apart (ForCausalLM.packs_samples):
otherwise rows stay one sample each (a message says so), or, when pack = true was asked for, it is an error.
An image-text model (a vision tower) also reads image parts in the messages (kiln.data.sft_images): their
pixels ride with the rows, packed rows included, and its checkpoints carry the image processor."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal

from torch import nn

from kiln.data.sft_images import ImageTokens
from kiln.hub.resolve import resolve_model_dir
from kiln.models.qwen3_5_vision import ImageTextForCausalLM as VisionTextForCausalLM
from kiln.models.tasks import CAUSAL_LM, Task
from kiln.parallel.world import World
from kiln.train.config import DataSection, RunConfig
from kiln.train.packing import settle_pack
from kiln.train.recipes.base import RunParts
from kiln.train.recipes.finetune import FineTune, RecordsData


class SFTData(RecordsData):
    """[data] of an sft run: what the loss sees and how samples share rows."""
    train_on: Literal["assistant", "assistant_no_reasoning", "all"] = "assistant"  # loss on replies (+ EOS), without their reasoning text, or on all tokens
    pack: bool = True                    # several samples per row, attention kept per sample
                                         # (where the model cannot keep them apart, rows stay one sample each)
    # image-text models: image parts in messages (paths relative to the records file)
    max_image_pixels: int | None = None  # refuse source images larger than this (width x height)
    image_min_pixels: int | None = None  # the processor's resize bounds (area after resizing), when not the
    image_max_pixels: int | None = None  # model directory's preprocessor_config.json values


class SFT(FineTune):
    name = "sft"
    summary = "a causal LM on chat JSONL, loss on the replies, optional packing and LoRA"
    when = f"model.task = {CAUSAL_LM!r} on records"
    data_schema: type[DataSection] = SFTData

    def matches(self, task: str, data: Mapping[str, Any]) -> bool:
        return task == CAUSAL_LM

    def build(self, cfg: RunConfig, on_model: Callable[[nn.Module], None], world: World) -> RunParts:
        d = cfg.data
        assert isinstance(d, SFTData), f"sft builds from its own [data] schema, got {type(d).__name__}"

        def check_packing(model: nn.Module) -> None:
            on_model(model)
            settle_pack(d, model, str(cfg.model.path or cfg.model.family))

        return super().build(cfg, check_packing, world)

    def encode(self, cfg: RunConfig, task: Task, model: nn.Module, records: list, labels: list[str] | None,
               name: str) -> list[dict]:
        """Chat records as examples; for a model with a vision tower, with the images of their image parts."""
        if not (isinstance(model, VisionTextForCausalLM) and model.takes_images):
            return super().encode(cfg, task, model, records, labels, name)
        from kiln.data.sft import encode_sft

        d = cfg.data
        assert isinstance(d, SFTData), f"sft builds from its own [data] schema, got {type(d).__name__}"
        source = d.eval if name == "eval" else d.train
        assert source is not None, "eval records come from data.eval"
        assert model.tokenizer is not None, "check_text_model refuses a model without a tokenizer"
        examples, stats = encode_sft(records, model.tokenizer, d.max_length, d.train_on, d.pack,
                                     images=image_tokens(cfg, model, Path(source).parent))
        print(f"{name} data: {stats.line()}")
        return examples

    def fingerprint(self, cfg: RunConfig, labels: list[str] | None) -> dict[str, Any]:
        d = cfg.data
        assert isinstance(d, SFTData)
        images = {k: getattr(d, k) for k in ("image_min_pixels", "image_max_pixels", "max_image_pixels")
                  if getattr(d, k) is not None}  # only when set: runs without images keep their fingerprint
        return {**super().fingerprint(cfg, labels), "train_on": d.train_on, "pack": d.pack, **images}

    def empty_hint(self, cfg: RunConfig) -> str:
        d = cfg.data
        assert isinstance(d, SFTData)
        if d.train_on == "assistant":
            return (f"data.train_on = 'assistant' learns only assistant replies: check the messages have role "
                    f"'assistant' and that replies start within data.max_length = {d.max_length} tokens")
        return f"every sample needs at least 2 tokens within data.max_length = {d.max_length}"


def image_tokens(cfg: RunConfig, model: VisionTextForCausalLM, root: Path) -> ImageTokens:
    """The image processor (the model directory's preprocessor_config.json, else the tower's patch sizes; the
    [data] resize bounds over either) and the model's vision tokens; the processor goes with the model so its
    checkpoints write it."""
    d = cfg.data
    assert isinstance(d, SFTData), f"sft builds from its own [data] schema, got {type(d).__name__}"
    spec = model.image_tokens(model_dir=resolve_model_dir(cfg.model.path) if cfg.model.path else None, root=root)
    processor = spec.processor
    processor.min_pixels = d.image_min_pixels or processor.min_pixels
    processor.max_pixels = d.image_max_pixels or processor.max_pixels
    processor.max_input_pixels = d.max_image_pixels
    model.image_processor = processor
    return spec


RECIPE = SFT()
