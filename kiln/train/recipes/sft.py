"""sft: a causal LM fine-tuned (fully or with [lora]) on chat JSONL: `{"messages": [...]}` rendered
through the tokenizer's chat template, or `{"prompt", "response"}`; loss on the assistant replies
(data.train_on = "assistant") or on every token; data.pack puts several samples in one row with
attention kept inside each."""

from __future__ import annotations

from typing import Any

from kiln.models.tasks import CAUSAL_LM
from kiln.train.recipes.finetune import FineTune


class SFT(FineTune):
    name = "sft"
    summary = "a causal LM on chat JSONL, loss on the replies, optional packing and LoRA"

    def matches(self, cfg: Any) -> bool:
        return cfg.model.task == CAUSAL_LM

    def fingerprint(self, cfg: Any, labels: list[str] | None) -> dict:
        return {**super().fingerprint(cfg, labels), "train_on": cfg.data.train_on, "pack": cfg.data.pack}


RECIPE = SFT()
