"""With kiln's earlier generation loop removed, GRPO's rollouts run on the engine or are refused by name:
`rollout = "generate"` names the removal, and a model the engine cannot run names what the engine lacks."""

from __future__ import annotations

import types

import pytest
from pydantic import ValidationError

from kiln.errors import KilnError
from kiln.train.grpo_config import GRPOSection
from kiln.train.grpo_engine import EngineDecoder
from kiln.train.grpo_rollout import GRPORun
from tests.train.test_dpo_logps import tiny_lm


def test_rollout_generate_names_its_removal():
    assert GRPOSection(rewards=["length"]).rollout == "engine"
    with pytest.raises(ValidationError, match="generation loop was removed"):
        GRPOSection(rewards=["length"], rollout="generate")


def _run() -> GRPORun:
    cfg = types.SimpleNamespace(grpo=GRPOSection(rewards=["length"]), train=types.SimpleNamespace(seed=0), lora=None)
    return GRPORun(cfg, None, None, [], None, None)


def test_a_model_the_engine_runs_rolls_out_on_it():
    model = tiny_lm(tied=False)
    assert isinstance(_run().decoder(model, sharded=False), EngineDecoder)


def test_a_model_the_engine_does_not_run_is_refused_naming_why():
    model = tiny_lm(tied=False)
    layer = model.model.layers[0]
    layer.__class__ = type("OwnLayer", (type(layer),), {})  # a layer class no runner is registered for
    with pytest.raises(KilnError, match="does not run .* yet.*generate loop.*was removed"):
        _run().decoder(model, sharded=False)
