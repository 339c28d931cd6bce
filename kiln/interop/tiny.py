"""Tiny random HF checkpoints built by transformers itself, for parity tests and the verify matrix.

Every parameter is drawn at random (not HF's zero biases and unit norms), so a swapped or
dropped tensor cannot hide behind an initial value.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import WordPiece

from kiln.models.auto import family_for
from kiln.models.tasks import get_task

# Hybrid DeltaNet decoders: a Gated DeltaNet layer (2 key heads serving 4 value heads) then a gated attention
# layer whose rotary turns 4 of its 16 dims; Qwen3-Next and Qwen3.5-MoE route over 4 experts plus the gated
# shared expert (Qwen3-Next's layer 1 dense); Qwen3.5 image-text rows add a one-block vision tower.
_HYBRID = dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
               layer_types=["linear_attention", "full_attention"], linear_num_key_heads=2, linear_num_value_heads=4,
               linear_key_head_dim=8, linear_value_head_dim=8)
_HYBRID_MOE = dict(_HYBRID, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=4,
                   num_experts_per_tok=2)
_VISION = dict(vision_config=dict(depth=1, hidden_size=16, intermediate_size=24, num_heads=2, patch_size=4,
                                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32,
                                  num_position_embeddings=16),
               image_token_id=95, video_token_id=96, vision_start_token_id=97, vision_end_token_id=98)

# The smallest configs that still exercise every path (2 layers, several heads, padding id kept).
TINY: dict[str, dict[str, Any]] = {
    "bert": dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                 max_position_embeddings=64, type_vocab_size=2),
    "roberta": dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                    max_position_embeddings=72, type_vocab_size=1),
    "xlm-roberta": dict(vocab_size=101, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=37, max_position_embeddings=72, type_vocab_size=1),
    "distilbert": dict(vocab_size=99, dim=32, n_layers=2, n_heads=4, hidden_dim=37, max_position_embeddings=64),
    # Decoders: grouped-query attention (4 heads over 2 kv heads) everywhere; each one also takes a
    # path the others do not: tied embeddings + llama3 rope, yarn rope, head_dim != hidden/heads,
    # a MoE layer beside a dense one.
    "llama": dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
                  rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                                       high_freq_factor=4.0, original_max_position_embeddings=16)),
    "qwen2": dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64,
                  rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                       original_max_position_embeddings=16)),
    "qwen3": dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64),
    "qwen3_moe": dict(vocab_size=99, hidden_size=32, intermediate_size=37, moe_intermediate_size=16,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      max_position_embeddings=64, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                      mlp_only_layers=[1]),
    # MLA + group-limited sigmoid MoE: V3 without a query latent (q_proj), yarn rope with mscale on the softmax
    # scale, 4 expert groups (2 kept), 2 shared experts; V3.2 with a query latent and an indexer keeping 4 keys
    # (fewer than the test sequences); GLM-5 with a shared-indexer layer and interleaved indexer rope.
    "deepseek_v3": dict(vocab_size=99, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                        num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2, first_k_dense_replace=1,
                        max_position_embeddings=64,
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.8,
                                             mscale_all_dim=1.0, original_max_position_embeddings=16)),
    "deepseek_v32": dict(vocab_size=99, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                         kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                         num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1,
                         max_position_embeddings=64, index_topk=4, index_head_dim=16, index_n_heads=2),
    "glm_moe_dsa": dict(vocab_size=99, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24,
                        kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=64,
                        index_topk=5, index_head_dim=16, index_n_heads=2, indexer_types=["full", "shared"],
                        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=2.0, mscale=1.0,
                                             mscale_all_dim=1.0, original_max_position_embeddings=32)),
    # DeepSeek-V4: one layer of each attention kind (sliding only, CSA every 2 tokens with an indexer keeping 3
    # entries, HCA every 4), a window of 4 keys (shorter than the test rows), hash routing then top-k, 3 residual
    # streams, YaRN on the compress rope, a swiglu_limit low enough to clamp; built from config (fast-path and
    # parallel tests) an init std of 0.2 keeps the hyper-connection gradients well above fp32 rounding noise
    "deepseek_v4": dict(vocab_size=99, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=3,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=16, partial_rotary_factor=0.5,
                        q_lora_rank=24, o_groups=2, o_lora_rank=8, n_routed_experts=8, num_experts_per_tok=2,
                        layer_types=["sliding_attention", "compressed_sparse_attention",
                                     "heavily_compressed_attention"],
                        mlp_layer_types=["hash_moe", "moe", "moe"],
                        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
                        index_n_heads=2, index_head_dim=8, index_topk=3, sliding_window=4, hc_mult=3,
                        hc_sinkhorn_iters=3, swiglu_limit=1.0, max_position_embeddings=64, initializer_range=0.2,
                        rope_parameters=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)),
    # expand 2 -> 64 channels, 8 states, rank-2 dt, kernel 4; untied and biased variants are covered by tests.
    "mamba": dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, state_size=8, conv_kernel=4),
    # ALBERT: two groups of two inner layers over three layer steps, so sharing and the schedule both show
    "albert": dict(vocab_size=99, embedding_size=16, hidden_size=32, num_hidden_layers=3, num_hidden_groups=2,
                   inner_group_num=2, num_attention_heads=4, intermediate_size=37, max_position_embeddings=64,
                   type_vocab_size=2),
    # DeBERTa-v3 style: log buckets (8) under 64 relative positions, shared keys, both relative terms,
    # LayerNorm'd relative table, no absolute positions; token types on so they are exercised.
    "deberta-v2": dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                       max_position_embeddings=64, type_vocab_size=2, relative_attention=True, position_buckets=8,
                       max_relative_positions=64, share_att_key=True, pos_att_type=["p2c", "c2p"],
                       norm_rel_ebd="layer_norm", position_biased_input=False),
    # ModernBERT: global, local, global; a local window of |i - j| <= 4, shorter than the test rows
    "modernbert": dict(vocab_size=99, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=37,
                       max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=8, pad_token_id=0,
                       bos_token_id=2, cls_token_id=2, eos_token_id=3, sep_token_id=3),
    "qwen3_next": dict(_HYBRID_MOE, mlp_only_layers=[1]),
    "qwen3_5_text": _HYBRID,
    "qwen3_5_moe_text": _HYBRID_MOE,
    "qwen3_5": dict(_VISION, text_config=_HYBRID),
    "qwen3_5_moe": dict(_VISION, text_config=_HYBRID_MOE),
}

# Special tokens per family, in vocabulary order from id 0 (so pad ids match the configs' defaults).
SPECIALS: dict[str, dict[str, str]] = {
    "bert": {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
             "mask_token": "[MASK]"},
    "roberta": {"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>",
                "mask_token": "<mask>"},
    "xlm-roberta": {"bos_token": "<s>", "pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>",
                    "mask_token": "<mask>"},
    "distilbert": {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                   "mask_token": "[MASK]"},
    # decoders: ids 0-3 (llama: bos 1, eos 2 as LlamaConfig defaults)
    **{t: {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
       for t in ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text",
                 "qwen3_5", "qwen3_5_moe")},
    **{t: {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"}
       for t in ("deepseek_v3", "deepseek_v32", "deepseek_v4", "glm_moe_dsa")},  # bos 0, eos 1: configs' defaults
    "mamba": {"pad_token": "<pad>", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},  # pad id 0
    "albert": {"pad_token": "<pad>", "unk_token": "<unk>", "cls_token": "[CLS]", "sep_token": "[SEP]",
               "mask_token": "[MASK]"},  # pad 0, bos [CLS] 2, eos [SEP] 3 as AlbertConfig's defaults
    "deberta-v2": {"pad_token": "[PAD]", "cls_token": "[CLS]", "sep_token": "[SEP]", "unk_token": "[UNK]",
                   "mask_token": "[MASK]"},  # pad 0 as DebertaV2Config's default (no bos/eos ids)
    "modernbert": {"pad_token": "[PAD]", "unk_token": "[UNK]", "cls_token": "[CLS]", "sep_token": "[SEP]",
                   "mask_token": "[MASK]"},  # pad 0, cls/bos 2, sep/eos 3 as its TINY config says
}

_WORDS = ("the a of to and in is was for on that with as by at from it be are this an paris france capital city "
          "london king queen man woman dog cat runs red blue green good bad day night river sea".split())


def tiny_tokenizer(specials: dict[str, str], vocab_size: int) -> HFTokenizer:
    """A WordPiece tokenizer over a small English word list, padded with letters to `vocab_size`."""
    vocab = list(specials.values())
    for w in _WORDS + list("abcdefghijklmnopqrstuvwxyz.,") + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]:
        if len(vocab) >= vocab_size:
            break
        if w not in vocab:
            vocab.append(w)
    ids = {t: i for i, t in enumerate(vocab)}
    tok = HFTokenizer(WordPiece(ids, unk_token=specials["unk_token"]))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls = specials.get("cls_token") or specials.get("bos_token")
    sep = specials.get("sep_token") or specials.get("eos_token")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1", special_tokens=[(cls, ids[cls]), (sep, ids[sep])])
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(list(specials.values()))
    return tok


def tiny_unigram_tokenizer(specials: dict[str, str], vocab_size: int) -> HFTokenizer:
    """A SentencePiece-style Unigram tokenizer (Metaspace, `<s> $A </s>`) trained on the word list."""
    from tokenizers import SentencePieceUnigramTokenizer

    sp = SentencePieceUnigramTokenizer()
    text = [" ".join(_WORDS[i:] + _WORDS[:i]) for i in range(len(_WORDS))]
    sp.train_from_iterator(text, vocab_size=vocab_size, special_tokens=list(specials.values()),
                           unk_token=specials["unk_token"], show_progress=False)
    tok = sp._tokenizer
    bos, eos = specials["bos_token"], specials["eos_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, tok.token_to_id(bos)), (eos, tok.token_to_id(eos))])
    return tok


# Families whose real checkpoints ship a SentencePiece (Unigram) tokenizer.json.
UNIGRAM = {"xlm-roberta"}


def make_tiny(model_type: str, task: str, out_dir: str | os.PathLike, seed: int = 0, tokenizer: bool = True,
              **overrides: Any) -> Path:
    """Build a random `model_type` x `task` model with transformers and save it (plus a tokenizer)."""
    import json

    import transformers

    transformers.utils.logging.disable_progress_bar()
    family = family_for(model_type)
    arch = family.tasks[task].architecture
    kwargs = {**TINY[model_type], **overrides}
    if get_task(task).label_kind is not None:
        kwargs.setdefault("num_labels", 3)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    out = Path(out_dir)
    model.save_pretrained(out)
    if tokenizer:
        specials = SPECIALS[model_type]
        build = tiny_unigram_tokenizer if model_type in UNIGRAM else tiny_tokenizer
        build(specials, config.get_text_config().vocab_size).save(str(out / "tokenizer.json"))  # image-text: nested
        (out / "tokenizer_config.json").write_text(json.dumps(
            {**specials, "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 64}, indent=2))
        (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    return out
