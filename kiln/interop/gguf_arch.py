"""GGUF architectures: which kiln families llama.cpp runs, their hyperparameter keys and tensor layouts.

A family is exported only if it has an entry in `GGUF_FAMILIES` (kiln model_type -> `GgufFamily`); any
other is refused by name. Tensor names come from the `gguf` package's own map (`gguf.get_tensor_name_map`,
the table llama.cpp's converter uses), applied to the HF names kiln writes; a family adds only what
differs from HF's layout:

- Llama: llama.cpp turns rotary pairs that sit next to each other (x0, x1), (x2, x3), ..., HF pairs dim i
  with dim i + d/2, so the q and k rows of each head are re-ordered (`gguf_layout.permute_heads`); llama3 rope scaling
  is a per-frequency divisor tensor `rope_freqs.weight`.
- Qwen2 / Qwen3 / Qwen3-MoE: llama.cpp uses HF's half-split rotary order (NEOX), no permutation; the MoE
  family's per-expert matrices are stacked into one (E, out, in) tensor per projection.
- Mamba: llama.cpp keeps A = -exp(A_log) and the depthwise conv kernel as (inner, kernel).
- DeepSeek-V3 (deepseek2, MLA), DeepSeek-V3.2 (deepseek32) and GLM-5 (glm-dsa), MLA + the DSA indexer:
  kiln.interop.gguf_deepseek re-lays the HF tensors (`rewrite`).
- Qwen3-Next / Qwen3.5 text (qwen3next, qwen35, qwen35moe): kiln.interop.gguf_hybrid.
- DeepSeek-V4 (deepseek4): kiln.interop.gguf_deepseek4 names its tensors and keys itself (`named`; the installed
  gguf package has no deepseek4).
- BERT / ModernBERT embeddings (bert, modern-bert): kiln.interop.gguf_encoder.
RoPE scaling metadata (linear, YaRN) and the shared row helpers are in kiln.interop.gguf_layout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import gguf
import torch

from kiln.errors import KilnError
from kiln.interop.gguf_deepseek import (
    dense_lead,
    dsa_checks,
    dsa_hparams,
    indexer_hparams,
    mla_bias,
    mla_hparams,
    mla_rewritten,
    mla_tensors,
    mla_yarn,
    v32_checks,
)
from kiln.interop.gguf_deepseek4 import v4_checks, v4_hparams, v4_tensors
from kiln.interop.gguf_encoder import (
    bert_checks,
    bert_hparams,
    encoder_tensors,
    modernbert_checks,
    modernbert_hparams,
)
from kiln.interop.gguf_hybrid import hybrid_checks, hybrid_hparams, hybrid_tensors
from kiln.interop.gguf_layout import (
    Tensors,
    decoder_hparams,
    permute_heads,
    stack_experts,
    yarn_problem,
)
from kiln.models.common.rope import _base_inv_freq, _llama3


def _moe_hparams(w: gguf.GGUFWriter, c) -> None:
    decoder_hparams(w, c)
    w.add_expert_count(c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)


def _mamba_hparams(w: gguf.GGUFWriter, c) -> None:
    # no positions and no attention: the context length is only the KV-free state's bookkeeping in llama.cpp
    w.add_context_length(2 ** 20)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(c.num_hidden_layers)
    w.add_ssm_conv_kernel(c.conv_kernel)
    w.add_ssm_inner_size(c.expand * c.hidden_size)
    w.add_ssm_state_size(c.state_size)
    w.add_ssm_time_step_rank(c.time_step_rank)
    w.add_layer_norm_rms_eps(c.layer_norm_epsilon)
    w.add_vocab_size(c.vocab_size)


def _mamba_tensor(key: str, t: torch.Tensor, c) -> torch.Tensor:
    if key.endswith(".A_log"):  # llama.cpp stores A itself
        return -torch.exp(t.float())
    if key.endswith(".conv1d.weight"):  # (I, 1, K) depthwise kernel -> (I, K)
        return t.squeeze(1)
    return t


def _no_linear_bias(config) -> str | None:
    return "use_bias (in_proj / out_proj biases) has no tensor in llama.cpp's mamba" if config.use_bias else None


Named = Callable[[Tensors, object], Iterator[tuple[str, "gguf.MODEL_TENSOR | None", torch.Tensor]]]


@dataclass(frozen=True)
class GgufFamily:
    arch: gguf.MODEL_ARCH | None                        # None: the gguf package has no such arch (`named`)
    hparams: Callable[[gguf.GGUFWriter, object], None]
    rope_types: tuple[str, ...] | None = None           # rope_type values llama.cpp reproduces (None: no rope)
    permute_qk: bool = False                            # Llama: rotary pairs adjacent in llama.cpp
    experts: bool = False                               # per-expert HF matrices stacked into one tensor
    adjust: Callable[[str, torch.Tensor, object], torch.Tensor] | None = None  # (HF key, tensor, config)
    checks: tuple[Callable[[object], str | None], ...] = field(default_factory=tuple)  # config -> refusal or None
    rewrite: Callable[[Tensors, object], Tensors] | None = None  # HF tensors -> the names / layouts the map takes
    rewritten: Callable[[str, object], bool] | None = None       # (HF name, config): not kiln's matrix in the file
    encoder: bool = False                                       # pooled embeddings (gguf_encoder), no LM head
    # the architecture the file names, where the bundled llama.cpp knows one the installed `gguf` package (0.19.0
    # on PyPI) predates; tensor names then come from `arch`, whose name table is the same
    file_arch: str | None = None
    # HF tensors -> (llama.cpp name, the package's kind where it has one, tensor), for an arch with no name table
    named: Named | None = None

    @property
    def name(self) -> str:
        if self.file_arch is not None:
            return self.file_arch
        assert self.arch is not None, "a family without a gguf arch names its file_arch"
        return gguf.MODEL_ARCH_NAMES[self.arch]


def _all_layers_sparse(config) -> str | None:
    dense = [i for i in range(config.num_hidden_layers) if not config.is_sparse(i)]
    if dense:
        return (f"layers {dense} are dense MLPs (mlp_only_layers / decoder_sparse_step); llama.cpp's qwen3moe "
                "graph has a MoE block in every layer")
    return None


def _topk_renormalised(config) -> str | None:
    if not config.norm_topk_prob:
        return ("norm_topk_prob is false; llama.cpp's qwen3moe graph always renormalises the top-k router "
                "weights, so its outputs would differ")
    return None


def _yarn(config) -> str | None:
    return yarn_problem(config.rope_parameters or {}, config.max_position_embeddings)


GGUF_FAMILIES: dict[str, GgufFamily] = {
    "llama": GgufFamily(gguf.MODEL_ARCH.LLAMA, decoder_hparams, ("default", "linear", "llama3", "yarn"),
                        permute_qk=True, checks=(_yarn,)),
    "qwen2": GgufFamily(gguf.MODEL_ARCH.QWEN2, decoder_hparams, ("default", "linear", "yarn"), checks=(_yarn,)),
    "qwen3": GgufFamily(gguf.MODEL_ARCH.QWEN3, decoder_hparams, ("default", "linear", "yarn"), checks=(_yarn,)),
    "qwen3_moe": GgufFamily(gguf.MODEL_ARCH.QWEN3MOE, _moe_hparams, ("default", "linear", "yarn"), experts=True,
                            checks=(_all_layers_sparse, _topk_renormalised, _yarn)),
    "glm_moe_dsa": GgufFamily(gguf.MODEL_ARCH.GLM_DSA, dsa_hparams, ("default", "yarn"), rewrite=mla_tensors,
                              rewritten=mla_rewritten, checks=(mla_yarn, mla_bias, dense_lead, dsa_checks)),
    "deepseek_v3": GgufFamily(gguf.MODEL_ARCH.DEEPSEEK2, mla_hparams, ("default", "yarn"), rewrite=mla_tensors,
                              rewritten=mla_rewritten, checks=(mla_yarn, mla_bias)),
    # deepseek32's tensors are glm-dsa's less attn_kv_b (never written: kv_b is split into k_b / v_b)
    "deepseek_v32": GgufFamily(gguf.MODEL_ARCH.GLM_DSA, indexer_hparams, ("default", "yarn"), rewrite=mla_tensors,
                               rewritten=mla_rewritten, checks=(mla_yarn, mla_bias, dense_lead, v32_checks),
                               file_arch="deepseek32"),
    "qwen3_next": GgufFamily(gguf.MODEL_ARCH.QWEN3NEXT, hybrid_hparams, ("default",), rewrite=hybrid_tensors,
                             checks=(hybrid_checks,)),
    "qwen3_5_text": GgufFamily(gguf.MODEL_ARCH.QWEN35, hybrid_hparams, ("default",), rewrite=hybrid_tensors,
                               checks=(hybrid_checks,)),
    "qwen3_5_moe_text": GgufFamily(gguf.MODEL_ARCH.QWEN35MOE, hybrid_hparams, ("default",), rewrite=hybrid_tensors,
                                   checks=(hybrid_checks,)),
    "deepseek_v4": GgufFamily(None, v4_hparams, checks=(v4_checks,), named=v4_tensors, file_arch="deepseek4"),
    "bert": GgufFamily(gguf.MODEL_ARCH.BERT, bert_hparams, rewrite=encoder_tensors, checks=(bert_checks,),
                       encoder=True),
    "modernbert": GgufFamily(gguf.MODEL_ARCH.MODERN_BERT, modernbert_hparams, rewrite=encoder_tensors,
                             checks=(modernbert_checks,), encoder=True),
    "mamba": GgufFamily(gguf.MODEL_ARCH.MAMBA, _mamba_hparams, adjust=_mamba_tensor, checks=(_no_linear_bias,)),
}


def gguf_family(model_type: str, config) -> GgufFamily:
    """The family's GGUF entry, or a KilnError that names the family and why it cannot be exported."""
    fam = GGUF_FAMILIES.get(model_type)
    if fam is None:
        raise KilnError(f"--format gguf: kiln cannot export family {model_type!r} to GGUF yet; exportable: "
                        f"{', '.join(GGUF_FAMILIES)}")
    if fam.rope_types is not None:
        kind = (config.rope_parameters or {}).get("rope_type", "default")
        if kind not in fam.rope_types:
            raise KilnError(f"--format gguf: {model_type} with rope_type {kind!r} is not exported (llama.cpp's "
                            f"{fam.name} is checked here with rope types {', '.join(fam.rope_types)})")
    for check in fam.checks:
        problem = check(config)
        if problem is not None:
            raise KilnError(f"--format gguf: {model_type}: {problem}")
    return fam


def gguf_tensors(fam: GgufFamily, c, hf: Tensors) -> Iterator[tuple[str, gguf.MODEL_TENSOR | None, torch.Tensor]]:
    """(GGUF name, its kind, tensor in HF orientation) for every tensor of the model, plus generated ones
    (rope_freqs)."""
    if fam.named is not None:
        yield from fam.named(hf, c)
        return
    if fam.experts:
        hf = stack_experts(hf, c.num_hidden_layers, c.num_experts)
    if fam.rewrite is not None:
        hf = fam.rewrite(hf, c)
    assert fam.arch is not None, "a family without a gguf arch names its tensors (named)"
    names = gguf.get_tensor_name_map(fam.arch, c.num_hidden_layers)
    rope = getattr(c, "rope_parameters", None) or {}
    if rope.get("rope_type") == "llama3":
        # llama.cpp divides each base frequency by this factor; kiln's scaled frequencies give it exactly
        base = _base_inv_freq(float(rope["rope_theta"]), c.dim_head)
        yield (gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight", gguf.MODEL_TENSOR.ROPE_FREQS,
               (base / _llama3(base, rope)).float())
    unmapped = []
    for key, t in hf.items():
        found = names.get_type_and_name(key, try_suffixes=(".weight", ".bias"))
        if found is None:
            unmapped.append(key)
            continue
        kind, name = found
        if fam.adjust is not None:
            t = fam.adjust(key, t, c)
        if fam.permute_qk and key.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            t = permute_heads(t, c.num_attention_heads)
        elif fam.permute_qk and key.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            t = permute_heads(t, c.kv_heads)
        yield name, kind, t
    if unmapped:
        raise KilnError(f"--format gguf: {len(unmapped)} tensors have no llama.cpp name for {fam.name}: "
                        f"{unmapped[:5]}")
