"""Key maps are data: every kiln name has one HF name and back, for every family and head."""

from __future__ import annotations

import pytest
import torch

from kiln.models.auto import REGISTRY
from kiln.models.keymap import KeyMap, Rule


def test_templates_and_steps_both_directions():
    km = KeyMap([("layers.{}.attn.q_proj", "encoder.layer.{}.attention.self.query"),
                 Rule("w", "W", (lambda t: t.t(), lambda t: t.t()))])
    state = {"layers.11.attn.q_proj.weight": torch.ones(2, 3), "w": torch.arange(6.0).view(2, 3), "other": torch.ones(1)}
    hf, unmatched = km.to_hf(state)
    assert set(hf) == {"encoder.layer.11.attention.self.query.weight", "W"} and unmatched == ["other"]
    assert hf["W"].shape == (3, 2)
    back, unmatched = km.to_kiln(hf)
    assert unmatched == [] and torch.equal(back["w"], state["w"])
    assert set(back) == {"layers.11.attn.q_proj.weight", "w"}


@pytest.mark.parametrize("model_type", sorted(REGISTRY))
def test_every_kiln_tensor_has_a_reversible_hf_name(model_type):
    from kiln.interop.tiny import TINY

    # a family without a tiny config fails here rather than dropping out of the check
    assert model_type in TINY, f"registered family {model_type!r} has no tiny config in kiln/interop/tiny.py TINY"
    family = REGISTRY[model_type]
    config = family.config_cls.from_dict(dict(TINY[model_type]))
    for task in family.tasks:
        with torch.device("meta"):
            model = family.build(config, task)
        km = family.keymap(task)
        names = list(model.state_dict())
        hf = [km.hf_name(n) for n in names]
        assert None not in hf, (task, [n for n, h in zip(names, hf) if h is None])
        assert len(set(hf)) == len(hf), task
        assert [km.kiln_name(h) for h in hf] == names, task
