"""LoRA: only adapters train; kiln's adapters load in PEFT and PEFT's in kiln with equal logits; merge."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from kiln.errors import KilnError
from kiln.interop.export import export_model
from kiln.models import AutoModelForCausalLM
from kiln.models.common.lora import LoraConfig, apply_lora, load_adapter, save_adapter
from kiln.models.tasks import CAUSAL_LM

transformers.logging.set_verbosity_error()


def _batch():
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(4, 99, (2, 10), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 7:] = 0
    return {"input_ids": ids, "attention_mask": attn}


def _train_a_little(model, steps: int = 3) -> None:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.05)
    ids = _batch()["input_ids"]
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.eval()


@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_kiln_adapter_loads_in_peft_with_identical_logits(model_type, tiny_factory, tmp_path):
    import peft

    src = tiny_factory(model_type, "causal-lm")
    ours = AutoModelForCausalLM.from_pretrained(src)
    targets = apply_lora(ours, LoraConfig(r=4, alpha=8, targets=["q_proj", "v_proj", "down_proj"]))
    assert len(targets) == 6
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    base_before = ours.model.layers[0].self_attn.q_proj.weight.clone()
    _train_a_little(ours.train())
    assert torch.equal(ours.model.layers[0].self_attn.q_proj.weight, base_before)  # the base stayed frozen
    save_adapter(ours, tmp_path / "adapter", base_model_name_or_path=str(src))

    hf = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(src), tmp_path / "adapter").eval()
    with torch.no_grad():
        a, b = ours(**_batch()).logits, hf(**_batch()).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)

    # merged into the base and exported: a plain HF directory with the same outputs (up to rounding)
    out = export_model(ours, tmp_path / "merged")
    assert not (out / "adapter_config.json").exists()
    merged = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(**_batch()).logits, a, rtol=1e-5, atol=1e-5)
    assert hasattr(ours, "lora_config")  # exporting an in-memory model did not merge it in place


def test_peft_adapter_loads_into_kiln(tiny_factory, tmp_path):
    import peft

    src = tiny_factory("qwen2", "causal-lm")
    hf = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(src),
                             peft.LoraConfig(r=2, lora_alpha=5, target_modules=["k_proj", "o_proj", "gate_proj"],
                                             task_type="CAUSAL_LM"))
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)  # PEFT starts B at zero; make the adapter do something
    hf.save_pretrained(tmp_path / "peft")
    hf.eval()
    ours = load_adapter(AutoModelForCausalLM.from_pretrained(src), tmp_path / "peft")
    with torch.no_grad():
        torch.testing.assert_close(ours(**_batch()).logits, hf(**_batch()).logits, rtol=0, atol=0)


def test_save_pretrained_keeps_adapter_beside_base_and_reloads(tiny_factory, tmp_path):
    src = tiny_factory("qwen3", "causal-lm")
    ours = AutoModelForCausalLM.from_pretrained(src)
    apply_lora(ours, LoraConfig(r=2, alpha=4, targets="all-linear"))
    _train_a_little(ours.train(), steps=1)
    ours.save_pretrained(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "adapter_model.safetensors").is_file()
    # the PEFT task type comes off the model's registry Task (Family.build turns the name into it)
    assert type(ours.task) is type(CAUSAL_LM) and ours.task == CAUSAL_LM
    assert json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())["task_type"] == "CAUSAL_LM"
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    with torch.no_grad():
        torch.testing.assert_close(again(**_batch()).logits, ours(**_batch()).logits, rtol=0, atol=0)


def test_target_that_matches_nothing_is_named(tiny_factory):
    ours = AutoModelForCausalLM.from_pretrained(tiny_factory("qwen3", "causal-lm"))
    with pytest.raises(KilnError, match=r"lora target module\(s\) \['qkv'\] match no Linear layer.*Linear names here: "
                                        r"down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"):
        apply_lora(ours, LoraConfig(targets=["q_proj", "qkv"]))
