"""Tiny bitsandbytes-4bit checkpoints saved by transformers, for the QLoRA tests.

Every Linear's input size is a multiple of 64: bitsandbytes 0.50's AVX-512 CPU dequantization scales by
row-wise blocks, which differs from its own (flat-block) quantization when a row is not a whole number of
blocks, so transformers' outputs are only bitsandbytes' intended arithmetic on such shapes.
"""

from __future__ import annotations

from pathlib import Path

import torch

QLORA_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def bf16_source(tiny_factory, tmp_path: Path) -> Path:
    """The tiny Qwen3 causal LM in bf16 (what both sides quantize from)."""
    from kiln.interop.export import export_model

    out = tmp_path / "bf16"
    if not out.exists():
        export_model(tiny_factory("qwen3", "causal-lm", **QLORA_TINY), out, dtype=torch.bfloat16)
    return out


def transformers_bnb4(src: Path, out: Path, quant_type: str = "nf4", double: bool = True,
                      compute: torch.dtype = torch.bfloat16) -> Path:
    """`src` loaded by transformers with BitsAndBytesConfig(load_in_4bit) and saved: its 4-bit directory."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double,
                           bnb_4bit_compute_dtype=compute)
    AutoModelForCausalLM.from_pretrained(src, quantization_config=q, dtype=torch.bfloat16).save_pretrained(out)
    return out


def transformers_model(path: Path, adapter: Path | None = None):
    """transformers' model of a 4-bit directory (with a peft adapter), computing as bitsandbytes' CPU
    training path does: dequantize to the compute dtype, then one matmul (its AVX-512-BF16 inference
    kernel, which packs the weight its own way, switched off)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return model.eval()


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out
