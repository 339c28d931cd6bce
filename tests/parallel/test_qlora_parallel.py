"""QLoRA under FSDP2 and DDP: `kiln train` with `[model] quantize = "nf4"` and [lora] over 2 gloo processes (each
rank reading and quantizing its rows of the bf16 weights) has the loss curve of one process that loaded the model
whole, on the same global batch; under FSDP2 the packed 4-bit weights are sharded and
gathered as uint8 (the quant state stays whole on every rank, as FP8's scales do), and the sharded checkpoint
exports (4-bit base rebuilt from its quant state, dequantized, merged) as the one-process checkpoint does."""

from __future__ import annotations

from pathlib import Path
from unittest import mock

import pytest
import torch

from kiln.hub import load_weights
from kiln.train.config import load_run_config
from kiln.train.run import build_trainer
from tests.parallel.sft_runs import DENSE, launch, losses, make_data, run_toml

STEPS, GLOBAL_BATCH = 4, 4


def _toml(d: Path, name: str, batch_size: int, parallel: dict) -> Path:
    """run_toml's SFT run with its [model] table swapped for the bf16 directory, quantized to NF4 at load."""
    path = run_toml(d, name, parallel, train={"steps": STEPS, "batch_size": batch_size})
    rest = path.read_text().split("[data]\n", 1)[1]
    path.write_text(f'[model]\npath = "{d / "bf16"}"\ntask = "causal-lm"\nquantize = "nf4"\n[data]\n{rest}'
                    '[lora]\nr = 4\nalpha = 8\ntargets = "all-linear"\n')
    return path


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Path:
    from kiln.hub import Tokenizer
    from kiln.models.auto import AutoConfig, from_config

    d = make_data(tmp_path_factory.mktemp("qlora-parallel"))
    config = AutoConfig.for_model("qwen3", **{**DENSE, "hidden_size": 64, "head_dim": 16})
    model = from_config(config, task="causal-lm", seed=0).to(torch.bfloat16)
    model.config.extra["dtype"] = "bfloat16"
    model.tokenizer = Tokenizer.from_dir(d / "tok")
    model.save_pretrained(d / "bf16")
    # the reference: one process, the bf16 model loaded whole then quantized (the two-process runs read each rank's
    # rows and quantize them: kiln.models.loading.q4)
    with mock.patch("kiln.train.recipes.base.load_to_device", lambda *a, **k: None):
        build_trainer(load_run_config(_toml(d, "one", GLOBAL_BATCH, {}))).fit()
    return d


@pytest.mark.slow
@pytest.mark.parametrize("name,parallel", [("fsdp", {"fsdp": True}), ("ddp", {"dp": 2})])
def test_qlora_over_two_processes_equals_one(setup, name, parallel, tmp_path):
    import torch.distributed.checkpoint as dcp

    from kiln.parallel.checkpoint import export_sharded, is_sharded

    d = setup
    p = launch(_toml(d, name, GLOBAL_BATCH // 2, parallel))
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(losses(d / name)) == STEPS
    torch.testing.assert_close(torch.tensor(losses(d / name)), torch.tensor(losses(d / "one")), rtol=1e-5, atol=1e-6)

    end = f"ckpt-{STEPS:06d}"
    one = load_weights(export_sharded(d / "one" / end, tmp_path / "one") if is_sharded(d / "one" / end)
                       else _merged(d / "one" / end, tmp_path / "one"))
    if name == "fsdp":
        assert is_sharded(d / name / end)
        meta = dcp.FileSystemReader(str(d / name / end / "dcp")).read_metadata().state_dict_metadata
        packed = meta["model.model.layers.0.self_attn.q_proj.weight"]
        assert packed.properties.dtype == torch.uint8 and tuple(packed.size) == (64 * 64 // 2, 1)
        got = load_weights(export_sharded(d / name / end, tmp_path / name))
    else:
        assert load_weights(d / name / end / "model")["model.layers.0.self_attn.q_proj.weight"].dtype == torch.uint8
        got = load_weights(_merged(d / name / end, tmp_path / name))
    assert got.keys() == one.keys()
    for k in one:
        # merged bf16 weights W + round(B A s): adapters equal within fp32 rounding may flip each of the two bf16
        # roundings by one unit (2**-7 of the value at most, each)
        torch.testing.assert_close(got[k].float(), one[k].float(), rtol=2.0**-6, atol=1e-6, msg=lambda m: f"{k}: {m}")


def _merged(ckpt: Path, out: Path) -> Path:
    from kiln.interop.export import export_model
    from kiln.train.checkpoint import load_checkpoint_model

    return export_model(load_checkpoint_model(ckpt), out)
