"""`kiln train` LoRA SFT on the DeepSeek-V4-Flash release format (FP8 `.scale` blocks, FP4 experts; tests/models/
v4_release.py): the loss falls, the merged export is written in the release's own names and format, and
transformers' FP8 loader reads it to the same logits kiln computes from it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from kiln.cli.main import app
from kiln.train.metrics import read_metrics
from tests.models.v4_release import make_release, tiny_release_source
from tests.train.test_sft_train import CHATS

LORA = '[lora]\nr = 4\nalpha = 8\ntargets = ["q_a_proj", "q_b_proj", "kv_proj", "o_b_proj", "up_proj", "down_proj"]\n'


@pytest.mark.slow  # a full kiln train run: past the fast suite's budget
def test_lora_sft_on_the_release_learns_and_its_merged_export_loads_in_transformers(tiny_factory, tmp_path):
    import transformers

    from kiln.data.bpe import train_bpe
    from kiln.models.auto import load_pretrained

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    train_bpe([data], tmp_path / "tok", vocab_size=300, min_frequency=1)
    src = tiny_release_source(tiny_factory, vocab_size=300, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    release = make_release(src, tmp_path / "flash")
    for f in release.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            f.unlink()
    for f in (tmp_path / "tok").iterdir():
        shutil.copy(f, release / f.name)
    (tmp_path / "run.toml").write_text(
        f'[model]\npath = "{release}"\ntask = "causal-lm"\n[data]\ntrain = "{data}"\nmax_length = 32\n'
        f'[train]\nout_dir = "{tmp_path / "run"}"\nsteps = 4\nbatch_size = 4\nlr = 1e-2\nweight_decay = 0.0\n'
        'save_every = 4\nprogress = false\nlog_every = 1\nseed = 3\n' + LORA)
    r = CliRunner().invoke(app, ["train", "--config", str(tmp_path / "run.toml")])
    assert r.exit_code == 0, r.output
    losses = [m["loss"] for m in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert len(losses) == 4 and sum(losses[-2:]) < sum(losses[:2])
    ckpt = sorted((tmp_path / "run").glob("ckpt-*"))[-1]
    r = CliRunner().invoke(app, ["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "merged")])
    assert r.exit_code == 0, r.output

    merged, source = (load_file(str(d / "model.safetensors")) for d in (tmp_path / "merged", release))
    assert set(merged) == set(source)  # the release's names: no model. prefix, `.scale`, FP4 experts, mtp.*
    assert all(merged[k].dtype == v.dtype for k, v in source.items())
    changed = {k for k, v in source.items() if not torch.equal(merged[k].view(torch.uint8), v.view(torch.uint8))}
    assert "layers.0.attn.wq_a.weight" in changed and "layers.0.ffn.experts.0.w1.weight" not in changed

    q = transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=(32, 32), scale_fmt="ue8m0",
                                          expert_dtype="fp4")
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.bfloat16,
                                                                  quantization_config=q, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"]), info
    ids = torch.tensor([[1, 5, 9, 12, 40, 7, 3, 8, 11, 30, 2]])
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, load_pretrained(tmp_path / "merged")(ids).logits,
                                   rtol=0, atol=0)
