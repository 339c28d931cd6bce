"""[ff]: Forward-Forward updates of Mamba's D between backprop steps: the update against a hand
computation, the backprop cadence, surgery on backprop steps, frozen layers, and exact resume."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.train.metrics import read_metrics
from kiln.train.multiobjective import pcgrad
from kiln.train.recipes.ff import FFSection, ff_loss_and_grad, summaries, surgery

from tests.kiln_cli import kiln
from tests.train.test_mamba_hpn_toml import shards  # noqa: F401  (the module-scoped fixture: tokenizer + token shards)


def _by_hand(u: torch.Tensor, D: torch.Tensor, eps: float) -> tuple[float, list[float]]:
    """The goodness contrast and its gradient, written out element by element in float64."""
    B, T, I = u.shape
    u, D = u.double().tolist(), D.double().tolist()
    pos = [sum(u[b][t][d] for b in range(B) for t in range(T)) / (B * T) for d in range(I)]
    neg = [sum((u[b][t - 1][d] if t else 0.0) * (-1) ** (t + d) for b in range(B) for t in range(T)) / (B * T)
           for d in range(I)]

    def std(h):  # unbiased, as torch.std
        m = sum(h) / len(h)
        return math.sqrt(sum((x - m) ** 2 for x in h) / (len(h) - 1))

    norm = math.sqrt(sum(x * x for x in D))
    sp, sn = std(pos) + eps, std(neg) + eps
    g = [sum(pos[d] / sp * D[d] for d in range(I)) / (norm + eps), sum(neg[d] / sn * D[d] for d in range(I)) / (norm + eps)]
    margin = 1 - (g[0] - g[1])
    if margin <= 0:
        return 0.0, [0.0] * I
    # d/dD_k of <v, D>/|D| = v_k/|D| - <v, D> D_k / |D|^3 (eps only in the denominators, negligible here)
    v = [pos[d] / sp - neg[d] / sn for d in range(I)]
    vd = sum(v[d] * D[d] for d in range(I))
    return margin, [-(v[k] / (norm + eps) - vd * D[k] / ((norm + eps) ** 2 * norm)) for k in range(I)]


def test_ff_update_matches_a_hand_computation():
    g = torch.Generator().manual_seed(0)
    u, D = torch.randn(2, 5, 6, generator=g), torch.randn(6, generator=g)
    pos, neg = summaries(u)
    loss, grad = ff_loss_and_grad(D, pos / 10, neg / 10, 1e-8)
    want_loss, want_grad = _by_hand(u, D, 1e-8)
    assert want_loss > 0  # the hinge is active, so the gradient is not trivially zero
    assert loss == pytest.approx(want_loss, rel=1e-5)
    assert torch.allclose(grad.double(), torch.tensor(want_grad, dtype=torch.float64), rtol=1e-4, atol=1e-6)


def test_surgery_methods_on_conflicting_gradients():
    cfg = FFSection()
    g_bp, g_ff = torch.tensor([1.0, 0.0, 0.5]), torch.tensor([-1.0, 1.0, 0.0])  # dot < 0: they conflict
    assert torch.equal(surgery(g_bp, g_ff, "sum", cfg, 3), g_bp + g_ff)
    want = pcgrad(torch.stack([g_bp, g_ff]), torch.Generator().manual_seed(3))
    assert torch.equal(surgery(g_bp, g_ff, "pcgrad", cfg, 3), want)
    combined = surgery(g_bp, g_ff, "pcgrad", cfg, 3)
    assert not torch.equal(combined, g_bp + g_ff)  # the projection changed something
    n = surgery(g_bp, g_ff, "gradnorm", cfg, 0)
    assert torch.isfinite(n).all() and not torch.equal(n, g_bp + g_ff)


SIZES = dict(vocab_size=300, hidden_size=16, state_size=4, conv_kernel=4, num_hidden_layers=2)


def _model_dir(path: Path, tok: Path) -> Path:
    """A tiny Mamba whose D start at -1: the goodness contrast starts on the wrong side of its margin, so
    the FF hinge is active and D must move (with HF's D = 1 the margin already holds on this data)."""
    from kiln.hub import Tokenizer
    from kiln.models.auto import AutoConfig, from_config

    if not path.exists():
        model = from_config(AutoConfig.for_model("mamba", **SIZES), task="causal-lm", seed=0)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mixer.D.fill_(-1.0)
        model.tokenizer = Tokenizer.from_dir(tok)
        model.save_pretrained(path)
    return path


def _run_toml(path: Path, tok: Path, shard_dir: Path, out_dir: Path, ff: str = "", steps: int = 8,
              freeze: str = "[]") -> Path:
    model = _model_dir(path.parent / "mamba-d-negative", tok)
    path.write_text(f"""[model]
path = "{model}"
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
surgery = "pcgrad"
"""


def _D(ckpt: Path) -> dict[str, torch.Tensor]:
    return {k: v for k, v in load_file(str(ckpt / "model" / "model.safetensors")).items() if k.endswith(".D")}


def test_ff_run_backprops_every_n_steps_and_moves_only_D_between(tmp_path, shards):  # noqa: F811
    tok, shard_dir = shards
    cfg = _run_toml(tmp_path / "run.toml", tok, shard_dir, tmp_path / "run", FF, steps=6, freeze='["layers:0"]')
    r = CliRunner().invoke(app, ["train", "--config", str(cfg)])
    assert r.exit_code == 0, r.output
    rows = [x for x in read_metrics(tmp_path / "run" / "metrics.jsonl") if "step" in x and "loss" in x]
    assert [x["step"] for x in rows] == [1, 2, 3, 4, 5, 6]
    assert [("ff_loss" in x, "conflict_layers" in x) for x in rows] == [(True, False), (True, False), (False, True)] * 2
    assert rows[0]["ff_loss"] > 0  # the hinge is active from the start (D = -1)
    assert all(0 <= x["conflict_layers"] <= 1 for x in rows if "conflict_layers" in x)  # one trainable layer
    # steps 1-2 are FF steps: between ckpt-2 and the initial weights only the trainable D moved
    s2 = load_file(str(tmp_path / "run" / "ckpt-000002" / "model" / "model.safetensors"))
    s4 = load_file(str(tmp_path / "run" / "ckpt-000004" / "model" / "model.safetensors"))
    init = load_file(str(tmp_path / "mamba-d-negative" / "model.safetensors"))
    moved = {k for k in s2 if not torch.equal(s2[k], init[k])}
    assert moved == {"backbone.layers.1.mixer.D"}
    # step 3 backprops: everything trainable moves; layer 0 (frozen) never does, its D included
    assert not torch.equal(s4["backbone.layers.1.mixer.in_proj.weight"], s2["backbone.layers.1.mixer.in_proj.weight"])
    assert all(torch.equal(s4[k], init[k]) for k in init if k.startswith("backbone.layers.0."))


@pytest.mark.slow
def test_ff_sigkill_then_resume_is_exact(tmp_path, shards):  # noqa: F811
    tok, shard_dir = shards
    ref = _run_toml(tmp_path / "ref.toml", tok, shard_dir, tmp_path / "ref", FF)
    kiln("train", "--config", str(ref))
    cfg = _run_toml(tmp_path / "run.toml", tok, shard_dir, tmp_path / "run", FF)
    p = kiln("train", "--config", str(cfg), env={"KILN_FAULT": "step:5"}, check=False)  # newest checkpoint: 4
    assert p.returncode == -9, p.stderr
    kiln("train", "--config", str(cfg), "--resume", str(tmp_path / "run"))
    for step in (6, 8):
        a = load_file(str(tmp_path / "ref" / f"ckpt-{step:06d}" / "model" / "model.safetensors"))
        b = load_file(str(tmp_path / "run" / f"ckpt-{step:06d}" / "model" / "model.safetensors"))
        assert all(torch.equal(a[k], b[k]) for k in a), f"weights differ at step {step}"

    def curve(run):
        return [tuple(sorted((k, v) for k, v in r.items() if not k.endswith("_per_s")))
                for r in read_metrics(run / "metrics.jsonl")]
    assert curve(tmp_path / "run") == curve(tmp_path / "ref")


def test_ff_refuses_a_model_without_mamba_layers(tmp_path, shards):  # noqa: F811
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
