"""A config's sizes are validated before anything is built, in every family (issue 41, class 5): each size a
family's tiny config has, set to 0 or -1, is refused with a ConfigError naming the key (before, encoders failed
with a modulo by zero, decoders' MoE and linear-attention parts at their first forward, some not at all), and a
token routed to more experts than there are is refused; the sizes 0 legitimately means "none" pass."""

from __future__ import annotations

import pytest

from kiln.errors import ConfigError
from kiln.models.auto import REGISTRY, AutoConfig
from kiln.models.config import COUNTS, EXPERT_COUNTS, WHOLE_SIZES

CASES = [(mt, key, value) for mt, fam in REGISTRY.items() if fam.tiny is not None
         for key in WHOLE_SIZES if key in fam.tiny.config for value in (0, -1)]


IMAGE_TEXT = [mt for mt, fam in REGISTRY.items() if fam.tiny is not None and "vision_config" in fam.tiny.config]


def test_every_family_has_a_size_checked():
    checked = {mt for mt, _, _ in CASES} | set(IMAGE_TEXT)  # whose text part is a family of CASES
    assert checked == {mt for mt, fam in REGISTRY.items() if fam.tiny is not None}, checked


@pytest.mark.parametrize("model_type", IMAGE_TEXT)
@pytest.mark.parametrize("part,key", [("text_config", "num_hidden_layers"), ("vision_config", "depth"),
                                      ("vision_config", "num_heads"), ("vision_config", "patch_size")])
def test_an_image_text_config_refuses_a_size_of_either_tower(model_type, part, key):
    tiny = REGISTRY[model_type].tiny.config
    bad = {**tiny, part: {**tiny[part], key: 0}}
    said = f"{key} must be an integer >= 1, got 0" if part == "text_config" else f"vision_config.{key} must be an " \
        "integer >= 1, got 0"
    with pytest.raises(ConfigError, match=said):
        AutoConfig.for_model(model_type, **bad)


@pytest.mark.parametrize("model_type,key,value", CASES, ids=[f"{m}-{k}={v}" for m, k, v in CASES])
def test_a_size_below_one_is_refused_naming_the_key(model_type, key, value):
    fields = {**REGISTRY[model_type].tiny.config, key: value}
    with pytest.raises(ConfigError, match=f"^{model_type} config: {key} must be an integer >= 1, got {value}$"):
        AutoConfig.for_model(model_type, **fields)


@pytest.mark.parametrize("model_type", [mt for mt, f in REGISTRY.items() if f.tiny is not None
                                        and any(k in f.tiny.config for k in COUNTS)])
def test_a_negative_count_is_refused_and_zero_passes_where_it_means_none(model_type):
    tiny = REGISTRY[model_type].tiny.config
    key = next(k for k in COUNTS if k in tiny)
    with pytest.raises(ConfigError, match=f"{key} must be an integer >= 0, got -1"):
        AutoConfig.for_model(model_type, **{**tiny, key: -1})


MOE = [mt for mt, f in REGISTRY.items() if f.tiny is not None and "num_experts_per_tok" in f.tiny.config
       and any(k in f.tiny.config for k in EXPERT_COUNTS)]


@pytest.mark.parametrize("model_type", MOE)
def test_more_experts_per_token_than_experts_is_refused(model_type):
    tiny = REGISTRY[model_type].tiny.config
    name = next(k for k in EXPERT_COUNTS if k in tiny)
    AutoConfig.for_model(model_type, **tiny)  # a control: the tiny config itself passes
    with pytest.raises(ConfigError, match=rf"num_experts_per_tok \({tiny[name] + 1}\) must be within 1..{name}"):
        AutoConfig.for_model(model_type, **{**tiny, "num_experts_per_tok": tiny[name] + 1})


def test_zero_where_it_means_none_still_builds():
    from kiln.models.auto import from_config

    for model_type, key in (("bert", "type_vocab_size"), ("qwen3_next", "num_experts")):
        tiny = REGISTRY[model_type].tiny.config
        if key in tiny:
            from_config(AutoConfig.for_model(model_type, **{**tiny, key: 0}))
