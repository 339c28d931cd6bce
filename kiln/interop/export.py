"""Export an HF directory from a kiln model or a model directory."""

from __future__ import annotations

import copy
import os
from pathlib import Path

from kiln.errors import KilnError
from kiln.models.auto import load_pretrained
from kiln.models.pretrained import PreTrainedModel
from kiln.models.tasks import TASKS


def export_model(src: str | os.PathLike | PreTrainedModel, out: str | os.PathLike, head: str | None = None,
                 max_shard_bytes: int | None = None) -> Path:
    """Write `src` (a kiln model or an HF directory) to `out` as config.json + safetensors + tokenizer.

    `head` re-targets a directory to another task (e.g. `masked-lm` -> `base`); the written
    `architectures` always names the head that was built.
    """
    if head is not None and head not in TASKS:
        raise KilnError(f"unknown head {head!r}; choose one of: {', '.join(TASKS)}")
    if isinstance(src, PreTrainedModel):
        model = src
        if head is not None and head != model.task:
            raise KilnError(f"cannot re-head a model in memory ({model.task} -> {head}); export its directory instead")
    else:
        src_path = Path(src)
        out_path = Path(out)
        if out_path.exists() and src_path.resolve() == out_path.resolve():
            raise KilnError(f"--out {out} is the source directory; choose another directory")
        model = load_pretrained(src_path, task=head)
    if getattr(model, "lora_config", None) is not None:  # an HF directory is plain weights: fold LoRA in
        from kiln.models.common.lora import merge_lora

        model = merge_lora(copy.deepcopy(model)) if isinstance(src, PreTrainedModel) else merge_lora(model)
    return model.save_pretrained(out, max_shard_bytes=max_shard_bytes)
