"""The Trainer's fast/exact switch and what rides with it: train.exact = true keeps every module on
the path bit-identical to transformers (one SGD step lands on exactly transformers' weights); the
default turns the fast path on; metrics carry pad_fraction; SFT packing falls back (or refuses) for a
model that cannot keep packed samples apart (Mamba)."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.data.loader import Loader
from kiln.interop.tiny import make_tiny
from kiln.models import AutoModelForCausalLM
from kiln.models.common.fast import fast_state
from kiln.models.common.loss import lm_loss_sum, shift_labels
from kiln.train import Callback, Trainer


def _examples(n: int = 12) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        ids = torch.randint(4, 99, (5 + (i * 5) % 17,), generator=g)
        labels = ids.clone()
        labels[: len(ids) // 2] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _sgd_step(tmp_path, src, data, **overrides) -> Trainer:
    model = AutoModelForCausalLM.from_pretrained(src)
    return Trainer(model, data, optimizer=lambda groups: torch.optim.SGD(groups, lr=0.5), steps=1, batch_size=4,
                   weight_decay=0.0, schedule="constant", clip_grad_norm=None, progress=False, save_at_end=False,
                   out_dir=str(tmp_path / f"run-{len(overrides)}-{overrides.get('exact')}"), **overrides).fit()


def test_exact_true_takes_transformers_step_bit_for_bit(tmp_path):
    import transformers

    src = make_tiny("qwen3", "causal-lm", tmp_path / "src", tokenizer=False)
    data = _examples()
    t = _sgd_step(tmp_path, src, data, exact=True)
    assert not any(fast_state(t.unwrapped()).values())
    # transformers on the batch the Trainer drew: summed loss, gradient over the token count, one SGD step
    batch = Loader(data, 4, seed=t.args.seed, group_by_length=True).next_batch()
    hf = transformers.AutoModelForCausalLM.from_pretrained(src)
    loss_sum, count = lm_loss_sum(hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
                                  shift_labels(batch["labels"]))
    loss_sum.backward()
    with torch.no_grad():
        for p in hf.parameters():
            p.grad.mul_(1 / float(count))
    torch.optim.SGD(hf.parameters(), lr=0.5).step()
    ours, theirs = t.unwrapped().hf_state_dict(), hf.state_dict()
    for k, v in ours.items():
        assert torch.equal(v, theirs[k]), k
    # a control that can fail: the fast path (the default) is on and lands within rounding, not necessarily on it
    seen = []

    class During(Callback):
        def on_step(self, trainer, record):
            seen.append(all(fast_state(trainer.unwrapped()).values()))

    fast = _sgd_step(tmp_path, src, data, callbacks=[During()])
    assert seen == [True]  # trained on the fast path...
    assert not any(fast_state(fast.unwrapped()).values())  # ...and handed back on the exact one
    for k, v in fast.unwrapped().hf_state_dict().items():
        torch.testing.assert_close(v, theirs[k], rtol=1e-5, atol=1e-6)


def test_metrics_report_pad_fraction(tmp_path):
    src = make_tiny("qwen3", "causal-lm", tmp_path / "src", tokenizer=False)
    t = _sgd_step(tmp_path, src, _examples(), log_every=1)
    record = json.loads((t.out_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert 0.0 <= record["pad_fraction"] < 0.5


CHATS = [[{"role": "user", "content": f"what is {a} plus {b}?"}, {"role": "assistant", "content": f"{a + b}."}]
         for a in range(5) for b in range(4)]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    from kiln.data.bpe import train_bpe

    d = tmp_path_factory.mktemp("pack")
    data = d / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    train_bpe([data], d / "tok", vocab_size=300, min_frequency=1)
    return d


def _mamba_toml(d, pack_line: str, out: str) -> str:
    return f"""
[model]
family = "mamba"
task = "causal-lm"
tokenizer = "tok"
[model.config]
vocab_size = 300
hidden_size = 32
num_hidden_layers = 2
state_size = 8
pad_token_id = 0
eos_token_id = 2
[data]
train = "chat.jsonl"
max_length = 48
{pack_line}
[train]
out_dir = "{d / out}"
steps = 2
batch_size = 4
progress = false
"""


def test_sft_packing_falls_back_for_a_model_that_mixes_packed_samples(chat_dir):
    cfg = chat_dir / "default.toml"
    cfg.write_text(_mamba_toml(chat_dir, "", "run-default"))
    r = CliRunner().invoke(app, ["train", "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    assert "does not keep packed samples apart, so each row holds one sample" in r.output
    assert "20 samples -> 20 rows" in r.output  # unpacked: one row per conversation


def test_sft_packing_asked_for_is_refused_for_such_a_model(chat_dir):
    cfg = chat_dir / "explicit.toml"
    cfg.write_text(_mamba_toml(chat_dir, "pack = true", "run-explicit"))
    r = CliRunner().invoke(app, ["train", "--config", str(cfg)])
    assert r.exit_code != 0
    assert "data.pack = true" in r.output and "does not keep packed samples apart" in r.output


def test_adamw_is_fused_where_torch_has_it_else_foreach():
    from kiln.train.optim import adamw, param_groups

    model = torch.nn.Linear(4, 3)
    opt = adamw(param_groups(model, 0.01), 1e-3)
    assert opt.defaults["fused"] is True and not opt.defaults["foreach"]
    opt64 = adamw(param_groups(torch.nn.Linear(4, 3).double(), 0.01), 1e-3)  # no fused kernel for float64
    assert opt64.defaults["foreach"] is True and not opt64.defaults["fused"]
