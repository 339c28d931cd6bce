"""verify-export for an embedding encoder's GGUF (BERT, ModernBERT): llama.cpp's pooled vectors against kiln's.

llama.cpp loads the file in embedding mode (the pooling the file names) and embeds each fixed text; kiln embeds it
with the model's sentence-transformers pooling, unnormalised on both sides (normalising is the caller's in
llama.cpp). llama.cpp's CPU GELU (and GeGLU) is a table over f16 inputs (ggml's GGML_GELU_FP16: the input rounded
to f16, the tanh form looked up, the output an f16), whatever the file's type; so kiln's reference runs its GELUs
the same way (`ggml_gelu`), and the difference from kiln's exact-GELU model is printed beside it. f32: the largest
difference over the texts is within 1e-4 of the largest kiln value (the f32 bound of the logits check); f16 / bf16 /
q8_0: within an estimate of the type's rounding (weights and activations rounded, two matmuls per layer adding in
quadrature over the depth, 3x headroom), printed with the measured value.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from kiln.errors import KilnError
from kiln.interop.verify import Check
from kiln.models.common.config import text_sizes
from kiln.models.pretrained import PreTrainedModel

F32_REL = 1e-4
# relative RMS error of a stored matrix and of llama.cpp's rounded activations, per type
_WEIGHT = {"f16": 2.0 ** -11, "bf16": 2.0 ** -8, "q8_0": 0.009}
_ACT = {"f16": 2.0 ** -11, "bf16": 2.0 ** -8, "q8_0": 2.5 / (127 * math.sqrt(12))}


def ggml_gelu(x: torch.Tensor) -> torch.Tensor:
    """llama.cpp's CPU GELU: f16 input, tanh form, f16 output; |x| >= 10 passed through (x) or cut (0)."""
    h = x.float().to(torch.float16).float()
    y = (0.5 * h * (1 + torch.tanh(math.sqrt(2 / math.pi) * h * (1 + 0.044715 * h * h)))).to(torch.float16).float()
    return torch.where(x <= -10, torch.zeros_like(y), torch.where(x >= 10, x.float(), y)).to(x.dtype)


@contextmanager
def llama_cpp_gelu():
    """kiln's GELU modules compute `ggml_gelu` inside the block."""
    from kiln.models.common import activations

    forward = activations.GELU.forward
    activations.GELU.forward = lambda self, x: ggml_gelu(x)
    try:
        yield
    finally:
        activations.GELU.forward = forward


def _embedder(path: Path, n_ctx: int):
    import llama_cpp

    try:
        return llama_cpp.Llama(model_path=str(path), embedding=True, n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx,
                               verbose=False, n_threads=1, n_threads_batch=1, seed=0)
    except (ValueError, RuntimeError) as e:
        raise KilnError(f"{path}: llama.cpp cannot load it: {e}") from None


def embedding_checks(path: Path, model: PreTrainedModel, prompts: list[str], type_name: str) -> list[Check]:
    from kiln.interop.gguf_export import pooling_mode
    from kiln.models.sentence import Pooling, sentence_model

    pooling = getattr(model, "pooling", None)  # a bare encoder: the mean pooling its export wrote
    sentence = sentence_model(model, Pooling() if pooling is None else pooling)
    config, tok = sentence.config, sentence.tokenizer
    if tok is None:
        raise KilnError(f"{path}: the model has no tokenizer; the check compares llama.cpp's ids with kiln's")
    llm = _embedder(path, min(getattr(config, "max_position_embeddings", 512), 512))
    checks = [Check("llama.cpp loads", llm.n_vocab() == text_sizes(config).vocab_size,
                    f"{type_name}, arch {llm.metadata.get('general.architecture')}, vocab {llm.n_vocab()}, "
                    f"pooling {pooling_mode(sentence)}")]
    ours = [tok.backend.encode(p, add_special_tokens=True).ids for p in prompts]
    theirs = [llm.tokenize(p.encode(), add_bos=True, special=False) for p in prompts]
    bad = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    checks.append(Check("tokenizer", not bad, f"{len(prompts)} texts tokenize to kiln's ids" if not bad else
                        f"differ on {prompts[bad[0]]!r}: kiln {ours[bad[0]]} llama.cpp {theirs[bad[0]]}"))
    a = np.array([llm.embed(p, normalize=False) for p in prompts], dtype=np.float64)
    exact = sentence.embed(prompts, normalize=False).double().numpy()
    with llama_cpp_gelu():
        b = sentence.embed(prompts, normalize=False).double().numpy()
    rel = float(np.abs(a - b).max() / np.abs(b).max())
    rel_exact = float(np.abs(a - exact).max() / np.abs(exact).max())
    if type_name == "f32":
        bound = F32_REL
    else:
        w, act = _WEIGHT.get(type_name), _ACT.get(type_name)
        if w is None or act is None:
            raise KilnError(f"{path}: verify-export checks embedding GGUFs in f32, f16, bf16 and q8_0, not {type_name}")
        bound = 3 * math.sqrt((w ** 2 + act ** 2) * 2 * (text_sizes(config).num_hidden_layers + 1))
    cos = float(((a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))).min())
    checks.append(Check("pooled embeddings", rel <= bound, f"{len(prompts)} texts, max relative difference "
                        f"{rel:.3g} (bound {bound:.3g}; kiln's GELUs as llama.cpp's f16 table), lowest cosine "
                        f"{cos:.6f}; against kiln's exact GELU {rel_exact:.3g}"))
    return checks
