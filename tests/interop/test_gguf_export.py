"""GGUF export read back with the gguf package's own reader (no llama.cpp needed): metadata, tokenizer,
tensor names and layouts, the types, the Modelfile, and refusals by name."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.errors import KilnError
from kiln.interop.gguf_export import write_gguf
from kiln.models.auto import load_pretrained
from tests.interop.gguf_cases import tiny_dir


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("gguf")


def _fields(reader: gguf.GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def test_llama_metadata_tokenizer_and_tensors(root):
    src = tiny_dir(root, "llama")
    model = load_pretrained(src)
    path = write_gguf(model, root / "llama.gguf", "f32")
    r = gguf.GGUFReader(str(path))
    f = _fields(r)
    c = model.config
    assert f["general.architecture"] == "llama" and f["general.file_type"] == gguf.LlamaFileType.ALL_F32
    assert (f["llama.block_count"], f["llama.embedding_length"], f["llama.feed_forward_length"]) == (2, 64, 128)
    assert (f["llama.attention.head_count"], f["llama.attention.head_count_kv"], f["llama.rope.dimension_count"]) \
        == (4, 2, 16)
    assert f["llama.context_length"] == 128 and f["llama.rope.freq_base"] == 10000.0
    assert f["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(c.rms_norm_eps)
    tok = json.loads((src / "tokenizer.json").read_text())
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"
    assert len(f["tokenizer.ggml.tokens"]) == c.vocab_size  # padded past the tokenizer's 300 to vocab_size
    assert f["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert f["tokenizer.ggml.token_type"][:3] == [gguf.TokenType.CONTROL] * 3
    assert f["tokenizer.ggml.token_type"][-1] == gguf.TokenType.UNUSED
    assert f["tokenizer.ggml.merges"][:5] == [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"][:5]]
    assert (f["tokenizer.ggml.eos_token_id"], f["tokenizer.ggml.padding_token_id"], f["tokenizer.ggml.eot_token_id"]) \
        == (2, 0, 2)
    assert f["tokenizer.ggml.add_bos_token"] is False and "tokenizer.ggml.bos_token_id" not in f
    assert f["tokenizer.chat_template"] == model.tokenizer.chat_template
    hf = model.hf_state_dict()
    tensors = {t.name: t for t in r.tensors}
    assert "output.weight" not in tensors  # tied: llama.cpp reads token_embd
    assert "rope_freqs.weight" in tensors  # llama3 rope scaling as llama.cpp's per-frequency divisors
    # llama.cpp's q rows: rotary pairs adjacent; undoing the permutation gives HF's rows back
    q = np.array(tensors["blk.0.attn_q.weight"].data).reshape(64, 64)
    back = torch.from_numpy(q).reshape(4, 8, 2, 64).swapaxes(1, 2).reshape(64, 64)
    assert torch.equal(back, hf["model.layers.0.self_attn.q_proj.weight"])
    assert not torch.equal(torch.from_numpy(q), hf["model.layers.0.self_attn.q_proj.weight"])
    k = np.array(tensors["blk.1.attn_k.weight"].data).reshape(32, 64)
    back = torch.from_numpy(k).reshape(2, 8, 2, 64).swapaxes(1, 2).reshape(32, 64)
    assert torch.equal(back, hf["model.layers.1.self_attn.k_proj.weight"])
    v = np.array(tensors["blk.0.attn_v.weight"].data).reshape(32, 64)
    assert torch.equal(torch.from_numpy(v), hf["model.layers.0.self_attn.v_proj.weight"])  # v is not turned
    assert len(tensors) == len(hf) + 1


@pytest.mark.parametrize("kind,qtype,err", [("f16", gguf.GGMLQuantizationType.F16, 2 ** -11),
                                            ("bf16", gguf.GGMLQuantizationType.BF16, 2 ** -8),
                                            ("q8_0", gguf.GGMLQuantizationType.Q8_0, 1 / 127)])
def test_types_store_matrices_within_their_rounding(root, kind, qtype, err):
    """Matrices in the type, 1-D tensors f32; each stored value within the type's rounding of the source
    (half an ulp relative for f16/bf16; for q8_0 half a step of the block's max / 127 and the f16 step)."""
    model = load_pretrained(tiny_dir(root, "qwen3"))
    r = gguf.GGUFReader(str(write_gguf(model, root / f"qwen3-{kind}.gguf", kind)))
    hf = model.hf_state_dict()
    byname = {"blk.1.ffn_down.weight": "model.layers.1.mlp.down_proj.weight",
              "blk.0.attn_q_norm.weight": "model.layers.0.self_attn.q_norm.weight",
              "output.weight": "lm_head.weight"}
    for t in r.tensors:
        if t.name not in byname:
            continue
        ref = hf[byname[t.name]].numpy()
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(ref.shape)
        if ref.ndim == 1:
            assert t.tensor_type == gguf.GGMLQuantizationType.F32 and np.array_equal(got, ref)
            continue
        assert t.tensor_type == qtype
        if kind == "q8_0":
            # half a step (max / 127 / 2), plus the step itself stored as f16 (off by 2^-11 relative, times
            # up to 127 steps)
            scale = np.abs(ref.reshape(-1, 32)).max(-1, keepdims=True)
            bound = scale * (err / 2 + 2.0 ** -11) * 1.001
            assert (np.abs(got.reshape(-1, 32) - ref.reshape(-1, 32)) <= bound).all()
        else:
            tiny = 2.0 ** -25 if kind == "f16" else 0.0  # half f16's smallest subnormal step: values near 0
            assert (np.abs(got - ref) <= np.abs(ref) * err + tiny).all()
            assert not np.array_equal(got, ref)  # really rounded


def test_moe_experts_stacked(root):
    model = load_pretrained(tiny_dir(root, "qwen3_moe"))
    r = gguf.GGUFReader(str(write_gguf(model, root / "moe.gguf", "f32")))
    f = _fields(r)
    assert (f["qwen3moe.expert_count"], f["qwen3moe.expert_used_count"], f["qwen3moe.expert_feed_forward_length"]) \
        == (4, 2, 64)
    t = {t.name: t for t in r.tensors}
    hf = model.hf_state_dict()
    gate = np.array(t["blk.1.ffn_gate_exps.weight"].data).reshape(4, 64, 64)
    for e in range(4):
        assert np.array_equal(gate[e], hf[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"].numpy())
    assert t["blk.0.ffn_gate_inp.weight"].tensor_type == gguf.GGMLQuantizationType.F32


def test_modelfile_chatml_and_untranslated(root):
    model = load_pretrained(tiny_dir(root, "qwen2"))
    write_gguf(model, root / "mf" / "m.gguf", "q8_0", system="Be brief.")
    text = (root / "mf" / "Modelfile").read_text()
    assert text.startswith("FROM ./m.gguf\n")
    assert "<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n" in text and "# chat template: ChatML" in text
    assert 'PARAMETER stop "<|im_end|>"' in text and 'SYSTEM """Be brief."""' in text
    model.tokenizer.config["chat_template"] = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    write_gguf(model, root / "mf2" / "m.gguf", "f16")
    text = (root / "mf2" / "Modelfile").read_text()
    assert "TEMPLATE not written" in text and "TEMPLATE \"\"\"" not in text
    assert 'PARAMETER stop "<|im_end|>"' in text  # the EOS still stops generation


def test_refusals_name_the_thing(root, tmp_path):
    from kiln.interop.tiny import make_tiny

    roberta = load_pretrained(make_tiny("roberta", "base", tmp_path / "roberta"))
    with pytest.raises(KilnError, match="family 'roberta'"):
        write_gguf(roberta, tmp_path / "b.gguf", "f16")
    moe = load_pretrained(tiny_dir(root, "qwen3_moe", mlp_only_layers=[1]))
    with pytest.raises(KilnError, match=r"layers \[1\] are dense"):
        write_gguf(moe, tmp_path / "m.gguf", "f16")
    llama3 = load_pretrained(tiny_dir(root, "qwen2", rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 2.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}))
    with pytest.raises(KilnError, match="rope_type 'llama3'"):
        write_gguf(llama3, tmp_path / "y.gguf", "f16")
    q = load_pretrained(tiny_dir(root, "qwen3"))
    with pytest.raises(KilnError, match="--gguf-type 'q3'"):
        write_gguf(q, tmp_path / "q.gguf", "q3")
    with pytest.raises(KilnError, match="name it \\*.gguf"):
        write_gguf(q, tmp_path / "q.bin", "f16")
    assert not list(tmp_path.glob("*.gguf*")) and not list(tmp_path.glob(".*tmp"))


def test_cli_export_gguf_and_errors(root, tmp_path):
    src = tiny_dir(root, "qwen3")
    r = CliRunner().invoke(app, ["export", str(src), "--format", "gguf", "--out", str(tmp_path / "a.gguf"),
                                 "--gguf-type", "q8_0"])
    assert r.exit_code == 0, r.output
    assert "q8_0" in r.output and (tmp_path / "a.gguf").is_file() and (tmp_path / "Modelfile").is_file()
    r = CliRunner().invoke(app, ["export", str(src), "--format", "gguf", "--out", str(tmp_path / "a.gguf")])
    assert r.exit_code != 0 and "--overwrite" in r.output
    r = CliRunner().invoke(app, ["export", str(src), "--format", "gguf", "--out", str(tmp_path / "b.gguf"), "--merge"])
    assert r.exit_code != 0 and "no LoRA adapter" in r.output
    r = CliRunner().invoke(app, ["export", str(src), "--format", "gguf", "--out", str(tmp_path / "b.gguf"),
                                 "--dtype", "bf16"])
    assert r.exit_code != 0 and "--gguf-type" in r.output
    r = CliRunner().invoke(app, ["verify-export", str(tmp_path / "a.gguf")])
    assert r.exit_code != 0 and "--source" in r.output


def test_lora_adapter_file_layout(root, tmp_path):
    """The adapter file: adapter metadata, alpha = scaling * r, lora_a (r, in) as stored, lora_b with llama's q
    rows re-ordered as the base q weight is."""
    from kiln.interop.gguf_lora import write_gguf_lora
    from kiln.models.common.lora import LoraConfig, apply_lora

    model = load_pretrained(tiny_dir(root, "llama"))
    apply_lora(model, LoraConfig(r=4, alpha=8, targets=["q_proj", "v_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    r = gguf.GGUFReader(str(write_gguf_lora(model, tmp_path / "a.gguf")))
    f = _fields(r)
    assert (f["general.type"], f["adapter.type"], f["adapter.lora.alpha"]) == ("adapter", "lora", 8.0)
    t = {x.name: np.array(x.data) for x in r.tensors}
    assert len(t) == 8  # 2 layers x (q, v) x (a, b)
    q = model.model.layers[0].self_attn.q_proj
    assert np.array_equal(t["blk.0.attn_q.weight.lora_a"].reshape(4, 64), q.lora_A.weight.detach().numpy())
    b = torch.from_numpy(t["blk.0.attn_q.weight.lora_b"].reshape(64, 4))
    assert torch.equal(b.reshape(4, 8, 2, 4).swapaxes(1, 2).reshape(64, 4), q.lora_B.weight.detach())
    v = model.model.layers[1].self_attn.v_proj
    assert np.array_equal(t["blk.1.attn_v.weight.lora_b"].reshape(32, 4), v.lora_B.weight.detach().numpy())
    with pytest.raises(KilnError, match="no LoRA adapter"):
        write_gguf_lora(load_pretrained(tiny_dir(root, "llama")), tmp_path / "b.gguf")


def test_deepseek_mla_layout(root, tmp_path):
    """deepseek2's file: one latent KV head, the _mla head sizes, q_lora_rank 0 without a query latent, sigmoid
    group-limited routing keys; kv_b_proj split per head into attn_k_b (k half transposed) and attn_v_b; the
    balancing bias as exp_probs_b.bias; experts stacked."""
    model = load_pretrained(tiny_dir(root, "deepseek_v3"))
    c = model.config
    r = gguf.GGUFReader(str(write_gguf(model, tmp_path / "d.gguf", "f32")))
    f = _fields(r)
    assert f["general.architecture"] == "deepseek2"
    assert (f["deepseek2.attention.head_count_kv"], f["deepseek2.attention.key_length"],
            f["deepseek2.attention.value_length"]) == (1, c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank)
    assert (f["deepseek2.attention.key_length_mla"], f["deepseek2.attention.value_length_mla"],
            f["deepseek2.attention.q_lora_rank"]) == (c.qk_nope_head_dim + c.qk_rope_head_dim, c.v_head_dim, 0)
    assert (f["deepseek2.expert_gating_func"], f["deepseek2.expert_group_count"],
            f["deepseek2.expert_group_used_count"], f["deepseek2.leading_dense_block_count"]) == (2, 4, 2, 1)
    t = {x.name: np.array(x.data) for x in r.tensors}
    kv_b = model.hf_state_dict()["model.layers.1.self_attn.kv_b_proj.weight"].reshape(4, 64, 32)
    assert np.array_equal(t["blk.1.attn_k_b.weight"], kv_b[:, :32].transpose(1, 2).numpy())
    assert np.array_equal(t["blk.1.attn_v_b.weight"], kv_b[:, 32:].numpy())
    assert t["blk.1.exp_probs_b.bias"].shape == (8,) and t["blk.1.ffn_gate_exps.weight"].shape == (8, 32, 64)
    assert "blk.0.ffn_gate.weight" in t and "blk.1.attn_kv_b.weight" not in t
