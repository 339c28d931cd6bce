"""`kiln export --checkpoint` of a sharded LoRA run (FSDP, pp) writes what the plain LoRA export writes:
the adapters merged into their base weights. The same tiny qwen3 LoRA SFT run on one process, on 2 gloo
processes with fsdp = true and with pp = 2: every export's logits in transformers equal the one-process
export's within fp32 rounding, and the merged q_proj weights are not the frozen base (the adapters were
not dropped). A sharded checkpoint with tensors the built model has no place for is refused by name.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from kiln.errors import KilnError
from kiln.hub import load_weights
from kiln.interop.export import export_model
from kiln.parallel.checkpoint import export_sharded, is_sharded
from kiln.train.config import load_run_config
from kiln.train.run import build_trainer
from tests.kiln_cli import kiln_cli
from tests.parallel.sft_runs import make_data, write_toml
from tests.spawn import spawn

STEPS = 2
LORA = '[lora]\nr = 4\nalpha = 8\ntargets = ["q_proj", "v_proj", "down_proj"]\n'
RUNS = {"fsdp": ({"fsdp": True}, 2), "pp": ({"pp": 2, "microbatches": 2}, 4)}  # parallel, per-process batch
Q = "model.layers.1.self_attn.q_proj.weight"


def _toml(d: Path, name: str, parallel: dict, batch_size: int) -> Path:
    path = write_toml(d, name, batch_size, parallel, steps=STEPS, save_every=STEPS)
    path.write_text(path.read_text() + LORA)
    return path


def _train_sharded(rank: int, world: int, d: str) -> None:
    for name in RUNS:
        build_trainer(load_run_config(Path(d) / f"{name}.toml")).fit()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    d = make_data(tmp_path_factory.mktemp("lora-export"))
    build_trainer(load_run_config(_toml(d, "one", {}, 4))).fit()
    for name, (parallel, batch_size) in RUNS.items():  # written here: both ranks read them
        _toml(d, name, parallel, batch_size)
    spawn(_train_sharded, 2, (str(d),))
    return d


def _logits(model_dir: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(model_dir).eval()(ids).logits


@pytest.mark.slow
def test_sharded_lora_export_merges_the_adapters_as_the_plain_export_does(runs, tmp_path):
    end = f"ckpt-{STEPS:06d}"
    plain = export_model(runs / "one" / end / "model", tmp_path / "one")  # what `kiln export --checkpoint` runs
    want = load_weights(plain)
    base = load_weights(runs / "one" / end / "model")  # the frozen base, the same in every run (seed)
    assert not torch.equal(want[Q], base[Q])  # the adapters moved the merged weight
    assert not any(".lora_" in k for k in want) and not (plain / "adapter_config.json").exists()
    ids = torch.arange(3, 35).view(2, 16)
    ref = _logits(plain, ids)
    for name in RUNS:
        ckpt = runs / name / end
        assert is_sharded(ckpt)
        out = tmp_path / name
        p = kiln_cli("export", "--checkpoint", str(ckpt), "--out", str(out))
        assert p.returncode == 0, p.stderr[-3000:]
        got = load_weights(out)
        assert got.keys() == want.keys() and not (out / "adapter_config.json").exists()
        assert not torch.equal(got[Q], base[Q]), f"{name}: the adapters were dropped"
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} {k}: {m}")
        torch.testing.assert_close(_logits(out, ids), ref, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_what_the_shards_hold_is_placed_or_refused_by_name(runs, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(runs / "fsdp" / f"ckpt-{STEPS:06d}", ckpt)
    want = load_weights(export_sharded(ckpt, tmp_path / "want"))
    model = ckpt / "model"

    def edit(name: str, **changes) -> None:
        (model / name).write_text(json.dumps({**json.loads((model / name).read_text()), **changes}))

    (model / "lora.json").unlink()  # written before lora.json existed: the [lora] table of trainer.json's run config
    got = load_weights(export_sharded(ckpt, tmp_path / "from-run-config"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    trainer = json.loads((ckpt / "trainer.json").read_text())
    (ckpt / "trainer.json").write_text(json.dumps({**trainer, "run_config": {**trainer["run_config"], "lora": None}}))
    with pytest.raises(KilnError, match=r"shards hold LoRA adapters \(model\.layers\.0\.mlp\.down_proj\.lora_A\.weight "
                                        r"and 11 more\) but neither model/lora\.json nor trainer\.json"):
        export_sharded(ckpt, tmp_path / "out")
    (ckpt / "trainer.json").write_text(json.dumps(trainer))
    edit("config.json", num_hidden_layers=1)  # layer 1's base weights and adapters have nowhere to go
    with pytest.raises(KilnError, match=r"no place for: model\.layers\.1\.input_layernorm\.weight, "
                                        r"model\.layers\.1\.mlp\.down_proj\.lora_A\.weight, .* and \d+ more"):
        export_sharded(ckpt, tmp_path / "out")
    edit("config.json", num_hidden_layers=2, intermediate_size=48)
    with pytest.raises(KilnError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight has shape \(64, 32\) in the "
                                        r"shards, the model built from model/config\.json expects \(48, 32\)"):
        export_sharded(ckpt, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["stored", "bf16"])
def test_streaming_export_writes_the_whole_exports_bytes_one_file_at_a_time(runs, tmp_path, dtype):
    ckpt = runs / "fsdp" / f"ckpt-{STEPS:06d}"
    whole = export_sharded(ckpt, tmp_path / "whole", max_shard_bytes=10_000, dtype=dtype, stream=False)
    stats: dict = {}
    streamed = export_sharded(ckpt, tmp_path / "streamed", max_shard_bytes=10_000, dtype=dtype, stats=stats)
    files = sorted(p.name for p in whole.iterdir())
    assert files == sorted(p.name for p in streamed.iterdir()) and len(stats and files) > 4, files
    for name in files:  # weights, index, config and tokenizer: the same bytes
        assert (whole / name).read_bytes() == (streamed / name).read_bytes(), name
    # at most one output file's modules in memory at a time: a few files' worth, far from the whole model
    assert stats["files"] > 4 and stats["peak_bytes"] < stats["model_bytes"] / 2, stats
