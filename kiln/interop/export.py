"""Export an HF directory from a kiln model or a model directory.

Nothing is written over a directory that already holds a model, tokenizer or run unless
`overwrite`; the export is written beside `out` and moved in whole, so a failure leaves `out` as
it was. A load that dropped or made up tensors is refused unless allowed (kiln.interop.load_report).
"""

from __future__ import annotations

import copy
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from kiln.errors import KilnError
from kiln.hub.outdir import check_out_dir, staged_dir
from kiln.models.auto import load_config, load_pretrained
from kiln.models.pretrained import PreTrainedModel
from kiln.models.sentence import Pooling, sentence_model
from kiln.models.tasks import BASE, TASKS


def export_model(src: str | os.PathLike | PreTrainedModel, out: str | os.PathLike, head: str | None = None,
                 max_shard_bytes: int | None = None, overwrite: bool = False, allow_missing: bool = False,
                 allow_unused: bool = False, on_note: Callable[[str], None] | None = None,
                 dtype: torch.dtype | None = None, quantize: str | None = None) -> Path:
    """Write `src` (a kiln model or an HF directory) to `out` as config.json + safetensors + tokenizer.

    `head` re-targets a directory to another task (e.g. `masked-lm` -> `base`); the written
    `architectures` always names the head that was built. Tensors dropped or initialised on the way
    are reported to `on_note`; unexpected ones raise unless allowed. An FP8 source is written back
    FP8 (unchanged weights byte for byte); `dtype` writes every weight in that dtype instead, FP8
    dequantized and `quantization_config` dropped. A 4-bit (bitsandbytes) source is written back 4-bit,
    byte for byte, unless `dtype` or a LoRA merge dequantizes it; `quantize` ("nf4" | "fp4") writes the
    Linears as a bitsandbytes-4bit directory (after any merge).
    """
    from kiln.interop.load_report import check_load

    if head is not None and head not in TASKS:
        raise KilnError(f"unknown head {head!r}; choose one of: {', '.join(TASKS)}")
    out_path = Path(out)
    carried = None  # a file of the source directory that goes along unchanged
    if isinstance(src, PreTrainedModel):
        model = src
        if head is not None and head != model.task:
            raise KilnError(f"cannot re-head a model in memory ({model.task} -> {head}); export its directory instead")
        check_out_dir(out_path, overwrite)
    else:
        src_path = Path(src)
        if out_path.exists() and src_path.exists() and src_path.resolve() == out_path.resolve():
            raise KilnError(f"--out {out} is the source directory; choose another directory")
        check_out_dir(out_path, overwrite)
        source_task = load_config(src_path)[2]
        model = load_pretrained(src_path, task=head)
        notes = check_load(model, str(src_path), source_task, allow_missing=allow_missing,
                           allow_unused=allow_unused, new_head_asked=head is not None and head != source_task)
        for n in notes:
            (on_note or print)(n)
        pooling = Pooling.read(src_path) if model.task == BASE else None
        if pooling is not None:  # a sentence-transformers directory: its pooling files go along
            model = sentence_model(model, pooling)
        processor = src_path / "preprocessor_config.json"
        if getattr(model, "takes_images", False) and processor.is_file():
            carried = processor  # an image-text directory: the processor its images were read with goes along
    from kiln.models.common.lora import lora_config_of
    from kiln.models.common.quant4 import dequantize_bnb4_model, is_4bit, quantize_model

    if (dtype is not None or lora_config_of(model) is not None) and any(map(is_4bit, model.modules())):
        # a merged or plain-dtype export of a 4-bit base: every weight dequantized (re-quantized below if asked)
        # each of these changes the model it is given in place and hands it back
        model = dequantize_bnb4_model(copy.deepcopy(model) if model is src else model, dtype)
    if lora_config_of(model) is not None:  # an HF directory is plain weights: fold LoRA in
        from kiln.models.common.lora import merge_lora

        model = merge_lora(copy.deepcopy(model) if isinstance(src, PreTrainedModel) else model)
    if dtype is not None:  # plain weights in one dtype: FP8 dequantized (before a merge would re-quantize)
        from kiln.models.common.fp8 import dequantize_model

        model = dequantize_model(copy.deepcopy(model) if model is src else model, dtype)
    if quantize is not None:  # refused on a model still 4-bit: it is written 4-bit as it is
        model = copy.deepcopy(model) if model is src else model
        quantize_model(model, quantize, source="this model" if isinstance(src, PreTrainedModel) else str(src))
    with staged_dir(out_path) as tmp:
        model.save_pretrained(tmp, max_shard_bytes=max_shard_bytes)
        if carried is not None and not (tmp / carried.name).exists():
            shutil.copyfile(carried, tmp / carried.name)
    return out_path
