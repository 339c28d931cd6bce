"""An importance matrix for llama.cpp's K-quant quantizer, computed by kiln on calibration text.

llama.cpp's quantizer (llama_model_quantize) takes, per GGUF tensor name, one weight per input column: the mean
square of that column's input activation over the calibration tokens (what its `llama-imatrix` tool collects); a
block's rounding then favours the columns that carry large inputs. kiln computes the same statistic with forward
pre-hooks on every Linear of its own float32 model over the text (chunks of up to `n_ctx` tokens) and hands it to
the quantizer as `llama_model_imatrix_data` entries. The GGUF tensor's input columns must be the HF matrix's
columns in order: true for the dense decoders (Llama's q/k permutation re-orders rows, not columns); families whose
export splits, stacks or re-orders matrices (MoE experts, MLA, the hybrids) are refused by name.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import numpy as np
import torch
from torch import nn

from kiln.errors import KilnError
from kiln.interop.gguf_arch import GgufFamily
from kiln.models.common.config import text_sizes
from kiln.models.pretrained import PreTrainedModel

IMATRIX_FAMILIES = ("llama", "qwen2", "qwen3")


def importance(model: PreTrainedModel, fam: GgufFamily, text: str, n_ctx: int = 512) -> dict[str, np.ndarray]:
    """GGUF tensor name -> mean squared input per column, over `text` tokenized by the model's tokenizer."""
    from kiln.models.common.lora import _hf_name

    config = model.config
    if config.model_type not in IMATRIX_FAMILIES:
        raise KilnError(f"--imatrix: {config.model_type} is not supported (kiln computes importance matrices for "
                        f"{', '.join(IMATRIX_FAMILIES)}, whose GGUF matrices keep kiln's input columns)")
    if model.tokenizer is None:
        raise KilnError("--imatrix: the model has no tokenizer to read the calibration text with")
    ids = model.tokenizer.backend.encode(text, add_special_tokens=False).ids
    if len(ids) < 2:
        raise KilnError("--imatrix: the calibration text tokenizes to fewer than 2 tokens")
    assert fam.arch is not None, "each of IMATRIX_FAMILIES has a gguf name table"
    names = gguf.get_tensor_name_map(fam.arch, text_sizes(config).num_hidden_layers)
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []
    for kname, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        gname = names.get_name(_hf_name(model, kname + ".weight"), try_suffixes=(".weight",))
        if gname is None:
            continue

        def hook(mod, args, gname=gname):
            x = args[0].detach().double().reshape(-1, args[0].shape[-1])
            sums[gname] = sums.get(gname, 0) + (x * x).sum(0)
            counts[gname] = counts.get(gname, 0) + x.shape[0]

        hooks.append(module.register_forward_pre_hook(hook))
    try:
        was = model.training
        model.eval()
        with torch.no_grad():
            for i in range(0, len(ids), n_ctx):
                chunk = ids[i:i + n_ctx]
                if len(chunk) >= 2:
                    model(input_ids=torch.tensor([chunk]))
        model.train(was)
    finally:
        for h in hooks:
            h.remove()
    return {g: (sums[g] / counts[g]).float().numpy() for g in sums}


class ImatrixArray:
    """The quantizer's NULL-terminated `llama_model_imatrix_data` array, keeping its buffers alive."""

    def __init__(self, data: dict[str, np.ndarray]):
        import llama_cpp

        self._arrays = [np.ascontiguousarray(v, dtype=np.float32) for v in data.values()]
        self._names = [k.encode() for k in data]
        self.entries = (llama_cpp.llama_model_imatrix_data * (len(data) + 1))()
        for i, (name, arr) in enumerate(zip(self._names, self._arrays)):
            self.entries[i].name = name
            self.entries[i].data = arr.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            self.entries[i].size = arr.size
        self.entries[len(data)].name = None  # the terminator llama.cpp stops at


def read_calibration(path: Path) -> str:
    if not path.is_file():
        raise KilnError(f"--imatrix {path}: no such text file")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise KilnError(f"--imatrix {path}: the calibration text is empty")
    return text
