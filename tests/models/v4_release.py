"""A tiny DeepSeek-V4-Flash look-alike in the release's own format, for the release tests (not a test module).

`make_release` takes a tiny random checkpoint saved by transformers and rewrites it the way the
release ships: DeepSeek's names with no `model.` prefix (`embed`, `head`, `hc_head_fn`, `layers.N.attn.wq_a`,
`layers.N.attn.kv_norm`), config.json with the release's keys (the legacy forms transformers folds in: `compress_ratios` with one
entry more for the MTP layer, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`, a top-level
`expert_dtype`), an MTP layer under `mtp.0.*`, the dense projections float8_e4m3fn with UE8M0 block
scales under `<module>.scale`, and the routed experts FP4 (e2m1, two a byte in int8, low nibble first,
one UE8M0 scale per 32 inputs). The quantization is written here from the formula (FP8 in plain loops over
blocks, FP4 as a nearest-code search over the e2m1 table), so kiln's own code is checked against it.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# V4-Flash's dense FP8 projections; compressors, the indexer's weights_proj, router, embed and head stay wide
FP8_MODULES = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
               "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3", "e_proj", "h_proj")
FP32 = ("hc_", "attn_sink", ".ape", "gate.bias")  # held in float32 in the release, as transformers keeps them


def fp8_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block by block: (float8 weight, float8_e8m0fnu scale), the scale a power of two at or above amax / 448."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    inv = torch.empty(math.ceil(rows / block), math.ceil(cols / block))
    for i in range(inv.shape[0]):
        for j in range(inv.shape[1]):
            tile = w[i * block:(i + 1) * block, j * block:(j + 1) * block].float()
            s = 2.0 ** math.ceil(math.log2(float(tile.abs().max()) / 448.0))
            inv[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (tile / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, inv.to(torch.float8_e8m0fnu)


def fp4_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per 32 inputs: scale 2**ceil(log2(amax / 6)), each value to the nearest e2m1 (a tie to the even code),
    -0 written as +0, packed low nibble first into int8. In float64, where every distance here is exact."""
    rows, cols = w.shape
    x = w.double().reshape(rows, cols // 32, 32)
    scale = torch.exp2(torch.ceil(torch.log2(x.abs().amax(-1) / 6.0)))  # (rows, cols / 32)
    x = x / scale[..., None]
    dist = (x.abs()[..., None] - torch.tensor(E2M1, dtype=torch.float64)).abs()  # (rows, blocks, 32, 8)
    nearest = dist == dist.min(-1, keepdim=True).values
    even = nearest & (torch.arange(8) % 2 == 0)
    mag = torch.where(even.any(-1), even.int().argmax(-1), nearest.int().argmax(-1))
    codes = (mag | torch.where((x < 0) & (mag > 0), 8, 0)).to(torch.uint8).reshape(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.float().to(torch.float8_e8m0fnu)


def release_name(k: str) -> str:
    """A name transformers' save writes, as the release's weight index has it (its MLA key/value norm is
    `attn.kv_norm`, where transformers' reverse renaming writes `attn.norm`)."""
    k = re.sub(r"(^|\.)attn\.norm\.", r"\1attn.kv_norm.", k.removeprefix("model."))
    return k.replace("embed_tokens.", "embed.").replace("hc_head.hc_", "hc_head_")


def release_config(hf: dict, n_layers: int, block: int) -> dict:
    """The release's config.json keys, tiny values from the transformers config `hf`."""
    ratio = {"sliding_attention": 0, "compressed_sparse_attention": hf["compress_rates"]["compressed_sparse_attention"],
             "heavily_compressed_attention": hf["compress_rates"]["heavily_compressed_attention"]}
    compress = hf["rope_parameters"]["compress"]
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1,
        "compress_ratios": [ratio[t] for t in hf["layer_types"]] + [0],  # the last: the MTP layer
        "compress_rope_theta": hf["compress_rope_theta"], "expert_dtype": "fp4",
        "hc_eps": hf["hc_eps"], "hc_mult": hf["hc_mult"], "hc_sinkhorn_iters": hf["hc_sinkhorn_iters"],
        "head_dim": hf["head_dim"], "hidden_act": "silu", "hidden_size": hf["hidden_size"],
        "index_head_dim": hf["index_head_dim"], "index_n_heads": hf["index_n_heads"], "index_topk": hf["index_topk"],
        "initializer_range": hf["initializer_range"], "max_position_embeddings": hf["max_position_embeddings"],
        "moe_intermediate_size": hf["moe_intermediate_size"], "n_routed_experts": hf["n_routed_experts"],
        "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": hf["num_attention_heads"],
        "num_experts_per_tok": hf["num_experts_per_tok"], "num_hash_layers": 1, "num_hidden_layers": n_layers,
        "num_key_value_heads": 1, "num_nextn_predict_layers": 1, "o_groups": hf["o_groups"],
        "o_lora_rank": hf["o_lora_rank"], "q_lora_rank": hf["q_lora_rank"],
        "qk_rope_head_dim": int(hf["head_dim"] * hf["partial_rotary_factor"]),
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "scale_fmt": "ue8m0", "weight_block_size": [block, block]},
        "rms_norm_eps": hf["rms_norm_eps"],
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": compress["factor"],
                         "original_max_position_embeddings": compress["original_max_position_embeddings"],
                         "type": "yarn"},
        "rope_theta": hf["rope_theta"], "routed_scaling_factor": hf["routed_scaling_factor"],
        "scoring_func": "sqrtsoftplus", "sliding_window": hf["sliding_window"], "swiglu_limit": hf["swiglu_limit"],
        "tie_word_embeddings": False, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1", "use_cache": True, "vocab_size": hf["vocab_size"],
    }


def mtp_layer(state: dict[str, torch.Tensor], g: torch.Generator) -> dict[str, torch.Tensor]:
    """An MTP block in the release's names: a sliding-attention layer (layer 0's attention), a top-k MoE
    (layer 1's), its own norms and hyper connections, e_proj / h_proj and a hyper head, all re-drawn."""
    out = {}
    for k, v in state.items():
        src = k.removeprefix("model.")
        if src.startswith("layers.0.") and ".ffn." not in src and "tid2eid" not in src:
            out["mtp.0." + src[len("layers.0."):]] = v
        elif src.startswith("layers.1.ffn."):
            out["mtp.0." + src[len("layers.1."):]] = v
    C = state["model.embed_tokens.weight"].shape[1]
    hc = state["model.hc_head.hc_fn"]
    out.update({"mtp.0.e_proj.weight": torch.empty(C, C), "mtp.0.h_proj.weight": torch.empty(C, C),
                "mtp.0.enorm.weight": torch.empty(C), "mtp.0.hnorm.weight": torch.empty(C),
                "mtp.0.norm.weight": torch.empty(C), "mtp.0.hc_head_fn": torch.empty_like(hc),
                "mtp.0.hc_head_base": torch.empty(hc.shape[0]), "mtp.0.hc_head_scale": torch.empty(1)})
    for k, v in out.items():
        if v.is_floating_point():
            out[k] = (1.0 + 0.1 * torch.randn(v.shape, generator=g) if v.dim() == 1 and "norm" in k
                      else 0.2 * torch.randn(v.shape, generator=g))
    return out


def make_release(src: Path, out: Path, block: int = 32) -> Path:
    """The release-format copy of the tiny transformers checkpoint `src` (3 layers: sliding, CSA, HCA)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            shutil.copy(f, out / f.name)
    hf_cfg = json.loads((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    named = {release_name(k): v for k, v in state.items()}
    named.update({release_name(k): v for k, v in mtp_layer(state, g).items()})
    result = {}
    for k, v in named.items():
        module = k.rsplit(".", 1)[0]
        if k.endswith(".weight") and ".experts." in k and ".shared_experts." not in k:
            result[k], result[module + ".scale"] = fp4_rows(v.bfloat16())
        elif k.endswith(".weight") and any(module.endswith(m) for m in FP8_MODULES):
            result[k], result[module + ".scale"] = fp8_blocks(v.bfloat16(), block)
        elif v.is_floating_point():
            result[k] = v.float() if any(p in k for p in FP32) else v.bfloat16()
        else:
            result[k] = v
    save_file(result, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(release_config(hf_cfg, hf_cfg["num_hidden_layers"], block), indent=2))
    return out


def tiny_release_source(tiny_factory, **overrides) -> Path:
    """The transformers tiny checkpoint the release copy is made from: widths that are multiples of 32 (FP4
    scales cover 32 inputs), hash routing on layer 0 only (the release's `num_hash_layers` here), the release's
    compression rates 4 and 128 (its `compress_ratios` can say no others), so rows past 128 tokens reach HCA."""
    return tiny_factory("deepseek_v4", "causal-lm", hidden_size=64, moe_intermediate_size=32,
                        mlp_layer_types=["hash_moe", "moe", "moe"], max_position_embeddings=256,
                        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
                        **overrides)


def without_mtp(release: Path) -> Path:
    """`release` rewritten in place without its MTP layer (tensors and config entries): a release whose every
    tensor has a place in the model."""
    state = load_file(str(release / "model.safetensors"))
    save_file({k: v for k, v in state.items() if not k.startswith("mtp.")}, str(release / "model.safetensors"),
              metadata={"format": "pt"})
    cfg = json.loads((release / "config.json").read_text())
    cfg.update(num_nextn_predict_layers=0, compress_ratios=cfg["compress_ratios"][:cfg["num_hidden_layers"]])
    (release / "config.json").write_text(json.dumps(cfg, indent=2))
    return release


def fp8_release_without_mtp(tiny_factory, root: Path) -> Path:
    """The tiny release (`make_release`) without its MTP layer, in ROOT/release: kept FP8, its grouped `wo_a` is an
    FP8 weight no FP8 module holds."""
    return without_mtp(make_release(tiny_release_source(tiny_factory), root / "release"))
