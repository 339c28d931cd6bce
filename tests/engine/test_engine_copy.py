"""A model the engine has run can still be copied (engfeat): copy.deepcopy (and pickle) leave the cached runner
behind (kiln.engine.score's `_RunnerSlot`), the copy makes its own and generates what the original does, and the
state dict carries no engine state."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch

from kiln.engine import Engine, SamplingParams, token_logps
from kiln.engine.score import runner_for
from tests.engine.tiny import prompts, tiny_model

GREEDY = SamplingParams(max_tokens=6, logprobs=True)


def greedy(model) -> list[tuple[list[int], list[float]]]:
    outs = Engine(model, block_size=4).generate(prompts(3, 3, 10, seed=5), GREEDY)
    return [(o[0].token_ids, o[0].logprobs) for o in outs]


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5_text"])
def test_deepcopy_after_engine_use_generates_the_same(family):
    model = tiny_model(family)
    before = greedy(model)
    token_logps(model, [[5, 6, 7, 8]], [1], block_size=4)
    twin = copy.deepcopy(model)
    assert greedy(twin) == before
    assert runner_for(twin).model is twin and runner_for(model).model is model
    assert runner_for(twin) is not runner_for(model)
    # the copy is its own model: changing its weights changes its tokens, not the original's (the control)
    with torch.no_grad():
        twin.model.embed_tokens.weight.mul_(-1.0)
    assert greedy(twin) != before
    assert greedy(model) == before


def test_shallow_copy_and_a_pickled_slot_after_engine_use():
    model = tiny_model("qwen3")
    greedy(model)
    shallow = copy.copy(model)  # shares the original's modules and slot; its runner is its own
    assert runner_for(shallow).model is shallow and runner_for(model).model is model
    # (the tiny models themselves do not pickle: their configs hold lambdas) the slot pickles empty
    slot = model.__dict__["_engine_runner"]
    assert slot.runner is not None and pickle.loads(pickle.dumps(slot)).runner is None


def test_state_dict_save_holds_no_engine_state():
    model = tiny_model("qwen3")
    keys = set(model.state_dict())
    before = greedy(model)
    assert set(model.state_dict()) == keys
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh = tiny_model("qwen3", seed=9)
    assert greedy(fresh) != before  # the control: other weights, other tokens
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert greedy(fresh) == before
