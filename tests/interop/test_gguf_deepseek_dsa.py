"""DeepSeek-V3.2 as llama.cpp's `deepseek32` (MLA + the DSA lightning indexer in every layer) and DeepSeek-V4 as
`deepseek4` (hyper-connections, sliding + CSA / HCA compressed attention with its indexer, hash routing): the files
read back with the gguf package, llama.cpp's f32 logits (V3.2 under YaRN, V4 past HCA's 128-token block), controls
that fail, and refusals by name. The family x type cells are in test_gguf_llama_cpp.py's grid."""

from __future__ import annotations

import dataclasses

import gguf
import pytest
import torch

import kiln.interop.gguf_arch as arch
from kiln.errors import KilnError
from kiln.interop.gguf_deepseek import mla_tensors
from kiln.interop.gguf_export import write_gguf
from kiln.interop.gguf_layout import permute_heads
from kiln.models.auto import load_pretrained
from tests.interop.gguf_cases import DEEPSEEK_YARN, tiny_dir


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf-dsa")


def _llama_checks(model, path, long: bool = False):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the GGUF peer): `make gguf-peer`")
    from kiln.interop.gguf_verify import PROMPTS, verify_gguf

    prompts = [" ".join(PROMPTS)] if long else PROMPTS[:2]  # long: 158 tokens, past one 128-token HCA block
    checks = verify_gguf(path, model, prompts=prompts, n_greedy=16, n_kl_positions=128)
    return {c.name: c for c in checks}, "\n".join(c.line() for c in checks)


def test_v32_file_names_deepseek32(root):
    """The architecture the bundled llama.cpp loads (the installed gguf package predates it), the indexer keys
    without glm-dsa's layer types, kv_b split (no attn_kv_b), the four indexer tensors in every layer."""
    model = load_pretrained(tiny_dir(root, "deepseek_v32"))
    r = gguf.GGUFReader(str(write_gguf(model, root / "v32.gguf", "f32")))
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("GGUF.")}
    assert f["general.architecture"] == "deepseek32"
    assert (f["deepseek32.attention.indexer.head_count"], f["deepseek32.attention.indexer.key_length"],
            f["deepseek32.attention.indexer.top_k"]) == (16, 64, 5)
    assert "deepseek32.attention.indexer.types" not in f and f["deepseek32.leading_dense_block_count"] == 1
    assert f["deepseek32.expert_gating_func"] == gguf.ExpertGatingFuncType.SIGMOID
    names = {t.name for t in r.tensors}
    assert not any("attn_kv_b" in n for n in names)
    for i in range(2):
        assert {f"blk.{i}.indexer.{t}" for t in ("k_norm.weight", "k_norm.bias", "proj.weight", "attn_k.weight",
                                                  "attn_q_b.weight")} <= names


def test_v32_yarn_f32_by_llama_cpp(root):
    """The release's YaRN (mscale == mscale_all_dim): deepseek32's loader reads yarn_log_multiplier as deepseek2's."""
    model = load_pretrained(tiny_dir(root, "deepseek_v32", rope_parameters=DEEPSEEK_YARN))
    checks, text = _llama_checks(model, write_gguf(model, root / "v32-yarn" / "m.gguf", "f32"))
    assert checks["f32 logits"].ok, text


def _adjacent_indexer_rope(hf, c):
    """The control: the indexer's rope rows (the first qk_rope_head_dim of each head, of wq_b and of wk) put in
    adjacent-pair order, as for glm-dsa's indexer; llama.cpp's deepseek32 turns halves, so its top-k choice moves."""
    out = mla_tensors(hf, c)
    rot, d = c.qk_rope_head_dim, c.index_head_dim
    for k in [k for k in out if k.endswith(("indexer.wq_b.weight", "indexer.wk.weight"))]:
        w = out[k].reshape(-1, d, out[k].shape[-1]).clone()
        w[:, :rot] = torch.stack([permute_heads(h, 1) for h in w[:, :rot]])
        out[k] = w.reshape(out[k].shape)
    return out


def test_v32_indexer_rope_order_control_fails(root, monkeypatch):
    model = load_pretrained(tiny_dir(root, "deepseek_v32"))
    fam = arch.GGUF_FAMILIES["deepseek_v32"]
    monkeypatch.setitem(arch.GGUF_FAMILIES, "deepseek_v32", dataclasses.replace(fam, rewrite=_adjacent_indexer_rope))
    checks, text = _llama_checks(model, write_gguf(model, root / "v32-adjacent" / "m.gguf", "f32"))
    assert not checks["f32 logits"].ok, text


def test_v32_refusals(root, tmp_path):
    """Refused by name: an indexer head size llama.cpp's 64-wide Hadamard rotation does not fit, a dense layer after
    a MoE one (llama.cpp takes the dense layers as a leading run)."""
    with pytest.raises(KilnError, match="64-wide"):
        write_gguf(load_pretrained(tiny_dir(root, "deepseek_v32", index_head_dim=32)), tmp_path / "a.gguf")
    late_dense = tiny_dir(root, "deepseek_v32", first_k_dense_replace=0, mlp_layer_types=["sparse", "dense"])
    with pytest.raises(KilnError, match=r"layers \[1\] are dense after MoE layer 0"):
        write_gguf(load_pretrained(late_dense), tmp_path / "b.gguf")


# ---- DeepSeek-V4 (deepseek4) ----------------------------------------------------------------------------------

def test_v4_file_names_deepseek4(root):
    """deepseek4's keys (named here: the gguf package has none), the hash table as int32, the grouped output
    projection one matrix per group, the routed experts stacked; no MTP tensors."""
    model = load_pretrained(tiny_dir(root, "deepseek_v4"))
    r = gguf.GGUFReader(str(write_gguf(model, root / "v4.gguf", "f16")))
    f = {k: v.contents() for k, v in r.fields.items() if not k.startswith("GGUF.")}
    assert f["general.architecture"] == "deepseek4"
    assert f["deepseek4.attention.compress_ratios"] == [0, 4, 128] and f["deepseek4.hash_layer_count"] == 1
    assert (f["deepseek4.hyper_connection.count"], f["deepseek4.attention.output_group_count"]) == (4, 2)
    t = {x.name: x for x in r.tensors}
    assert t["blk.0.ffn_gate_tid2eid.weight"].tensor_type == gguf.GGMLQuantizationType.I32
    assert "blk.0.exp_probs_b.bias" not in t and "blk.1.exp_probs_b.bias" in t
    assert t["blk.1.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32  # the router stays f32
    assert list(t["blk.0.attn_output_a.weight"].shape) == [256, 16, 2]  # ggml order: (in, o_lora_rank, groups)
    assert list(t["blk.0.ffn_gate_exps.weight"].shape) == [64, model.config.moe_intermediate_size, 8]
    assert "blk.1.indexer.attn_q_b.weight" in t and "blk.2.indexer.attn_q_b.weight" not in t  # CSA only
    assert not any("nextn" in n or "mtp" in n for n in t)


def test_v4_long_prompt_f32_and_hca_control(root, monkeypatch):
    """158 tokens: CSA's indexer picks 3 of up to 39 compressed entries, HCA compresses its first 128-token block;
    llama.cpp's logits are kiln's. Control: the HCA compressor's position bias rows reversed: the 2-prompt check
    (under 128 tokens) cannot see it, the long prompt fails."""
    model = load_pretrained(tiny_dir(root, "deepseek_v4"))
    checks, text = _llama_checks(model, write_gguf(model, root / "v4-long" / "m.gguf", "f32"), long=True)
    assert checks["f32 logits"].ok, text
    fam = arch.GGUF_FAMILIES["deepseek_v4"]

    def reversed_hca_ape(hf, c):
        for name, kind, t in fam.named(hf, c):
            yield name, kind, (t.flip(0) if name == "blk.2.attn_compressor_ape.weight" else t)

    monkeypatch.setitem(arch.GGUF_FAMILIES, "deepseek_v4", dataclasses.replace(fam, named=reversed_hca_ape))
    path = write_gguf(model, root / "v4-hca-control" / "m.gguf", "f32")
    short, text = _llama_checks(model, path)
    assert short["f32 logits"].ok, text
    checks, text = _llama_checks(model, path, long=True)
    assert not checks["f32 logits"].ok, text


def test_v4_refusals(root, tmp_path):
    """Refused by name: what llama.cpp's deepseek4 fixes (4 streams, hash-routed layers first) and a LoRA adapter
    file (no name table to map kiln's adapted matrices through)."""
    with pytest.raises(KilnError, match="4 hyper-connection streams"):
        write_gguf(load_pretrained(tiny_dir(root, "deepseek_v4", hc_mult=2)), tmp_path / "a.gguf")
    late_hash = tiny_dir(root, "deepseek_v4", mlp_layer_types=["moe", "hash_moe", "moe"])
    with pytest.raises(KilnError, match="leading run"):
        write_gguf(load_pretrained(late_hash), tmp_path / "b.gguf")
    with pytest.raises(KilnError, match="64-wide"):
        write_gguf(load_pretrained(tiny_dir(root, "deepseek_v4", head_dim=32)), tmp_path / "c.gguf")
