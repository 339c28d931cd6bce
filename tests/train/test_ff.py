"""[ff]: the seed trainer's Forward-Forward rule on kiln's Mamba: goodness, hinge, gradient and the
one-sided surgery against hand computations; FF-only steps move D and nothing else; the hinge engages
from transformers' init and from d_init = "normal"; the named flags; SIGKILL + resume is exact."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.train.metrics import read_metrics
from kiln.train.recipes.ff import FFSection, ff_loss_and_grad, goodness, summaries, surgery
from tests.train.test_mamba_hpn_toml import shards  # noqa: F401  (the module-scoped fixture: tokenizer + token shards)
from tests.train.train_helpers import killed_then_resumed_matches

EPS = 1e-5  # the seed's goodness epsilon


def _by_hand(x: list, D: list) -> dict:
    """The seed's rule written out element by element in float64 (x: B x T x I nested lists)."""
    B, T, I = len(x), len(x[0]), len(x[0][0])
    pos = [sum(x[b][t][d] for b in range(B) for t in range(T)) / (B * T) for d in range(I)]
    neg = [sum(x[b][(t + 1) % T][d] * (1 if (t + d) % 2 == 0 else -1) for b in range(B) for t in range(T)) / (B * T)
           for d in range(I)]

    def std(h):  # population std, as the seed's
        m = sum(h) / len(h)
        return math.sqrt(sum((v - m) ** 2 for v in h) / len(h))

    norm = math.sqrt(sum(v * v for v in D)) + EPS
    sp, sn = std(pos) + EPS, std(neg) + EPS
    gp = sum(pos[d] / sp * D[d] / norm for d in range(I))
    gn = sum(neg[d] / sn * D[d] / norm for d in range(I))
    loss = max(0.0, 1 - (gp - gn))
    grad = [-(pos[d] / sp - neg[d] / sn) / norm if loss > 0 else 0.0 for d in range(I)]
    return {"pos": pos, "neg": neg, "g_pos": gp, "g_neg": gn, "loss": loss, "grad": grad}


def test_goodness_hinge_and_gradient_match_the_seeds_rule_by_hand():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
    D = torch.randn(6, generator=g, dtype=torch.float64) * 0.02
    want = _by_hand(x.tolist(), D.tolist())
    s_pos, s_neg = summaries(x)
    pos, neg = s_pos / 10, s_neg / 10
    assert torch.allclose(pos, torch.tensor(want["pos"], dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.allclose(neg, torch.tensor(want["neg"], dtype=torch.float64), rtol=0, atol=1e-12)
    assert float(goodness(pos, D)) == pytest.approx(want["g_pos"], rel=1e-12)
    assert float(goodness(neg, D)) == pytest.approx(want["g_neg"], rel=1e-12)
    loss, grad = ff_loss_and_grad(D, pos, neg)  # fp32 inside: float32 rounding, ~1e-7 relative
    assert want["loss"] > 0  # the hinge is active, so the gradient is not trivially zero
    assert loss == pytest.approx(want["loss"], rel=1e-5)
    assert torch.allclose(grad.double(), torch.tensor(want["grad"], dtype=torch.float64), rtol=1e-4, atol=1e-6)

    # The closed form is autograd's gradient of the hinge with |D| held constant (the seed's derivation) ...
    d = D.clone().requires_grad_(True)
    unit = d / (d.detach().norm() + EPS)
    hinge = torch.relu(1 - ((pos / (pos.std(correction=0) + EPS) * unit).sum() - (neg / (neg.std(correction=0) + EPS)
                                                                                     * unit).sum()))
    (auto,) = torch.autograd.grad(hinge, d)
    assert torch.allclose(grad.double(), auto, rtol=1e-4, atol=1e-6)
    # ... and not the full gradient, which also differentiates |D| (control: the check above can fail).
    (full,) = torch.autograd.grad(torch.relu(1 - (goodness(pos, d) - goodness(neg, d))), d)
    assert not torch.allclose(grad.double(), full, rtol=1e-2, atol=0)


def test_a_satisfied_margin_gives_zero_loss_and_gradient():
    pos, neg = torch.tensor([3.0, -1.0, 2.0]), torch.tensor([-3.0, 1.0, -2.0])
    loss, grad = ff_loss_and_grad(pos.clone(), pos, neg)  # D along pos: g_pos - g_neg = 2 |pos| / std > 1
    assert loss == 0.0 and torch.equal(grad, torch.zeros(3))


BP, FFG = torch.tensor([1.0, 0.0, 0.5]), torch.tensor([-1.0, 1.0, 0.0])  # dot = -1: they conflict


def _combined(method: str, **kw) -> list[float]:
    """bp + (ff_lr / lr) * surgery(ff, bp) with ff_lr / lr = 1, as the seed adds them on a bp step."""
    return (BP + surgery(FFG, BP, FFSection(surgery=method, **kw))).tolist()


def test_one_sided_surgery_on_the_example_vectors():
    # pcgrad: ff - (dot / |bp|^2) bp = [-1, 1, 0] + 0.8 [1, 0, .5] = [-0.2, 1, 0.4]; plus bp: [0.8, 1.0, 0.9]
    assert _combined("pcgrad") == pytest.approx([0.8, 1.0, 0.9], abs=1e-6)
    # cagradstep removes lambda times that projection: lambda = 1 is pcgrad, 0.5 gives ff + 0.4 bp
    assert _combined("cagradstep") == pytest.approx([0.8, 1.0, 0.9], abs=1e-6)
    assert _combined("cagradstep", cagrad_lambda=0.5) == pytest.approx([0.4, 1.0, 0.7], abs=1e-6)
    assert FFSection(surgery="cagrad").surgery == "cagradstep"  # the seed's parser's other spelling
    # gradnorm: ff * exp(alpha |ff/|ff| - bp/|bp||), alpha 0.2
    f, b = [-1 / math.sqrt(2), 1 / math.sqrt(2), 0.0], [1 / math.sqrt(1.25), 0.0, 0.5 / math.sqrt(1.25)]
    scale = math.exp(0.2 * math.sqrt(sum((p - q) ** 2 for p, q in zip(f, b))))
    assert _combined("gradnorm") == pytest.approx([1 - scale, scale, 0.5], abs=1e-5)
    # one-sided: only ff changes; an FF gradient that agrees with bp passes pcgrad and cagradstep unchanged
    agree = torch.tensor([1.0, 1.0, 0.0])
    for method in ("pcgrad", "cagradstep"):
        assert torch.equal(surgery(agree, BP, FFSection(surgery=method)), agree)
    with pytest.raises(ValueError, match="surgery"):
        FFSection(surgery="sum")


SIZES = dict(vocab_size=300, hidden_size=16, state_size=4, conv_kernel=4, num_hidden_layers=2)


def _model_dir(path: Path, tok: Path) -> Path:
    """A tiny Mamba as transformers initialises it (D = 1), saved as a pretrained directory."""
    from kiln.hub import Tokenizer
    from kiln.models.auto import AutoConfig, from_config

    if not path.exists():
        model = from_config(AutoConfig.for_model("mamba", **SIZES), task="causal-lm", seed=0)
        model.tokenizer = Tokenizer.from_dir(tok)
        model.save_pretrained(path)
    return path


def _run_toml(path: Path, tok: Path, shard_dir: Path, out_dir: Path, ff: str = "", steps: int = 8,
              freeze: str = "[]", scratch: bool = False) -> Path:
    if scratch:
        sizes = ", ".join(f"{k} = {v}" for k, v in SIZES.items())
        model = f'family = "mamba"\ntokenizer = "{tok}"\nconfig = {{ {sizes} }}'
    else:
        model = f'path = "{_model_dir(path.parent / "mamba-tiny", tok)}"'
    path.write_text(f"""[model]
{model}
task = "causal-lm"
[data]
train = "{shard_dir}"
max_length = 16
[train]
out_dir = "{out_dir}"
seed = 1
steps = {steps}
batch_size = 4
lr = 1e-2
save_every = 2
keep_last = 10
progress = false
freeze = {freeze}
{ff}""")
    return path


FF = """[ff]
ff_lr = 0.05
bp_cadence_steps = 3
"""


def _rows(run: Path) -> list[dict]:
    return [x for x in read_metrics(run / "metrics.jsonl") if "step" in x and "loss" in x]


def test_ff_steps_move_only_D_and_the_hinge_engages_from_transformers_init(tmp_path, shards):
    tok, shard_dir = shards
    cfg = _run_toml(tmp_path / "run.toml", tok, shard_dir, tmp_path / "run", "[ff]\n", steps=6, freeze='["layers:0"]')
    # the named flags (recipe shortcuts) set the [ff] keys
    r = CliRunner().invoke(app, ["train", "--config", str(cfg), "--ff-lr", "0.05", "--bp-cadence-steps", "3",
                                 "--gradient-surgery-method", "pcgrad"])
    assert r.exit_code == 0, r.output
    rows = _rows(tmp_path / "run")
    assert [x["step"] for x in rows] == [1, 2, 3, 4, 5, 6]
    assert [x["lr"] == 0.05 for x in rows] == [True, True, False] * 2  # FF steps report ff_lr: cadence 3
    assert [("conflict_layers" in x) for x in rows] == [False, False, True] * 2
    # D = 1 (transformers' init): on the conv input the hinge engages (here on 4 of the 6 steps; it held 0 of 90
    # times with the old capture); one trainable layer, so ff_updates is 1 exactly where ff_loss > 0
    assert sum(x["ff_loss"] > 0 for x in rows) >= 2, [x["ff_loss"] for x in rows]
    assert all(x["ff_updates"] == int(x["ff_loss"] > 0) for x in rows)
    assert all(0 <= x["conflict_layers"] <= 1 for x in rows if "conflict_layers" in x)
    # steps 1-2 are FF steps: between ckpt-2 and the initial weights only the trainable D moved
    s2 = load_file(str(tmp_path / "run" / "ckpt-000002" / "model" / "model.safetensors"))
    s4 = load_file(str(tmp_path / "run" / "ckpt-000004" / "model" / "model.safetensors"))
    init = load_file(str(tmp_path / "mamba-tiny" / "model.safetensors"))
    moved = {k for k in s2 if not torch.equal(s2[k], init[k])}
    assert moved == {"backbone.layers.1.mixer.D"}
    # step 3 backprops: everything trainable moves; layer 0 (frozen) never does, its D included
    assert not torch.equal(s4["backbone.layers.1.mixer.in_proj.weight"], s2["backbone.layers.1.mixer.in_proj.weight"])
    assert all(torch.equal(s4[k], init[k]) for k in init if k.startswith("backbone.layers.0."))


def test_d_init_normal_starts_D_small_and_the_hinge_engages(tmp_path, shards):
    tok, shard_dir = shards
    ff = "[ff]\nff_lr = 1e-4\nbp_cadence_steps = 4\nd_init = \"normal\"\n"
    cfg = _run_toml(tmp_path / "run.toml", tok, shard_dir, tmp_path / "run", ff, steps=2, scratch=True)
    r = CliRunner().invoke(app, ["train", "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    rows = _rows(tmp_path / "run")
    assert all(x["ff_loss"] > 0 and x["ff_updates"] >= 1 for x in rows), rows  # both steps FF, hinge active
    D = {k: v for k, v in load_file(str(tmp_path / "run" / "ckpt-000002" / "model" / "model.safetensors")).items()
         if k.endswith(".D")}
    # 2 x 32 draws of N(0, 0.02): the sample std is within ~3 standard errors (0.02 / sqrt(128) ~ 0.0018) of
    # 0.02; two FF steps of ff_lr 1e-4 move each D by ~1e-4 * |grad| (the FF gradient norm over both D was ~75-95: ~1e-2 per
    # element per step at most, ~2e-3 after two)
    std = float(torch.cat(list(D.values())).std())
    assert 0.014 < std < 0.026, std
    # from a trained model, d_init = "normal" is refused
    bad = _run_toml(tmp_path / "bad.toml", tok, shard_dir, tmp_path / "bad", ff, steps=2)
    r = CliRunner().invoke(app, ["train", "--config", str(bad)])
    assert r.exit_code == 1 and "from-scratch" in " ".join(r.output.split())


def test_d_init_normal_starts_grown_layers_D_at_zero(tmp_path, shards):
    tok, shard_dir = shards
    # ff_lr = 0: FF steps leave D where it is, so the checkpoint shows the initial values
    ff = ("[ff]\nff_lr = 0.0\nbp_cadence_steps = 8\nd_init = \"normal\"\n"
          "[grow]\nat_step = 1\ntarget_layers = 3\nplacement = \"insert:1\"\n")
    cfg = _run_toml(tmp_path / "run.toml", tok, shard_dir, tmp_path / "run", ff, steps=2, scratch=True)
    r = CliRunner().invoke(app, ["train", "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    s1 = load_file(str(tmp_path / "run" / "ckpt-000002" / "model" / "model.safetensors"))
    D = [s1[f"backbone.layers.{i}.mixer.D"] for i in range(3)]
    assert torch.equal(D[1], torch.zeros_like(D[1]))  # the grown layer (slot 1)
    assert all(0 < float(d.abs().max()) < 0.1 for d in (D[0], D[2]))  # the old layers keep their N(0, 0.02)


@pytest.mark.slow
def test_ff_sigkill_then_resume_is_exact(tmp_path, shards):
    tok, shard_dir = shards
    ref = _run_toml(tmp_path / "ref.toml", tok, shard_dir, tmp_path / "ref", FF)
    cfg = _run_toml(tmp_path / "run.toml", tok, shard_dir, tmp_path / "run", FF)
    ref_curve = killed_then_resumed_matches(ref, cfg)  # killed after step 5; the newest checkpoint is 4
    assert any(dict(r).get("ff_loss", 0) > 0 for r in ref_curve)  # the FF rule was engaged in what resumed


def test_ff_refuses_a_model_without_mamba_layers(tmp_path, shards):
    tok, shard_dir = shards
    cfg = tmp_path / "q.toml"
    cfg.write_text(f"""[model]
family = "qwen3"
task = "causal-lm"
tokenizer = "{tok}"
config = {{ vocab_size = 300, hidden_size = 16, intermediate_size = 32, num_hidden_layers = 1, num_attention_heads = 2, num_key_value_heads = 1, head_dim = 8 }}
[data]
train = "{shard_dir}"
max_length = 16
[train]
out_dir = "{tmp_path / 'q'}"
steps = 2
{FF}""")
    r = CliRunner().invoke(app, ["train", "--config", str(cfg)])
    assert r.exit_code == 1 and "[ff] updates the skip vectors D of Mamba layers" in " ".join(r.output.split())
