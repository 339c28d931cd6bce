"""A checkpoint's weights go into a live model through the one HF load path: mapped by the family's
key map, shapes checked with the tensor named, copied in place so the optimizer's parameters stay
the ones it holds."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from kiln.models import AutoModelForCausalLM
from kiln.train.checkpoint import load_model_weights
from kiln.train.ckpt_check import CheckpointLoadError  # a WeightsError's message, naming the checkpoint file


def _ckpt(tmp_path, model):
    model.save_pretrained(tmp_path / "ckpt" / "model")
    return tmp_path / "ckpt"


def test_weights_copy_in_place_through_the_key_map(tiny_factory, tmp_path):
    src = tiny_factory("qwen3_moe", "causal-lm")  # stacked experts: the key map's Stack rule runs on the way in
    saved = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for p in saved.parameters():
            p.add_(0.5)
    ckpt = _ckpt(tmp_path, saved)
    live = AutoModelForCausalLM.from_pretrained(src)
    params = dict(live.named_parameters())
    load_model_weights(ckpt, live)
    for n, p in live.named_parameters():
        assert p is params[n], f"{n} was replaced, not copied into"
        assert torch.equal(p, dict(saved.named_parameters())[n]), n


def test_wrong_shape_and_missing_tensor_are_named(tiny_factory, tmp_path):
    src = tiny_factory("llama", "causal-lm")
    ckpt = _ckpt(tmp_path, AutoModelForCausalLM.from_pretrained(src))
    live = AutoModelForCausalLM.from_pretrained(src)
    weights = ckpt / "model" / "model.safetensors"
    state = live.hf_state_dict()
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 32)
    save_file({k: v.contiguous() for k, v in state.items()}, str(weights))
    with pytest.raises(CheckpointLoadError, match=r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' has shape \(3, 32\), "
                                           r"but this llama config expects \(\d+, 32\)"):
        load_model_weights(ckpt, live)
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file({k: v.contiguous() for k, v in state.items()}, str(weights))
    with pytest.raises(CheckpointLoadError, match=r"missing tensor\(s\) 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_model_weights(ckpt, live)


def test_plain_module_loads_under_its_own_names(tmp_path):
    saved, live = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    (tmp_path / "ckpt" / "model").mkdir(parents=True)
    save_file(saved.state_dict(), str(tmp_path / "ckpt" / "model" / "model.safetensors"))
    weight = live.weight
    load_model_weights(tmp_path / "ckpt", live)
    assert live.weight is weight and torch.equal(live.weight, saved.weight) and torch.equal(live.bias, saved.bias)
    save_file({"weight": torch.zeros(3, 5), "bias": saved.bias}, str(tmp_path / "ckpt" / "model" / "model.safetensors"))
    with pytest.raises(CheckpointLoadError, match=r"tensor 'weight' has shape \(3, 5\), but the model expects \(3, 4\)"):
        load_model_weights(tmp_path / "ckpt", live)
