"""LoRA on routed experts (PEFT's `target_parameters`): kiln's adapters load in PEFT on transformers' fused
experts with kiln's logits bit for bit, PEFT's load in kiln, merged exports read by transformers, and a
`kiln train` run's checkpoint holds such an adapter."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.errors import KilnError
from kiln.interop.export import export_model
from kiln.models import AutoModelForCausalLM
from kiln.models.common.lora import LoraConfig, apply_lora, load_adapter, save_adapter
from tests.parallel.sft_runs import losses, make_data, run_toml

peft = pytest.importorskip("peft")
transformers.logging.set_verbosity_error()
EXPERTS = ["experts.gate_up_proj", "experts.down_proj"]


def _ids():
    return torch.randint(4, 90, (2, 12), generator=torch.Generator().manual_seed(7))


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("model_type,dense", [("qwen3_moe", ["q_proj"]), ("deepseek_v3", [])])
def test_expert_adapter_in_peft_bit_identical_and_merged_export(model_type, dense, tiny_factory, tmp_path):
    src = tiny_factory(model_type, "causal-lm")
    ours = AutoModelForCausalLM.from_pretrained(src)
    apply_lora(ours, LoraConfig(r=2, alpha=4, targets=dense, target_parameters=EXPERTS))
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert any(".experts.lora.gate_up_proj.lora_A." in n for n in trainable)
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
    experts = next(m for n, m in ours.named_modules() if n.endswith("mlp.experts"))
    base = experts._parameters["gate_up_proj"].clone()
    opt = torch.optim.AdamW([p for p in ours.parameters() if p.requires_grad], lr=0.05)
    ids = _ids()
    for _ in range(2):
        ours.train()(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    ours.eval()
    assert torch.equal(experts._parameters["gate_up_proj"], base)  # the stacked base stayed frozen
    assert experts.lora["down_proj"].lora_B.weight.abs().sum() > 0  # and its adapter trained

    save_adapter(ours, tmp_path / "adapter", str(src))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    keys = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    # PEFT nests the wrappers of one module, the first registered innermost
    assert any(k.endswith("mlp.experts.base_layer.lora_A.weight") for k in keys)
    want = _logits(ours, ids)
    hf = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(src), tmp_path / "adapter")
    torch.testing.assert_close(_logits(hf.eval(), ids), want, rtol=0, atol=0)
    plain = _logits(transformers.AutoModelForCausalLM.from_pretrained(src).eval(), ids)
    assert (plain - want).abs().max() > 1e-3  # the control: the adapter moves the logits

    again = load_adapter(AutoModelForCausalLM.from_pretrained(src), tmp_path / "adapter")
    torch.testing.assert_close(_logits(again, ids), want, rtol=0, atol=0)

    # merged: each stacked weight is the adapted tensor the forward computed, so transformers gives kiln's logits
    # exactly; a dense adapter's merge rounds W + B A s once per weight (fp32 roundings on the logits' scale)
    out = export_model(ours, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tol = 2.0**-16 * want.abs().max().item() if dense else 0.0
    torch.testing.assert_close(_logits(merged, ids), want, rtol=0, atol=tol)


def test_peft_expert_adapter_loads_into_kiln(tiny_factory, tmp_path):
    src = tiny_factory("qwen3_moe", "causal-lm")
    hf = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(src),
                             peft.LoraConfig(r=3, lora_alpha=5, target_modules=[], task_type="CAUSAL_LM",
                                             target_parameters=["mlp.experts.down_proj"]))
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)  # PEFT starts B at zero; make the adapter do something
    hf.save_pretrained(tmp_path / "peft")
    ours = load_adapter(AutoModelForCausalLM.from_pretrained(src), tmp_path / "peft")
    assert [n for n, m in ours.named_modules() if n.endswith("experts.lora")] == ["model.layers.0.mlp.experts.lora"]
    torch.testing.assert_close(_logits(ours, _ids()), _logits(hf.eval(), _ids()), rtol=0, atol=0)


def test_expert_lora_bad_input_named(tiny_factory):
    src = tiny_factory("qwen3_moe", "causal-lm")
    with pytest.raises(KilnError, match=r"target parameter\(s\) \['experts.w1'\] match no stacked expert weight.*"
                                        r"experts.down_proj, experts.gate_up_proj"):
        apply_lora(AutoModelForCausalLM.from_pretrained(src), LoraConfig(targets=[], target_parameters=["experts.w1"]))
    with pytest.raises(KilnError, match="lora.dropout must be 0 with target_parameters"):
        apply_lora(AutoModelForCausalLM.from_pretrained(src),
                   LoraConfig(targets=[], dropout=0.1, target_parameters=EXPERTS))
    with pytest.raises(KilnError, match="no stacked experts"):
        apply_lora(AutoModelForCausalLM.from_pretrained(tiny_factory("qwen3", "causal-lm")),
                   LoraConfig(targets=[], target_parameters=EXPERTS))


MOE = dict(vocab_size=300, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_experts=4,
           num_experts_per_tok=2, norm_topk_prob=True, pad_token_id=0, eos_token_id=2, tie_word_embeddings=False)


def test_kiln_train_expert_lora_checkpoint_loads_in_peft(tmp_path):
    d = make_data(tmp_path)
    cfg = run_toml(d, "run", {}, family="qwen3_moe", config=MOE, train={"steps": 3, "save_every": 3})
    cfg.write_text(cfg.read_text() + f"[lora]\nr = 4\nalpha = 8\ntargets = []\ntarget_parameters = {json.dumps(EXPERTS)}\n")
    r = CliRunner().invoke(app, ["train", "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    assert len(losses(d / "run")) == 3
    ckpt = sorted((d / "run").glob("ckpt-*"))[-1] / "model"
    from kiln.models.auto import load_pretrained
    from kiln.train.checkpoint import load_model_weights

    ours = load_pretrained(ckpt)
    ids = _ids()
    want = _logits(ours, ids)
    with torch.no_grad():  # a resume copies the checkpoint's adapters back in place (PEFT's names mapped)
        for n, p in ours.named_parameters():
            if ".experts.lora." in n:
                p.zero_()
    load_model_weights(ckpt.parent, ours)
    torch.testing.assert_close(_logits(ours, ids), want, rtol=0, atol=0)
    base, adapter = d / "base", d / "adapter"  # apart: transformers loads an adapter it finds beside the weights
    shutil.copytree(ckpt, base, ignore=shutil.ignore_patterns("adapter_*"))
    adapter.mkdir()
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(ckpt / f, adapter / f)
    hf = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    torch.testing.assert_close(_logits(hf, ids), want, rtol=0, atol=0)
