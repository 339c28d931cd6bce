"""The Trainer on CUDA: a fine-tune on the GPU follows the same run on the CPU (fp32 within accumulation-order
rounding, bf16 autocast within bf16's), and FP8 training through `torch._scaled_mm` tracks bf16 as the CPU
emulation does. Skipped where torch sees no CUDA device (marked gpu: `pytest -m gpu` selects them)."""

from __future__ import annotations

import pytest
import torch

from kiln.models.common.fp8_train import scaled_mm_works
from kiln.train.config import load_run_config
from kiln.train.run import build_trainer
from tests.parallel.sft_runs import losses
from tests.train.test_fp8_train import fp8_tracks_bf16
from tests.train.train_helpers import make_model_dir, make_rows, write_jsonl, write_toml

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("precision, rtol", [("fp32", 1e-3), ("bf16", 5e-2)])
def test_fine_tune_on_cuda_follows_the_cpu_run(tmp_path, precision, rtol):
    """Six AdamW steps of a tiny BERT classifier, dropout off. fp32: per-op relative differences of ~1e-6
    (another summation order) grow over six steps to well under 1e-4, so 1e-3 has 10x headroom; bf16 autocast
    on the GPU against fp32 on the CPU: bf16 keeps 8 bits (relative 4e-3 per rounding), 5e-2 on the loss."""
    model = make_model_dir(tmp_path / "model", dropout=0.0)
    train = write_jsonl(tmp_path / "train.jsonl", make_rows(48, seed=0))
    runs = {}
    for device, prec in (("cpu", "fp32"), ("cuda", precision)):
        cfg = write_toml(tmp_path / f"{device}.toml", model, train, None, tmp_path / device, steps=6,
                         save_every=0, eval_every=0, device=device, precision=prec)
        trainer = build_trainer(load_run_config(cfg)).fit()
        assert next(trainer.unwrapped().parameters()).device.type == device
        runs[device] = losses(tmp_path / device)
    assert len(runs["cpu"]) == len(runs["cuda"]) == 6
    torch.testing.assert_close(torch.tensor(runs["cuda"]), torch.tensor(runs["cpu"]), rtol=rtol, atol=0)


@pytest.mark.gpu
@needs_cuda
def test_fp8_training_on_cuda_uses_scaled_mm_and_tracks_bf16():
    assert scaled_mm_works("cuda"), "torch._scaled_mm refused a row-wise scaled float32 product on this GPU"
    fp8_tracks_bf16("cuda")
