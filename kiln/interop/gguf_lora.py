"""A LoRA adapter as a GGUF adapter file that llama.cpp applies over the base model's GGUF (`--lora FILE`,
llama-cpp-python's `lora_path`).

Layout (llama.cpp's adapter loader): `general.type = adapter`, `adapter.type = lora`, `adapter.lora.alpha`, and per
adapted matrix `<base tensor name>.lora_a` (r, in) and `.lora_b` (out, r). llama.cpp scales B A by alpha / r, so
alpha is written as kiln's scaling times r (rsLoRA's alpha / sqrt(r) included). Llama's q/k rows are re-ordered
in B as they are in the base weight (kiln.interop.gguf_arch). Adapters on stacked routed experts, and on a matrix
the family splits or re-orders in the file (DeepSeek's kv_b_proj), have no tensors of their own in this layout
and are refused by name.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import gguf
import torch

from kiln.errors import KilnError
from kiln.interop.gguf_arch import gguf_family
from kiln.interop.gguf_layout import permute_heads
from kiln.models.common.config import text_sizes
from kiln.models.common.lora import LoraLinear, _hf_name
from kiln.models.decoder_lm import DecoderConfig
from kiln.models.pretrained import PreTrainedModel


def write_gguf_lora(model: PreTrainedModel, out: str | os.PathLike, name: str | None = None) -> Path:
    """Write `model`'s LoRA adapters (f32) to `out` (.gguf)."""
    out = Path(out)
    if out.suffix != ".gguf":
        raise KilnError(f"--out {out}: a GGUF adapter is one file; name it *.gguf")
    config = model.config
    if getattr(model, "lora_config", None) is None:
        raise KilnError(f"{name or 'the model'}: holds no LoRA adapter to write")
    if getattr(model.lora_config, "target_parameters", None):
        raise KilnError("--lora-adapter: adapters on stacked routed experts (target_parameters) have no GGUF "
                        "adapter layout; export with --merge instead")
    fam = gguf_family(config.model_type, config)
    if fam.arch is None:
        raise KilnError(f"--lora-adapter: {fam.name} has no name table in the installed gguf package, so kiln writes "
                        "no GGUF adapter for it; export with --merge instead")
    names = gguf.get_tensor_name_map(fam.arch, text_sizes(config).num_hidden_layers)
    pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    scalings = set()
    for kname, module in model.named_modules():
        if not isinstance(module, LoraLinear):
            continue
        hf = _hf_name(model, kname + ".weight")
        base = names.get_name(hf, try_suffixes=(".weight",))
        if base is None or (fam.rewritten is not None and fam.rewritten(hf, config)):
            raise KilnError(f"--lora-adapter: adapted matrix {hf} has no llama.cpp tensor of its own in {fam.name} "
                            "(split or re-ordered there); export with --merge instead")
        a, b = module.lora_A.weight.detach().float(), module.lora_B.weight.detach().float()
        # permute_qk: Llama's q/k rows, a decoder's (DecoderConfig)
        if fam.permute_qk and isinstance(config, DecoderConfig) and hf.endswith("self_attn.q_proj.weight"):
            b = permute_heads(b, config.num_attention_heads)
        elif fam.permute_qk and isinstance(config, DecoderConfig) and hf.endswith("self_attn.k_proj.weight"):
            b = permute_heads(b, config.kv_heads)
        pairs.append((base, a, b))
        scalings.add((module.r, float(module.scaling)))
    if len({s for _, s in scalings}) != 1 or len({r for r, _ in scalings}) != 1:
        raise KilnError(f"--lora-adapter: adapters with different ranks or scalings {sorted(scalings)}; llama.cpp "
                        "applies one alpha per file")
    r, scaling = scalings.pop()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    try:
        w = gguf.GGUFWriter(tmp, fam.name)
        w.add_type(gguf.GGUFType.ADAPTER)
        w.add_name(name or config.model_type)
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, scaling * r)
        for base, a, b in pairs:
            w.add_tensor(base + ".lora_a", a.numpy(), raw_dtype=gguf.GGMLQuantizationType.F32)
            w.add_tensor(base + ".lora_b", b.numpy(), raw_dtype=gguf.GGMLQuantizationType.F32)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out
