"""Tiny checkpoints for the GGUF tests: each family's tiny config (built and saved by transformers) at sizes
whose matrices split into llama.cpp's quant blocks, with a real byte-level BPE tokenizer trained here (kiln's
`train_bpe`, ChatML template, <|im_end|> as EOS) so llama.cpp has a vocabulary to load."""

from __future__ import annotations

import json
import shutil
import zlib
from importlib import resources
from pathlib import Path

from kiln.data.bpe import train_bpe
from kiln.interop.tiny import make_tiny

TEXT = ("Paris is the capital of France.\nhello world, how are you?\nthe cat sat on the mat\nOnce upon a time\n"
        "What is the weather in Paris? It is 18 degrees. Thanks!\nYou are a helpful assistant.\n"
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n')
VOCAB = 320
DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# family -> overrides of its registered tiny config (sizes first; then what llama.cpp's graph needs)
FAMILIES = {
    "llama": {},                                       # keeps the tiny's llama3 rope scaling and tied embeddings
    "qwen2": {"rope_parameters": DEFAULT_ROPE},        # plain rope here; YaRN is checked in test_yarn_rope_metadata
    "qwen3": {},
    "qwen3_moe": {"mlp_only_layers": []},              # llama.cpp's qwen3moe has a MoE block in every layer
    "mamba": {},
    # MLA sizes whose matrices split into 32-wide q8_0 blocks; 8 experts in 4 groups (2 kept), 2 shared, layer 0
    # dense; DeepSeek-V3's own interleaved rope rows; the tiny's yarn has mscale != mscale_all_dim (refused)
    "deepseek_v3": {"num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32,
                    "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 8,
                    "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2, "n_shared_experts": 2,
                    "first_k_dense_replace": 1, "rope_parameters": DEFAULT_ROPE},
    # hybrids: 2 layers (DeltaNet, attention); DeltaNet heads 2 key x 4 value of 32 dims; every layer MoE in the
    # MoE kinds; the tokenizer's specials
    "qwen3_next": {"layer_types": ["linear_attention", "full_attention"], "mlp_only_layers": []},
    "qwen3_5_text": {"layer_types": ["linear_attention", "full_attention"]},
    "qwen3_5_moe_text": {"layer_types": ["linear_attention", "full_attention"]},
    # GLM-5: the deepseek sizes with a query latent (llama.cpp's glm-dsa needs one), the lightning indexer choosing
    # 5 keys (so the sparse choice is exercised past 5 tokens) with 16 heads (with 2, ReLU zeros tie several keys
    # at the 5th score and the two top-k implementations break ties differently), layer 1 sharing layer 0's
    # choice; plain rope (llama.cpp's glm-dsa YaRN is refused)
    "glm_moe_dsa": {"rope_parameters": DEFAULT_ROPE, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 32,
                    "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 8,
                    "num_experts_per_tok": 3, "n_shared_experts": 1, "first_k_dense_replace": 1,
                    "index_n_heads": 16, "index_head_dim": 64, "index_topk": 5},
    # DeepSeek-V3.2: the GLM-5 sizes with DeepSeek-V3's 4 expert groups (2 kept), an indexer in every layer whose
    # rope turns halves
    "deepseek_v32": {"rope_parameters": DEFAULT_ROPE, "num_attention_heads": 4, "num_key_value_heads": 4,
                     "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
                     "v_head_dim": 32, "n_routed_experts": 8, "num_experts_per_tok": 3, "n_group": 4, "topk_group": 2,
                     "n_shared_experts": 1, "first_k_dense_replace": 1, "index_n_heads": 16, "index_head_dim": 64,
                     "index_topk": 5},
    # DeepSeek-V4: what llama.cpp's deepseek4 fixes (4 streams, ratios 4 / 128, heads in 64-wide blocks), plain
    # rope; 3 layers (sliding, CSA, HCA; hash-routed first); 16 indexer heads keeping 3 compressed entries (with 4,
    # ReLU zeros tie entries at the 3rd score); 256 positions so a long prompt passes HCA's 128-token block
    "deepseek_v4": {"hc_mult": 4, "head_dim": 128, "index_head_dim": 128, "index_n_heads": 16, "index_topk": 3,
                    "q_lora_rank": 32, "o_lora_rank": 16, "max_position_embeddings": 256,
                    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                    "rope_parameters": {"main": {**DEFAULT_ROPE, "partial_rotary_factor": 0.5},
                                        "compress": {"rope_type": "default", "rope_theta": 160000.0,
                                                     "partial_rotary_factor": 0.5}}},
}
HYBRIDS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
# DeepSeek-V3's release rope: yarn with mscale == mscale_all_dim (llama.cpp's deepseek2 assumes it)
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                 "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}


def tokenizer_dir(root: Path) -> Path:
    out = root / "tok"
    if not (out / "tokenizer.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        (root / "text.txt").write_text(TEXT * 3)
        train_bpe([root / "text.txt"], out, vocab_size=300, min_frequency=1)
    return out


def tiny_dir(root: Path, family: str, hidden: int = 64, **overrides) -> Path:
    """A saved tiny `family` causal LM with the BPE tokenizer; hidden 64 (q8_0 blocks of 32 fit every row),
    256 for the K-quants (blocks of 256)."""
    tok = tokenizer_dir(root)
    sizes = dict(vocab_size=VOCAB, hidden_size=hidden, eos_token_id=2, pad_token_id=0, bos_token_id=None)
    if family != "mamba":  # attention decoders
        sizes.update(intermediate_size=2 * hidden, head_dim=hidden // 4, max_position_embeddings=128)
    if family in ("qwen3_moe", "deepseek_v3", "deepseek_v32", "glm_moe_dsa"):
        sizes["moe_intermediate_size"] = hidden if family == "qwen3_moe" else hidden // 2
    if family in HYBRIDS:
        sizes.update(num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
                     linear_key_head_dim=hidden // 2, linear_value_head_dim=hidden // 2)
    if family in ("qwen3_next", "qwen3_5_moe_text"):
        sizes.update(moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden, num_experts=4,
                     num_experts_per_tok=2)
    name = f"{family}-{hidden}" + (f"-{zlib.crc32(repr(sorted(overrides.items())).encode())}" if overrides else "")
    out = make_tiny(family, "causal-lm", root / name, tokenizer=False,
                    **{**sizes, **FAMILIES[family], **overrides})
    for f in tok.iterdir():
        shutil.copy(f, out / f.name)
    if family == "qwen3":  # Qwen3's own template (tool calls, reasoning) rather than the trained tokenizer's ChatML
        config = json.loads((out / "tokenizer_config.json").read_text())
        config["chat_template"] = (resources.files("trl") / "chat_templates" / "qwen3.jinja").read_text()
        (out / "tokenizer_config.json").write_text(json.dumps(config))
    _sharpen(out / "model.safetensors")
    return out


def _sharpen(path: Path, factor: float = 10.0) -> None:
    """The final norm's weight times `factor`: random N(0, 0.2) weights give logits of std ~0.3, so flat that
    greedy decoding meets near-ties any rounding flips; x10 gives the std of a trained model's logits (~3)."""
    from safetensors.torch import load_file, save_file

    weights = load_file(str(path))
    final = [k for k in weights if k in ("model.norm.weight", "backbone.norm_f.weight")]
    assert len(final) == 1, sorted(weights)[-5:]
    weights[final[0]] = weights[final[0]] * factor
    save_file(weights, str(path), metadata={"format": "pt"})


def sentencepiece_dir(root: Path, family: str = "llama", vocab: int = 512) -> Path:
    """A tiny `family` model with a Llama-2-style tokenizer: BPE with byte fallback (<0x00>..<0xFF> at ids 3..258),
    spaces as "\u2581" with one prepended by the normaliser, `<s> $A` added."""
    from tokenizers import Tokenizer, models, normalizers, processors, trainers

    out = root / f"spm-{family}"
    if (out / "tokenizer.json").is_file() and (out / "model.safetensors").is_file():
        return out
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trained.train_from_iterator([TEXT * 3], trainers.BpeTrainer(vocab_size=vocab - 60, special_tokens=specials,
                                                                show_progress=False))
    spec = json.loads(trained.to_str())
    spec["model"].update(byte_fallback=True, fuse_unk=True)
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] in specials[:3]]  # bytes: plain vocab
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    src = tiny_dir(root, family, vocab_size=vocab, eos_token_id=2, bos_token_id=1)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(f, out / f.name)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                           "unk_token": "<unk>", "add_bos_token": True}))
    return out
