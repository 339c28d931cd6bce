"""Multi-token prediction for Qwen3.5/3.6-MoE (image-text and text-only) and DeepSeek-V4 (kiln.models.mtp.TrainsMtp): the MTP loss equals
a hand-built forward of each family's MTP module (fp32, 1e-6) over every parameter drawn at random, gradients reach
every MTP parameter, and a live module is written back under the release's names (`mtp.*`), read back equal.
transformers runs no MTP, so the references are written here from each family's MTP formula; the decoder layer
inside reuses the family's own layer class (already equal to transformers as a main layer)."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from kiln.models.auto import load_pretrained
from kiln.models.common.decoder import causal_mask
from kiln.models.deepseek_v4 import V4DecoderLayer

TOL = 1e-6  # fp32: a few hundred roundings of order 6e-8 between two orderings of the same sums


def _randomize(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g) + (1.0 if name.endswith("norm.weight") else 0.0))


def _ce_t2(logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Position i predicts token i + 2 (every target real): (summed cross entropy, count)."""
    T = ids.shape[1]
    lp = F.log_softmax(logits[:, : T - 2].double(), dim=-1)
    return -lp.gather(-1, ids[:, 2:, None]).sum(), ids.shape[0] * (T - 2)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return h * (1.0 + w.float()) if zero_centred else w.float() * h


def _check(model, ids, reference, control) -> None:
    model.train()
    out = model(input_ids=ids, labels=ids)
    total, count = model.mtp_loss_parts
    want, n = reference
    assert int(count) == n
    assert abs(float(total.detach()) - float(want)) <= TOL * n, (float(total.detach()), float(want))
    assert abs(float(total.detach()) - float(control[0])) > 100 * TOL * n  # a wrong formula is told apart
    (total / count).backward()
    params = dict(model.mtp_module.named_parameters())
    dead = [k for k, p in params.items() if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    assert not dead, dead
    assert out.loss is not None and model.model.embed_tokens.weight.grad is not None  # the shared embedding too


@pytest.mark.parametrize("model_type", ["qwen3_5_moe", "qwen3_5_moe_text"])  # image-text release, text-only
def test_qwen3_5_moe_mtp_equals_the_hand_built_forward(tiny_factory, tmp_path, model_type):
    model = load_pretrained(tiny_factory(model_type, "causal-lm"), dtype=torch.float32)
    mtp = model.enable_mtp("test", fresh=True)
    _randomize(mtp, 1)
    ids = torch.randint(5, 90, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model.eval()
        h = model.model(input_ids=ids)  # the main model's final-normed states
        nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
        e = model.model.embed_tokens(nxt)
        eps = model.config.rms_norm_eps
        x = torch.cat([_rms(e, mtp.pre_fc_norm_embedding.weight, eps, True),
                       _rms(h, mtp.pre_fc_norm_hidden.weight, eps, True)], dim=-1) @ mtp.fc.weight.T
        rope = model.model.rotary_emb(x, torch.arange(12).unsqueeze(0))
        x = mtp.layers[0](x, rope, causal_mask(2, 12, 0, None, None, x.device), None, None, None)
        logits = _rms(x, mtp.norm.weight, eps, True) @ model.lm_head.weight.T
        reference = _ce_t2(logits, ids)
        swapped = torch.cat([_rms(h, mtp.pre_fc_norm_hidden.weight, eps, True),  # hidden first: the wrong order
                             _rms(e, mtp.pre_fc_norm_embedding.weight, eps, True)], dim=-1) @ mtp.fc.weight.T
        swapped = mtp.layers[0](swapped, rope, causal_mask(2, 12, 0, None, None, x.device), None, None, None)
        control = _ce_t2(_rms(swapped, mtp.norm.weight, eps, True) @ model.lm_head.weight.T, ids)
    _check(model, ids, reference, control)

    model.save_pretrained(tmp_path / "out")  # the release's names; read back, the module is the same
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.experts.0.gate_proj.weight"} <= set(saved)
    again = load_pretrained(tmp_path / "out", dtype=torch.float32)
    assert any(k.startswith("mtp.") for k in again.hf_passthrough)  # carried until enabled
    live = again.enable_mtp("test")
    for k, v in mtp.state_dict().items():
        assert torch.equal(live.state_dict()[k], v), k
    assert not any(k.startswith("mtp.") for k in again.hf_passthrough)


def test_deepseek_v4_mtp_from_the_release_equals_the_hand_built_forward(tiny_factory, tmp_path):
    from tests.models.v4_release import make_release, tiny_release_source

    release = make_release(tiny_release_source(tiny_factory), tmp_path / "flash")
    model = load_pretrained(release, dtype=torch.float32)
    mtp = model.enable_mtp("test")  # the release's mtp.0.* (FP8 / FP4 dequantized)
    _randomize(mtp, 3)
    ids = torch.randint(5, 90, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model.eval()
        dec = model.model
        dec.keep_streams = True
        dec(input_ids=ids)
        streams, ropes, mask, positions = dec.last  # (B, T, n, C) before the hyper head
        nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
        eps = model.config.rms_norm_eps
        e = _rms(dec.embed_tokens(nxt), mtp.enorm.weight, eps, False) @ mtp.e_proj.weight.T
        x = e[:, :, None] + _rms(streams, mtp.hnorm.weight, eps, False) @ mtp.h_proj.weight.T
        x = V4DecoderLayer.forward(mtp, x, ropes, mask, positions, nxt)
        logits = _rms(mtp.hc_head(x), mtp.norm.weight, eps, False) @ model.lm_head.weight.T
        reference = _ce_t2(logits, ids)
        # the main model's collapsed output in place of its streams: a different model
        flat = _rms(dec.hc_head(streams), mtp.hnorm.weight, eps, False) @ mtp.h_proj.weight.T
        wrong = (e + flat)[:, :, None].expand_as(x).contiguous()
        wrong = V4DecoderLayer.forward(mtp, wrong, ropes, mask, positions, nxt)
        control = _ce_t2(_rms(mtp.hc_head(wrong), mtp.norm.weight, eps, False) @ model.lm_head.weight.T, ids)
    _check(model, ids, reference, control)

    model.save_pretrained(tmp_path / "out")  # release names, FP8 / FP4 again for the trained (changed) block
    from safetensors.torch import load_file

    saved, source = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "out", release))
    assert set(saved) == set(source) and saved["mtp.0.e_proj.weight"].dtype == torch.float8_e4m3fn
    assert saved["mtp.0.ffn.experts.0.w1.weight"].dtype == torch.int8 and "mtp.0.hc_head_fn" in saved


def test_mtp_without_tensors_is_named(tiny_factory):
    from kiln.errors import ConfigError

    model = load_pretrained(tiny_factory("qwen3_5_moe", "causal-lm"))
    with pytest.raises(ConfigError, match=r"no multi-token-prediction tensors \(mtp\.\*\)"):
        model.enable_mtp("run.toml")
