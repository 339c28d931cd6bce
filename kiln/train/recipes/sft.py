"""sft: a causal LM fine-tuned (fully or with [lora]) on chat JSONL: `{"messages": [...]}` rendered
through the tokenizer's chat template, or `{"prompt", "response"}`; loss on the assistant replies
(data.train_on = "assistant") or on every token; data.pack (on by default) puts several samples in one
row with attention kept inside each, where the model keeps them apart (ForCausalLM.packs_samples):
otherwise rows stay one sample each (a message says so), or, when pack = true was asked for, it is an error."""

from __future__ import annotations

from typing import Any, Callable

from kiln.errors import ConfigError
from kiln.models.tasks import CAUSAL_LM
from kiln.train.recipes.base import RunParts
from kiln.train.recipes.finetune import FineTune


class SFT(FineTune):
    name = "sft"
    summary = "a causal LM on chat JSONL, loss on the replies, optional packing and LoRA"

    def matches(self, cfg: Any) -> bool:
        return cfg.model.task == CAUSAL_LM

    def build(self, cfg: Any, on_model: Callable[[Any], None]) -> RunParts:
        def check_packing(model: Any) -> None:
            on_model(model)
            d = cfg.data
            if not d.pack or getattr(model, "packs_samples", lambda: True)():
                return
            name = cfg.model.path or cfg.model.family
            if "pack" in d.model_fields_set:  # asked for explicitly: refuse rather than train across samples
                raise ConfigError(f"data.pack = true: {name} does not keep packed samples apart (its output for a "
                                  f"sample changes with what precedes it in the row); set data.pack = false")
            print(f"data.pack: {name} does not keep packed samples apart, so each row holds one sample")
            d.pack = False

        return super().build(cfg, check_packing)

    def fingerprint(self, cfg: Any, labels: list[str] | None) -> dict:
        return {**super().fingerprint(cfg, labels), "train_on": cfg.data.train_on, "pack": cfg.data.pack}

    def empty_hint(self, cfg: Any) -> str:
        d = cfg.data
        if d.train_on == "assistant":
            return (f"data.train_on = 'assistant' learns only assistant replies: check the messages have role "
                    f"'assistant' and that replies start within data.max_length = {d.max_length} tokens")
        return f"every sample needs at least 2 tokens within data.max_length = {d.max_length}"


RECIPE = SFT()
