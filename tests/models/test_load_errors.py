"""User errors while loading, each asserted by its message."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.errors import ConfigError, WeightsError
from kiln.models import AutoModel, load_pretrained


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unknown_model_type_names_the_supported_ones(tiny_factory, tmp_path):
    d = _copy(tiny_factory("bert", "base"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt-unknown"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"model_type 'gpt-unknown' is not supported; supported model types: .*bert.*roberta"):
        load_pretrained(d)


def test_missing_tensor_is_named(tiny_factory, tmp_path):
    d = _copy(tiny_factory("bert", "base"), tmp_path / "m")
    state = load_file(str(d / "model.safetensors"))
    del state["encoder.layer.1.attention.self.key.weight"]
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"missing tensor\(s\) 'encoder\.layer\.1\.attention\.self\.key\.weight'"):
        load_pretrained(d)


def test_wrong_shape_names_the_tensor_and_both_shapes(tiny_factory, tmp_path):
    d = _copy(tiny_factory("bert", "base"), tmp_path / "m")
    state = load_file(str(d / "model.safetensors"))
    state["encoder.layer.0.intermediate.dense.weight"] = torch.zeros(40, 32)
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsError, match=r"'encoder\.layer\.0\.intermediate\.dense\.weight' has shape \(40, 32\), "
                                           r"but this bert config expects \(37, 32\)"):
        load_pretrained(d)


def test_directory_without_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json in this directory"):
        AutoModel.from_pretrained(tmp_path)


def test_missing_directory(tmp_path):
    with pytest.raises(ConfigError, match="no such directory"):
        AutoModel.from_pretrained(tmp_path / "nope")


def test_broken_config_json_names_the_line(tmp_path):
    (tmp_path / "config.json").write_text('{\n  "model_type": "bert",\n  "hidden_size": ,\n}')
    with pytest.raises(ConfigError, match=r"config\.json:3: not valid JSON"):
        AutoModel.from_pretrained(tmp_path)


def test_unknown_activation_is_a_config_error(tiny_factory, tmp_path):
    d = _copy(tiny_factory("bert", "base"), tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_act"] = "swishy"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"hidden_act 'swishy' is not supported; choose one of: .*gelu"):
        load_pretrained(d)


def test_unknown_config_override_is_named(tiny_factory):
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['hiden_size'\]"):
        load_pretrained(tiny_factory("bert", "base"), hiden_size=3)
