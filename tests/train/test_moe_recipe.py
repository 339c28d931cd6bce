"""The [moe] extension: the TOML switch for aux-loss-free balancing (expert-load keys in metrics.jsonl), the
sequence-wise balance loss (against a hand computation, and evening out a skewed router), the depth-1 MTP
loss (against a hand-built reference, trained from scratch and written back under its HF names), the
indexer frozen by default and trained on its KL loss under "kl", and the config errors by message."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.nn import functional as F

from kiln.errors import ConfigError
from kiln.interop.tiny import TINY
from kiln.models.auto import AutoConfig, AutoModelForCausalLM, from_config
from kiln.models.common.dsa import Indexer
from kiln.models.common.moe_routing import GroupLimitedRouter
from kiln.train.config import load_run_config
from kiln.train.metrics import read_metrics
from kiln.train.moe_balance import segment_ids, sequence_aux_loss
from kiln.train.recipes.moe import EXTENSION
from kiln.train.run import build_trainer

VOCAB = 99


@pytest.fixture(scope="module")
def ids_file(tmp_path_factory) -> Path:
    """Raw token ids with a little structure (a repeating walk), so a few steps of training show."""
    rng = np.random.default_rng(0)
    walk = (np.cumsum(rng.integers(1, 4, 6000)) % (VOCAB - 2) + 2).astype(np.int32)
    path = tmp_path_factory.mktemp("moe-ids") / "ids.npy"
    np.save(path, walk)
    return path


def _toml(tmp_path: Path, ids: Path, family: str, moe: str, steps: int = 3, lr: float = 1e-3, **config) -> Path:
    cfg = {**TINY[family], **config}
    lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in cfg.items() if v is not None and not isinstance(v, dict))
    tables = "\n".join(f"[model.config.{k}]\n" + "\n".join(f"{a} = {json.dumps(b)}" for a, b in v.items())
                       for k, v in cfg.items() if isinstance(v, dict))
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "run.toml"
    path.write_text(f"""[model]
family = "{family}"
task = "causal-lm"
[model.config]
{lines}
{tables}
[data]
train = "{ids}"
max_length = 16
[train]
out_dir = "{tmp_path / 'run'}"
steps = {steps}
batch_size = 4
lr = {lr}
schedule = "constant"
device = "cpu"
progress = false
save_every = {steps}
[moe]
{moe}
""")
    return path


def _fit(path: Path):
    return build_trainer(load_run_config(path)).fit()


def _metrics(trainer) -> list[dict]:
    return [r for r in read_metrics(trainer.out_dir / "metrics.jsonl") if "loss" in r]


# ---- aux-loss-free balancing from the TOML switch ---------------------------------------------------
def test_toml_switch_turns_aux_free_balancing_on(tmp_path, ids_file):
    t = _fit(_toml(tmp_path, ids_file, "deepseek_v3", 'balance = "aux_free"\nbias_update_speed = 0.01'))
    rows = _metrics(t)
    assert len(rows) == 3 and all("moe_imbalance" in r and "moe_max_load.model.layers.1" in r
                                  and "moe_mean_load.model.layers.1" in r for r in rows)
    assert rows[0]["moe_mean_load.model.layers.1"] == 4 * 16 * 3 / 8  # tokens x top-3 over 8 experts
    bias = load_file(str(t.out_dir / "ckpt-000003" / "model" / "model.safetensors"))[
        "model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().sum() > 0  # moved; "none" below leaves it and still measures
    t2 = _fit(_toml(tmp_path / "none", ids_file, "deepseek_v3", 'balance = "none"'))
    assert "moe_imbalance" in _metrics(t2)[-1] and "moe_aux_loss" not in _metrics(t2)[-1]
    assert not next(m for m in t2.model.modules() if isinstance(m, GroupLimitedRouter)).e_score_correction_bias.any()


# ---- the sequence-wise balance loss -------------------------------------------------------------------
def test_sequence_aux_loss_matches_a_hand_computation():
    g = torch.Generator().manual_seed(0)
    E, k = 4, 2
    logits = torch.randn(7, E, generator=g)
    index = torch.tensor([[0, 1], [0, 2], [1, 0], [3, 0], [2, 3], [0, 1], [1, 2]])
    segments = torch.tensor([0, 0, 0, 5, 5, -1, 5])  # two sequences; one padding token left out
    expected = 0.0
    for rows in ([0, 1, 2], [3, 4, 6]):
        T = len(rows)
        s = torch.sigmoid(logits[rows])
        s = s / s.sum(-1, keepdim=True)
        for i in range(E):
            f = E / (k * T) * sum(int(i in index[r].tolist()) for r in rows)
            expected += f * float(s[:, i].mean())
    got = sequence_aux_loss(logits, index, k, segments)
    assert abs(float(got) - expected / 2) < 1e-6
    # perfectly even load and affinities score 1
    even = sequence_aux_loss(torch.zeros(4, E), torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]]), k, torch.zeros(4).long())
    assert abs(float(even) - 1.0) < 1e-6


def test_segment_ids_per_packed_sample_else_per_row():
    ids = torch.zeros(2, 5, dtype=torch.long)
    assert segment_ids(ids).tolist() == [0] * 5 + [5] * 5
    packed = segment_ids(ids, torch.tensor([[0, 1, 2, 0, 1], [0, 1, 0, 1, 2]]))
    assert packed.tolist() == [0, 0, 0, 1, 1, 5, 5, 6, 6, 6]
    padded = segment_ids(ids, attention_mask=torch.tensor([[1, 1, 1, 0, 0], [1] * 5]))
    assert padded.tolist() == [0, 0, 0, -1, -1] + [5] * 5


def test_sequence_aux_loss_evens_out_a_skewed_router():
    torch.manual_seed(0)
    router = GroupLimitedRouter(16, 8, 2, 1, 1, True, 1.0)
    with torch.no_grad():
        router.weight.normal_(0, 0.1)
        router.weight[:2] += 0.5  # experts 0 and 1 favoured by every token with a positive mean input
    x = torch.randn(256, 16) + 1.0

    def step_imbalance(train: bool) -> float:
        logits, _, index = router(x)
        load = torch.bincount(index.reshape(-1), minlength=8).float()
        if train:
            loss = sequence_aux_loss(logits, index, 2, torch.arange(256) // 64)
            loss.backward()
            with torch.no_grad():
                router.weight -= 10.0 * router.weight.grad
                router.weight.grad = None
        return float(load.max() / load.mean())

    start = step_imbalance(False)
    for _ in range(60):
        step_imbalance(True)
    assert start > 3.0 and step_imbalance(False) < 0.6 * start


def test_toml_seq_aux_joins_the_loss_and_is_logged_apart(tmp_path, ids_file):
    path = _toml(tmp_path, ids_file, "deepseek_v3", 'balance = "seq_aux"\nseq_aux_alpha = 0.01')
    path.write_text(path.read_text().replace("batch_size = 4", "batch_size = 2\ngrad_accum = 2"))
    t = _fit(path)
    last = _metrics(t)[-1]
    assert 0.005 < last["moe_aux_loss"] < 0.05  # alpha x (about 1 per layer: one MoE layer)
    assert abs(last["loss"] - (last["lm_loss"] + last["moe_aux_loss"])) < 1e-5
    assert not next(m for m in t.model.modules() if isinstance(m, GroupLimitedRouter)).e_score_correction_bias.any()


# ---- multi-token prediction -------------------------------------------------------------------------
def _with_mtp(src: Path, dst: Path) -> Path:
    """A copy of `src` with a DeepSeek-style MTP layer `model.layers.{n}` (a copy of the last layer, random
    enorm/hnorm/eh_proj/shared_head norm, and the checkpoint's copies of the embedding and head)."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = load_file(str(dst / "model.safetensors"))
    n = json.loads((dst / "config.json").read_text())["num_hidden_layers"]
    g = torch.Generator().manual_seed(3)
    mtp = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): v + 0.01 * torch.randn(v.shape, generator=g)
           for k, v in weights.items() if k.startswith(f"model.layers.{n - 1}.")}
    C = weights["model.norm.weight"].shape[0]
    mtp.update({f"model.layers.{n}.enorm.weight": 1 + 0.1 * torch.randn(C, generator=g),
                f"model.layers.{n}.hnorm.weight": 1 + 0.1 * torch.randn(C, generator=g),
                f"model.layers.{n}.eh_proj.weight": 0.1 * torch.randn(C, 2 * C, generator=g),
                f"model.layers.{n}.shared_head.norm.weight": 1 + 0.1 * torch.randn(C, generator=g),
                f"model.layers.{n}.shared_head.head.weight": weights["lm_head.weight"].clone(),
                f"model.layers.{n}.embed_tokens.weight": weights["model.embed_tokens.weight"].clone()})
    save_file({**weights, **mtp}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("model_type", ["deepseek_v3", "deepseek_v32"])
def test_mtp_loss_equals_a_hand_built_reference(model_type, tiny_factory, tmp_path):
    src = _with_mtp(tiny_factory(model_type, "causal-lm"), tmp_path / "src")
    model = AutoModelForCausalLM.from_pretrained(src)
    n = model.config.num_hidden_layers
    tensors = load_file(str(src / "model.safetensors"))
    layer = model.enable_mtp()
    assert not any(k.startswith(f"layers.{n}.") for k in model.hf_extras)
    assert torch.equal(layer.eh_proj.weight, tensors[f"model.layers.{n}.eh_proj.weight"])
    model.train()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, VOCAB, (2, 10), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # a prompt: no loss there, for either head
    out = model(input_ids=ids, labels=labels)
    mtp_sum, count = model.mtp_loss_parts
    # by hand: position i sees h_i and Emb(t_{i+1}), predicts t_{i+2}; only where labels i+1 and i+2 are real.
    # The last position (no t_{i+2}) runs on a filler token, as in the model: a sparse indexer's top-k may
    # break ties between equal scores differently over a shorter row.
    eps = model.config.rms_norm_eps
    with torch.no_grad():
        h = model.model(input_ids=ids)  # (B, T, C) after the final norm
        emb = model.model.embed_tokens.weight[torch.cat([ids[:, 1:], ids[:, -1:]], 1)]  # (B, T, C)
        x = torch.cat([_rms(emb, layer.enorm.weight, eps), _rms(h, layer.hnorm.weight, eps)], -1)
        x = x @ layer.eh_proj.weight.T
        rope, mask = model.model.rope_and_mask(x, None, None)
        x, _ = layer(x, rope, mask)
        logits = _rms(x, layer.shared_head.norm.weight, eps) @ model.lm_head.weight.T  # (B, T, V)
        target = labels[:, 2:].clone()
        target[labels[:, 1:-1] == -100] = -100
        ref = F.cross_entropy(logits[:, :-2].flatten(0, 1), target.flatten(), ignore_index=-100, reduction="sum")
    assert int(count) == int((target != -100).sum()) == 2 * 8 - 2
    assert torch.allclose(mtp_sum, ref, rtol=1e-5, atol=1e-5), (float(mtp_sum), float(ref))
    # the LM loss is transformers' own still, and gradients reach the MTP layer and the shared head
    (out.loss + mtp_sum / count).backward()
    assert layer.eh_proj.weight.grad is not None and layer.enorm.weight.grad is not None
    # written back under the HF names (the shared copies from the live embedding and head)
    model.save_pretrained(tmp_path / "out")
    back = load_file(str(tmp_path / "out" / "model.safetensors"))
    for k in (f"model.layers.{n}.eh_proj.weight", f"model.layers.{n}.shared_head.norm.weight",
              f"model.layers.{n}.self_attn.kv_b_proj.weight", f"model.layers.{n}.mlp.experts.3.down_proj.weight",
              f"model.layers.{n}.embed_tokens.weight", f"model.layers.{n}.shared_head.head.weight"):
        assert torch.equal(back[k], tensors[k]), k
    assert sorted(back) == sorted(tensors)


def test_mtp_trained_from_scratch_and_exported(tmp_path, ids_file):
    t = _fit(_toml(tmp_path, ids_file, "deepseek_v3", 'balance = "aux_free"\nmtp_weight = 0.3', steps=4, lr=3e-3,
                   num_nextn_predict_layers=1))
    rows = _metrics(t)
    assert all(r["mtp_loss"] > 0 for r in rows)
    assert abs(rows[-1]["loss"] - (rows[-1]["lm_loss"] + 0.3 * rows[-1]["mtp_loss"])) < 1e-4
    assert "moe_max_load.model.layers.2" in rows[-1]  # the MTP layer's experts are balanced too
    saved = load_file(str(t.out_dir / "ckpt-000004" / "model" / "model.safetensors"))
    assert {"model.layers.2.eh_proj.weight", "model.layers.2.enorm.weight", "model.layers.2.shared_head.norm.weight",
            "model.layers.2.embed_tokens.weight"} <= set(saved)
    reloaded = AutoModelForCausalLM.from_pretrained(t.out_dir / "ckpt-000004" / "model")
    assert torch.equal(reloaded.hf_extras["layers.2.eh_proj.weight"], t.model.mtp.eh_proj.weight.detach())


@pytest.mark.slow
def test_sigkill_then_resume_with_mtp_and_aux_free_matches_uninterrupted(tmp_path, ids_file):
    """The live MTP layer and the moved biases are checkpoint state: a killed, resumed run ends bit-equal."""
    from tests.kiln_cli import kiln

    moe = 'balance = "aux_free"\nbias_update_speed = 0.01\nmtp_weight = 0.3'
    ref = _toml(tmp_path / "ref", ids_file, "deepseek_v3", moe, steps=6, lr=3e-3, num_nextn_predict_layers=1)
    cfg = _toml(tmp_path / "cut", ids_file, "deepseek_v3", moe, steps=6, lr=3e-3, num_nextn_predict_layers=1)
    for path in (ref, cfg):
        path.write_text(path.read_text().replace("save_every = 6", "save_every = 2"))
    kiln("train", "--config", str(ref))
    p = kiln("train", "--config", str(cfg), env={"KILN_FAULT": "step:5"}, check=False)
    assert p.returncode == -9, p.stderr
    kiln("train", "--config", str(cfg), "--resume", str(tmp_path / "cut" / "run"))
    a = load_file(str(tmp_path / "ref" / "run" / "ckpt-000006" / "model" / "model.safetensors"))
    b = load_file(str(tmp_path / "cut" / "run" / "ckpt-000006" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and "model.layers.2.eh_proj.weight" in a
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:5]
    curve = [(r["step"], r["loss"], r["mtp_loss"]) for r in read_metrics(tmp_path / "ref" / "run" / "metrics.jsonl")
             if "loss" in r]
    assert curve == [(r["step"], r["loss"], r["mtp_loss"])
                     for r in read_metrics(tmp_path / "cut" / "run" / "metrics.jsonl") if "loss" in r]


# ---- the sparse-attention indexer ---------------------------------------------------------------------
@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_indexer_frozen_by_default_and_outputs_unchanged_by_kl_mode(model_type):
    model = from_config(AutoConfig.for_model(model_type, **TINY[model_type]), task="causal-lm", seed=0)
    indexers = [m for m in model.modules() if isinstance(m, Indexer)]
    assert indexers and not any(p.requires_grad for ix in indexers for p in ix.parameters())
    ids = torch.randint(2, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    model.train()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert all(p.grad is None for ix in indexers for p in ix.parameters())
    for ix in indexers:
        ix.train_kl = True
        ix.requires_grad_(True)
    model.zero_grad()
    kl_out = model(input_ids=ids, labels=ids)
    assert torch.equal(kl_out.logits, out.logits)  # the same keys picked, the same outputs
    kl_out.loss.backward()  # the LM loss alone never reaches the indexer
    assert all(p.grad is None for ix in indexers for p in ix.parameters())
    assert all(ix.loss is not None and float(ix.loss.detach()) >= 0 for ix in indexers)


def test_toml_indexer_kl_trains_the_indexer(tmp_path, ids_file):
    """DeepSeek-V3.2's warm-up: every weight but the indexer frozen (train.freeze), the indexer on its KL loss."""
    path = _toml(tmp_path, ids_file, "deepseek_v32", 'balance = "none"\nindexer = "kl"', steps=10, lr=4e-2)
    frozen = ["model.embed_tokens", "model.norm", "lm_head", "model.layers.*.mlp.*", "model.layers.*layernorm*",
              "model.layers.*.self_attn.q_*", "model.layers.*.self_attn.kv_*", "model.layers.*.self_attn.o_proj*"]
    path.write_text(path.read_text().replace("[moe]", f"freeze = {json.dumps(frozen)}\n[moe]"))
    t = _fit(path)
    rows = _metrics(t)
    losses = [r["indexer_loss"] for r in rows]
    assert len(losses) == 10 and losses[-1] < 0.7 * losses[0], losses
    assert all(abs(r["loss"] - (r["lm_loss"] + r["indexer_loss"])) < 1e-5 for r in rows)
    ix = next(m for m in t.model.modules() if isinstance(m, Indexer))
    assert all(p.requires_grad for p in ix.parameters()) and not t.model.lm_head.weight.requires_grad


# ---- config errors ------------------------------------------------------------------------------------
def test_bad_configs_are_named(tmp_path, ids_file, tiny_factory):
    with pytest.raises(ConfigError, match="moe.seq_aux_alpha must be a finite number > 0, got 0"):
        load_run_config(_toml(tmp_path, ids_file, "deepseek_v3", "seq_aux_alpha = 0"))
    with pytest.raises(ConfigError, match="balance"):
        load_run_config(_toml(tmp_path, ids_file, "deepseek_v3", 'balance = "loss_free"'))
    with pytest.raises(ConfigError, match="a llama model has none"):
        build_trainer(load_run_config(_toml(tmp_path / "a", ids_file, "llama", 'balance = "aux_free"')))
    with pytest.raises(ConfigError, match="declares num_nextn_predict_layers = 0; set model.config"):
        build_trainer(load_run_config(_toml(tmp_path / "b", ids_file, "deepseek_v3", "mtp_weight = 0.1")))
    with pytest.raises(ConfigError, match="a deepseek_v3 model has none"):
        build_trainer(load_run_config(_toml(tmp_path / "c", ids_file, "deepseek_v3", 'indexer = "kl"')))
    model = AutoModelForCausalLM.from_pretrained(tiny_factory("deepseek_v3", "causal-lm"))
    cp = _toml(tmp_path / "d", ids_file, "deepseek_v3", 'balance = "seq_aux"')
    cp.write_text(cp.read_text() + "[parallel]\ncp = 2\n")
    with pytest.raises(ConfigError, match=r"balance = \"seq_aux\" with parallel.cp = 2: the sequence-wise"):
        EXTENSION.on_model(load_run_config(cp), model)  # each cp rank would balance its chunks alone
    with pytest.raises(ConfigError, match=r"ckpt: the checkpoint has no multi-token-prediction tensors \(no "
                                          r"model.layers.2.\* beside its 2 layers\)"):
        model.enable_mtp("ckpt")
