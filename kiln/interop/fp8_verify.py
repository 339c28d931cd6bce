"""The transformers side of verify-export for a block-scaled FP8 directory.

transformers computes FP8 layers with GPU kernels; on a CPU it refuses to keep them FP8 and
dequantizes while loading (`FineGrainedFP8Config(dequantize=True)`, which verify asks for everywhere so
both sides compute with the same dequantized weights). That loader derives each block size from the
scale grid (rows // scale rows), which is right only where every weight dimension is a multiple of
the block or fits in one block; with partial blocks it refuses the shape or, where the grid happens
to divide it, reads other blocks. There verify dequantizes each weight with transformers' own
block-true `finegrained_fp8._dequantize_fp8_weight` into a plain float copy and loads that instead,
and says so in the check's name (packed FP4 experts, which that function refuses, through the loader's own
`Fp8Dequantize`, whose (1, 32) FP4 blocks always divide). DeepSeek-V4's `<module>.scale` names and
`expert_dtype` reach transformers as its loader reads them.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from kiln.hub import load_weights, save_weights
from kiln.hub.fp8 import FP4_BLOCK, FP8, SCALE_SUFFIX, Fp8Scheme, canonical_scales, is_fp4, logical_shape
from kiln.models.common.fp8 import compute_dtype_of


def loader_reads_blocks(state: dict[str, torch.Tensor], block: tuple[int, int] | None) -> bool:
    """Whether transformers' grid-derived block size equals the real one for every FP8 weight here."""
    def fits(t: torch.Tensor, blk: tuple[int, int]) -> bool:
        return all(n % b == 0 or n <= b for n, b in zip(logical_shape(t)[-2:], blk))

    return all(fits(t, FP4_BLOCK) if is_fp4(t) else block is None or fits(t, block)
               for k, t in state.items() if t.dtype == FP8 or (is_fp4(t) and k + SCALE_SUFFIX in state))


def load_transformers_fp8(auto: Any, model_dir: Path, scheme: Fp8Scheme) -> tuple[Any, dict, str]:
    """(transformers model with dequantized weights, its loading info, how it was dequantized)."""
    from transformers import FineGrainedFP8Config

    state, _ = canonical_scales(load_weights(model_dir), scheme)
    dtype = scheme.dtype or compute_dtype_of(state)
    if loader_reads_blocks(state, scheme.block):
        # weight_block_size None (per-tensor scales): transformers' annotation omits it; its post_init takes it
        q = FineGrainedFP8Config(dequantize=True, weight_block_size=scheme.block,  # type: ignore[arg-type]
                                 scale_fmt=scheme.scale_fmt,
                                 modules_to_not_convert=list(scheme.modules_to_not_convert) or None,
                                 expert_dtype=scheme.expert_dtype)
        model, info = auto.from_pretrained(str(model_dir), dtype=dtype, quantization_config=q,
                                           output_loading_info=True)
        return model, info, "its FP8 loader, dequantizing"
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    def dequantized(k: str, v: torch.Tensor) -> torch.Tensor:
        scale = state[k + SCALE_SUFFIX]
        if is_fp4(v):
            return Fp8Dequantize(None)._dequantize_one(v, scale, output_dtype=dtype)
        return _dequantize_fp8_weight(v, scale, block, dtype)

    block = None if scheme.block is None else list(scheme.block)  # None: per-tensor scales
    with tempfile.TemporaryDirectory() as tmp:
        plain = Path(tmp)
        for f in model_dir.iterdir():
            if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
                shutil.copy(f, plain / f.name)
        cfg = json.loads((model_dir / "config.json").read_text())
        cfg.pop("quantization_config")
        (plain / "config.json").write_text(json.dumps(cfg))
        weights = {k: dequantized(k, v) if k + SCALE_SUFFIX in state else v
                   for k, v in state.items() if not (k.endswith(SCALE_SUFFIX) and k[:-len(SCALE_SUFFIX)] in state)}
        save_weights(plain, weights)
        model, info = auto.from_pretrained(str(plain), dtype=dtype, output_loading_info=True)
    return model, info, "finegrained_fp8._dequantize_fp8_weight (its loader cannot read partial blocks)"
