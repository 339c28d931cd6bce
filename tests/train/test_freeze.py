"""One freeze language for train.freeze and grow.freeze: layer policies, embeddings, and parameter
name prefixes / globs, in any mix; every bad spec is named with the setting it came from."""

from __future__ import annotations

import pytest

from kiln.errors import ConfigError
from kiln.models import AutoConfig
from kiln.models.auto import from_config
from kiln.train.freeze import freeze, spec_error


def _qwen3(layers: int = 3):
    cfg = AutoConfig.for_model("qwen3", vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=layers,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=False)
    return from_config(cfg, task="causal-lm", seed=0)


def test_policies_and_names_mix_and_freeze_exactly_what_they_name():
    model = _qwen3()
    frozen = freeze(model, ["last:1", "embeddings", "model.layers.0.self_attn.*_norm.*", "lm_head"])
    want = {n for n, _ in model.named_parameters()
            if n.startswith(("model.layers.2.", "model.embed_tokens.", "lm_head."))
            or n in ("model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight")}
    assert set(frozen) == want and len(frozen) == len(want)
    assert frozen == [n for n, _ in model.named_parameters() if n in want]  # model order
    assert all(p.requires_grad == (n not in want) for n, p in model.named_parameters())


def test_layer_policies_count_from_either_end():
    def layers(specs: list[str]) -> list[int]:
        names = freeze(_qwen3(layers=4), specs)
        return sorted({int(n.split(".")[2]) for n in names if n.startswith("model.layers.")})

    assert layers(["first:2"]) == [0, 1]
    assert layers(["layers:3,1"]) == [1, 3]
    assert layers(["last:0", "first:0"]) == []
    assert layers(["indices:0,2"]) == [0, 2]  # the seed research trainer's spelling of layers:i,j
    assert spec_error("indices:0,2,5") is None and spec_error("indices:0,x") is not None


@pytest.mark.parametrize("spec,key,message", [
    ("last:4", "grow.freeze", r"grow.freeze: freeze policy 'last:4' is not valid for 3 layers"),
    ("layers:1,x", "train.freeze", r"train.freeze: freeze policy 'layers:1,x' is not valid for 3 layers"),
    ("indices:0,3", "train.freeze", r"train.freeze: freeze policy 'indices:0,3' is not valid for 3 layers"),
    ("middle:1", "grow.freeze_after", r"grow.freeze_after: 'middle:1' is not a freeze spec; use first:N"),
    ("model.encoder", "train.freeze", r"train.freeze: \['model.encoder'\] match no parameter name "
                                      r"\(names look like 'model.embed_tokens.weight'\)"),
])
def test_bad_specs_name_the_setting(spec, key, message):
    model = _qwen3()
    with pytest.raises(ConfigError, match=message):
        freeze(model, [spec], key=key)
    assert all(p.requires_grad for p in model.parameters())  # nothing half-frozen by a refused list
