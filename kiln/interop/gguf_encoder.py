"""Embedding encoders as llama.cpp runs them: BERT (`bert`) and ModernBERT (`modern-bert`), pooled.

llama.cpp computes one pooled vector per text (`--embedding`, llama-cpp-python's `Llama(embedding=True).embed`);
the pooling is metadata (`{arch}.pooling_type`): kiln writes the sentence-transformers pooling of the model
(`kiln.models.sentence.Pooling`; mean where the directory has none, as `load_sentence_model` assumes). llama.cpp
pools mean, CLS or last token; max / weighted-mean / sqrt-length pooling are refused by name. The Normalize module
is not metadata: llama.cpp's callers normalise (llama-cpp-python's `embed(normalize=True)`).

- BERT: post-LN encoder with absolute positions and token types (llama.cpp adds type 0, as kiln does for one
  text); `causal_attention = false`; the pooler and any task head are not written.
- ModernBERT: pre-LN, rotary (a theta for global and one for local layers: `rope.freq_base` /
  `rope.freq_base_swa`), which layers are local (`sliding_window_pattern`, one flag per layer) and the window
  (`sliding_window`; llama.cpp's symmetric window sees |i - j| <= window / 2, as kiln's), GeGLU (`hidden_act`); no biases (llama.cpp's graph has
  none, so a model with `attention_bias`, `mlp_bias` or `norm_bias` is refused).
"""

from __future__ import annotations

import gguf

from kiln.interop.gguf_layout import Tensors

POOLING = {"mean": gguf.PoolingType.MEAN, "cls": gguf.PoolingType.CLS, "lasttoken": gguf.PoolingType.LAST}
_HEADS = ("pooler.", "cls.", "head.", "decoder.", "classifier.", "qa_outputs.", "dense.")


def _common(w: gguf.GGUFWriter, c, ff: int, eps: float) -> None:
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(c.num_attention_heads)
    w.add_layer_norm_eps(eps)
    w.add_causal_attention(False)
    w.add_vocab_size(c.vocab_size)


def bert_hparams(w: gguf.GGUFWriter, c) -> None:
    _common(w, c, c.intermediate_size, c.layer_norm_eps)


def modernbert_hparams(w: gguf.GGUFWriter, c) -> None:
    _common(w, c, c.intermediate_size, c.norm_eps)
    w.add_rope_freq_base(float(c.rope("full_attention")["rope_theta"]))
    w.add_rope_freq_base_swa(float(c.rope("sliding_attention")["rope_theta"]))
    w.add_rope_scaling_type(gguf.RopeScalingType.NONE)
    w.add_sliding_window(c.local_attention)
    w.add_sliding_window_pattern([t == "sliding_attention" for t in c.attention_types])  # per layer: local?
    w.add_string(f"{w.arch}.hidden_activation", c.hidden_activation)


def encoder_tensors(hf: Tensors, c) -> Tensors:
    """The encoder's own tensors (task heads and BERT's pooler left out), without a `bert.` / `model.` prefix."""
    out = {}
    for key, t in hf.items():
        bare = key.split(".", 1)[1] if key.startswith(("bert.", "model.")) else key
        if not bare.startswith(_HEADS):
            out[bare] = t
    return out


def bert_checks(c) -> str | None:
    if getattr(c, "position_embedding_type", "absolute") != "absolute":
        return f"position_embedding_type {c.position_embedding_type!r}; llama.cpp's bert has absolute positions"
    if c.hidden_act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        return f"hidden_act {c.hidden_act!r}; llama.cpp's bert graph uses GELU"
    return None


def modernbert_checks(c) -> str | None:
    for flag in ("attention_bias", "mlp_bias", "norm_bias"):
        if getattr(c, flag, False):
            return f"{flag} is true; llama.cpp's modern-bert graph has no bias tensors"
    for kind in ("full_attention", "sliding_attention"):
        if c.rope(kind).get("rope_type", "default") != "default":
            return f"{kind} rope_type {c.rope(kind)['rope_type']!r}; llama.cpp's modern-bert rotates unscaled"
    if c.hidden_activation not in ("gelu", "silu"):
        return f"hidden_activation {c.hidden_activation!r}; llama.cpp's modern-bert runs GeGLU or SwiGLU"
    return None


def pooling_problem(mode: str) -> str | None:
    if mode not in POOLING:
        return (f"sentence-transformers pooling {mode!r}; llama.cpp pools {', '.join(POOLING)} only")
    return None
