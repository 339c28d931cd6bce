"""Staged growth and freezing: the loss is unchanged at the moment of growth for every placement,
frozen parameters never move, optimizer state follows its parameters, and a run resumed from a
checkpoint before or after the growth ends where the uninterrupted run ends."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kiln.errors import ConfigError
from kiln.models import AutoConfig
from kiln.models.auto import from_config
from kiln.models.hpn import PrototypeModel
from kiln.train.freeze import freeze
from kiln.train.grow import GrowthCallback, GrowthPlan, find_layers, grow_layers, new_layer_slots, regroup_optimizer
from kiln.train.multiobjective import GradientCombiner, losses_step
from kiln.train.optim import param_groups
from kiln.train.trainer import Trainer


def _mamba(layers: int = 2, **extra):
    cfg = AutoConfig.for_model("mamba", vocab_size=40, hidden_size=16, num_hidden_layers=layers, state_size=4,
                               scan="fast", **extra)
    return from_config(cfg, task="causal-lm", seed=0)


def _batch():
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("placement,slots", [("append", [2, 3]), ("prepend", [0, 1]), ("insert:1", [1, 2]),
                                             ("specific:0,3", [0, 3])])
def test_loss_is_unchanged_at_growth_for_each_placement(placement, slots):
    model = _mamba()
    old = list(find_layers(model)[1])
    with torch.no_grad():
        before = model(**_batch()).loss
    assert grow_layers(model, 4, placement, seed=0) == slots
    stack = find_layers(model)[1]
    assert [i for i, layer in enumerate(stack) if all(layer is not o for o in old)] == slots
    assert [layer for i, layer in enumerate(stack) if i not in slots] == old  # old layers keep their order
    with torch.no_grad():
        after = model(**_batch()).loss
    print(f"{placement}: loss before {before.item():.8f} after {after.item():.8f}")
    assert torch.equal(before, after) and model.config.num_hidden_layers == 4
    model(**_batch()).loss.backward()  # the zeroed projection of a new layer still learns
    assert stack[slots[0]].mixer.out_proj.weight.grad.abs().sum() > 0


def test_frozen_parameters_do_not_change_across_steps():
    model = _mamba(layers=3)
    frozen = set(freeze(model, ["first:1", "layers:2", "embeddings"]))
    assert "model.embeddings.weight" in frozen and "model.layers.0.mixer.A_log" in frozen
    assert not any(n.startswith("model.layers.1.") for n in frozen)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([g for g in param_groups(model, 0.1) if g["params"]], lr=1e-2)
    for _ in range(3):
        model(**_batch()).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]) == (n in frozen), n


def test_optimizer_state_follows_parameters_through_growth():
    model = _mamba()
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    for _ in range(2):
        model(**_batch()).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    old_state = {p: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    grow_layers(model, 3, "insert:1")
    regroup_optimizer(opt, param_groups(model, 0.1))
    for p, s in old_state.items():
        assert all(torch.equal(opt.state[p][k], v) for k, v in s.items())
    new = list(find_layers(model)[1][1].parameters())
    assert all(p not in opt.state for p in new) and all(any(p is q for q in opt.param_groups[0]["params"]
                                                            + opt.param_groups[1]["params"]) for p in new)
    model(**_batch()).loss.backward()
    opt.step()
    assert all(opt.state[p]["step"] == 1 for p in new)
    # The order a resumed run builds (natural parameter order) is the order the regrouped optimizer has.
    fresh = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    fresh.load_state_dict(opt.state_dict())
    for p in model.parameters():
        assert torch.equal(fresh.state[p]["exp_avg"], opt.state[p]["exp_avg"])


def _rows(n: int = 24) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 40, (10,), generator=g)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def _run(out_dir, resume=None, method="gradnorm"):
    plan = GrowthPlan(at_step=4, target_layers=3, placement="insert:1", freeze=["embeddings"],
                      freeze_after=["first:1"])
    model = PrototypeModel(_mamba(), num_classes=40, proto_dim=8, loss="cosine", spread_steps=20)
    trainer = Trainer(model, _rows(), step=losses_step, objectives=GradientCombiner(method),
                      callbacks=[GrowthCallback(plan)], resume=resume, out_dir=str(out_dir), steps=8, batch_size=4,
                      lr=3e-3, save_every=2, keep_last=10, progress=False, seed=5, warmup_steps=0)
    trainer.fit()
    losses = [json.loads(line)["loss"] for line in (out_dir / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    return trainer.unwrapped(), losses, trainer


def test_resume_before_and_after_growth_matches_uninterrupted(tmp_path):
    full, full_losses, trainer = _run(tmp_path / "full")
    assert len(find_layers(full)[1]) == 3 and trainer.objectives.weights is not None
    for keep in (2, 6):  # one checkpoint before the growth at step 4, one after it
        run = tmp_path / f"from-{keep}"
        shutil.copytree(tmp_path / "full", run)
        for ckpt in run.glob("ckpt-*"):
            if int(ckpt.name.split("-")[-1]) > keep:
                shutil.rmtree(ckpt)
        resumed, losses, _ = _run(run, resume=run)
        assert losses == full_losses, keep
        want = full.state_dict()
        for name, tensor in resumed.state_dict().items():
            assert torch.equal(tensor, want[name]), f"resumed from step {keep}: {name} differs"


def test_user_errors_name_the_setting():
    with pytest.raises(ConfigError, match=r"grow.placement 'middle' is not valid for 2 -> 4 layers"):
        new_layer_slots("middle", 2, 4)
    with pytest.raises(ConfigError, match=r"specific:i,j,... \(2 distinct indices below 4\)"):
        new_layer_slots("specific:1,1", 2, 4)
    with pytest.raises(ConfigError, match=r"target_layers \(2\) must exceed base_layers \(2\)"):
        new_layer_slots("append", 2, 2)
    with pytest.raises(ConfigError, match=r"grow.freeze: freeze policy 'last:5' is not valid for 2 layers"):
        freeze(_mamba(), ["last:5"], key="grow.freeze")
    bert = from_config(AutoConfig.for_model("bert", vocab_size=30, hidden_size=16, num_hidden_layers=1,
                                            num_attention_heads=2, intermediate_size=20), task="base", seed=0)
    with pytest.raises(ConfigError, match=r"EncoderLayer does not"):
        grow_layers(bert, 2)
