"""Aux-loss-free balancing: on a router skewed toward three experts the load evens out with the callback and
stays skewed without it; the bias is model state, so a resumed run ends exactly where an uninterrupted one does."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from kiln.errors import KilnError
from kiln.interop.tiny import TINY
from kiln.models.auto import AutoConfig, from_config
from kiln.models.common.moe_routing import SharedExpertMoE
from kiln.train import Trainer
from kiln.train.moe_balance import AuxFreeBalance, load_stats

HOT = (0, 1, 2)  # the experts the skewed router prefers


def _data(n: int = 32, length: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(4, 99, (length,), generator=g) for _ in range(n)]
    return [{"input_ids": r, "labels": r.clone()} for r in rows]


def _skewed_model():
    """Tiny DeepSeek-V3 whose MoE router adds about +4 to the logits of the HOT experts for typical tokens."""
    model = from_config(AutoConfig.for_model("deepseek_v3", **TINY["deepseek_v3"]), task="causal-lm", seed=0)
    moe = next(m for m in model.modules() if isinstance(m, SharedExpertMoE))
    seen = []
    hook = moe.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        model.eval()(input_ids=torch.stack([d["input_ids"] for d in _data()[:8]]))
        hook.remove()
        mean = torch.cat(seen).mean(0)  # (C,) the typical MoE input
        moe.gate.weight.normal_(0.0, 0.3)  # varied routing between tokens...
        for e in HOT:  # ...plus a pull toward three experts
            moe.gate.weight[e] += 4.0 * mean / mean.dot(mean)
    return model.train()


def _run(tmp_path, callbacks, **kw):
    args = dict(steps=40, batch_size=4, lr=1e-6, schedule="constant", out_dir=str(tmp_path), progress=False,
                device="cpu", seed=0, clip_grad_norm=None)
    return Trainer(kw.pop("model", None) or _skewed_model(), _data(), callbacks=callbacks, **{**args, **kw}).fit()


def _mean(history, steps):
    return sum(h["moe_imbalance"] for h in history[steps]) / len(history[steps])


def test_load_evens_out_with_the_callback_and_not_without(tmp_path):
    on = AuxFreeBalance(bias_update_speed=0.02)
    _run(tmp_path / "on", [on])
    # control: the same run measured with the biases left alone
    off = AuxFreeBalance(bias_update_speed=0.02, update=False)
    _run(tmp_path / "off", [off])
    start, on_end, off_end = _mean(on.history, slice(0, 5)), _mean(on.history, slice(20, 40)), \
        _mean(off.history, slice(20, 40))
    assert start > 1.7  # max/mean tokens per expert: the HOT experts take most of the load
    assert on_end < 0.8 * start and on_end < 0.8 * off_end, (start, on_end, off_end)
    assert off_end > 0.85 * _mean(off.history, slice(0, 5))  # without it the skew stays
    trained = load_file(str(tmp_path / "on" / "ckpt-000040" / "model" / "model.safetensors"))
    saved = trained["model.layers.1.mlp.gate.e_score_correction_bias"]  # the checkpoint holds the moved bias
    assert all(saved[e] < 0 for e in HOT) and saved.abs().sum() > 0
    untouched = load_file(str(tmp_path / "off" / "ckpt-000040" / "model" / "model.safetensors"))
    assert not untouched["model.layers.1.mlp.gate.e_score_correction_bias"].any()


def test_counts_only_in_training_and_stats_keys(tmp_path):
    model = _skewed_model().eval()
    with torch.no_grad():
        model(input_ids=_data()[0]["input_ids"][None])
    gate = next(m for m in model.modules() if isinstance(m, SharedExpertMoE)).gate
    assert gate.expert_load is None  # eval forwards count nothing
    model.train()
    model(input_ids=_data()[0]["input_ids"][None])
    load = gate.take_load()
    assert int(load.sum()) == 16 * 3 and gate.expert_load is None
    stats = load_stats(torch.tensor([[6, 2, 0, 0]]), ["model.layers.1"])
    assert stats == {"moe_max_load.model.layers.1": 6.0, "moe_mean_load.model.layers.1": 2.0, "moe_imbalance": 3.0}


def test_resume_continues_bias_and_weights_exactly(tmp_path):
    kw = dict(steps=8, lr=1e-3, save_every=4)
    ref = AuxFreeBalance(bias_update_speed=0.02)
    _run(tmp_path / "ref", [ref], **kw)
    _run(tmp_path / "run", [AuxFreeBalance(bias_update_speed=0.02)], **{**kw, "steps": 4})
    again = AuxFreeBalance(bias_update_speed=0.02)
    Trainer(_skewed_model(), _data(), callbacks=[again], resume=tmp_path / "run", steps=8, batch_size=4, lr=1e-3,
            schedule="constant", out_dir=str(tmp_path / "run"), progress=False, device="cpu", seed=0,
            clip_grad_norm=None, save_every=4).fit()
    a = load_file(str(tmp_path / "ref" / "ckpt-000008" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "run" / "ckpt-000008" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert a["model.layers.1.mlp.gate.e_score_correction_bias"].abs().sum() > 0
    assert again.history == ref.history[4:]


def test_model_without_sigmoid_router_is_named(tiny_factory, tmp_path):
    from kiln.models import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_factory("qwen3_moe", "causal-lm"))
    with pytest.raises(KilnError, match="no sigmoid-routed MoE layer"):
        Trainer(model, _data(), callbacks=[AuxFreeBalance()], steps=1, batch_size=4, out_dir=str(tmp_path),
                progress=False, device="cpu").fit()


def test_tp_ranks_count_their_group_once_and_pp_is_refused():
    """Under tp every rank of a group routes the same whole tokens: the summed counts are divided by tp, so the
    statistics read as one process's. Pipeline stages hold different layers: refused by message."""
    from types import SimpleNamespace

    model = _skewed_model()
    world = SimpleNamespace(active=False)
    trainer = SimpleNamespace(unwrapped=lambda: model, device=torch.device("cpu"), world=world, step=1,
                              parallel=SimpleNamespace(pp=1), plan=SimpleNamespace(degrees=SimpleNamespace(tp=2)))
    balance = AuxFreeBalance(update=False)
    balance.on_setup(trainer, 0)
    model(input_ids=torch.stack([d["input_ids"] for d in _data()[:2]]))  # 32 tokens, top-3 of 8 experts
    model(input_ids=torch.stack([d["input_ids"] for d in _data()[:2]]))  # what the tp peer would add
    record = {"loss": 1.0, "grad_norm": 1.0}
    balance.on_step(trainer, record)
    assert record["moe_mean_load.model.layers.1"] == 32 * 3 / 8  # one copy of the group's tokens
    trainer.parallel = SimpleNamespace(pp=2)
    with pytest.raises(KilnError, match=r"\[moe\]\) with parallel.pp > 1 is not supported"):
        balance.on_setup(trainer, 0)
