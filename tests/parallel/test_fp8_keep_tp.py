"""Tensor parallelism over an FP8 release kept FP8 (`fp8 = "keep"`, kiln.parallel.tp_fp8): each tp rank holds its
FP8 rows (column parallel) or columns (row parallel) and exactly the scale blocks of them, reads them straight
from the files, and trains to the losses of one process, LoRA too (kiln.parallel.tp_lora). (Under FSDP2 too, on
a 2-D mesh of 4 ranks: its reads are checked in test_sharded_load.py.) A split that would cut a scale block is
refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from kiln.errors import ConfigError
from kiln.models.auto import load_whole
from kiln.parallel.apply import parallelize
from kiln.parallel.checkpoint import export_sharded
from kiln.parallel.sharded_load import empty_pretrained
from kiln.parallel.tp import tensor_plan
from kiln.train.config import ParallelSection
from tests.parallel import fp8_keep_workers as fw
from tests.spawn import spawn


@pytest.fixture(scope="module")
def fp8_tp_dir(tiny_factory, tmp_path_factory):
    return fw.tp_release(tiny_factory, tmp_path_factory.mktemp("fp8-keep-tp"))


@pytest.mark.slow
def test_tp_over_linears_kept_fp8_holds_its_blocks_and_equals_one_process(fp8_tp_dir, tmp_path):
    fw.tp_steps(0, 1, str(fp8_tp_dir), str(tmp_path))
    for world in fw.TP_PLANS:
        spawn(fw.tp_runs, world, (str(fp8_tp_dir), str(tmp_path)))
    ones = {name: json.loads((tmp_path / f"tp-{name}-rank0.json").read_text()) for name in ("one", "one-lora")}
    for one in ones.values():
        assert one["losses"][-1] < one["losses"][0]  # the norms and embeddings (or the adapters) do train
    for world, plans in fw.TP_PLANS.items():
        for plan, rank in ((plan, rank) for plan in plans for rank in range(world)):
            one = ones["one-lora" if plan.endswith("-lora") else "one"]
            r = json.loads((tmp_path / f"tp-{plan}-rank{rank}.json").read_text())
            # q/k/v, gate/up by rows and o/down by columns, in each of the 2 layers (LoRA layers over some)
            assert len(r["held"]) == 2 * 7, sorted(r["held"])
            for path, h in r["held"].items():
                dim, shape = h["dim"], h["global"]
                assert path.endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")) == (dim == 0), path
                # this tp rank's half of the FP8 weight (FSDP2 halves it again over dp, as bytes at rest) ...
                stored, local = h["weight"]
                assert stored == ("torch.uint8" if "fsdp" in plan else "torch.float8_e4m3fn"), (path, h)
                assert local[1 - dim] * local[dim] * 2 * (world // 2) == shape[0] * shape[1], (path, h)
                # ... and exactly the scale blocks of its half: the grid's rows (or columns) halved, the rest whole
                grid = [-(-n // b) for n, b in zip(shape, h["block"])]
                grid[dim] //= 2
                assert h["scale"] == ["torch.float32", grid], (path, h)
            # every piece read went from the file into this rank's tensors: none bigger than the largest it holds
            # (a tensor read whole, then cut, would pass through as twice its piece)
            assert max(r["pieces"]) <= r["largest_piece"], r
            # Both sides run the same fp32 arithmetic on the same rows, but a row-parallel Linear (o_proj,
            # down_proj: 4 per forward) sums its 256 products as two partial sums of 128, added over the ranks,
            # and tp x fsdp averages 2 data ranks' losses and gradients (LoRA: A's gradient summed over the
            # ranks under column parallelism, B A x's partial sums under row parallelism): reorderings whose rounding is about
            # sqrt(n) ulps of fp32 (6e-8) relative, ~1e-6 per sum. Through 4 such sums per forward (RMS norms
            # in between keep their relative size) and 3 steps of SGD on weights moved by LR * grad, the
            # losses agree to a few 1e-6 relative: rtol 2e-5 leaves ~5x headroom (measured: ~1e-7).
            torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(one["losses"]), rtol=2e-5, atol=0)
    # the tp run's sharded checkpoint exports the release's FP8 weights and scales byte for byte
    got = load_file(str(export_sharded(tmp_path / "tp-ckpt", tmp_path / "tp-hf") / "model.safetensors"))
    release = load_file(str(fp8_tp_dir / "model.safetensors"))
    assert got.keys() == release.keys()
    stored = [k for k, v in release.items() if v.element_size() == 1 or k.endswith("_scale_inv")]
    assert len(stored) == 2 * 2 * 7 and all(
        got[k].dtype == release[k].dtype and torch.equal(got[k].view(torch.uint8), release[k].view(torch.uint8))
        for k in stored), [k for k in stored if not torch.equal(got[k].view(torch.uint8), release[k].view(torch.uint8))]
    for rank in range(2):
        # biases (none in Qwen3's split Linears): the column-parallel one split with its rows, the row-parallel one
        # added once to the sum. Sums of 32 and 64 products in fp32 in another order: a few ulps (6e-8) of each
        # tensor's largest value; bounds of 1e-5 of it (measured: 3e-7). Added twice, a bias would be off by itself.
        r = json.loads((tmp_path / f"biased-rank{rank}.json").read_text())
        assert all(d <= 1e-5 * s for d, s in zip(r["diff"], r["scale"])), r


def test_a_tp_split_that_would_cut_a_scale_block_is_refused_by_name(fp8_tp_dir):
    """tp = 4 would give each rank 64 of q_proj's 256 rows, half of a 128-row scale block: refused, naming the
    tensor, its shape and blocks, and the tp degrees that keep every block whole (1, 2), whole load or on meta."""
    for model in (load_whole(fp8_tp_dir, fp8="keep"), empty_pretrained(fp8_tp_dir, fp8="keep")):
        with pytest.raises(ConfigError, match=r"parallel.tp = 4 with model.fp8 = 'keep': qwen3's FP8 weight "
                                              r"'model.layers.0.self_attn.q_proj.weight' \(256, 256\) has \[128, 128\] "
                                              r"scale blocks, and splitting its 256 output rows \(column parallel\) "
                                              r"over 4 ranks \(64 each\) would cut a 128-wide block; tp degrees that "
                                              r"keep every FP8 weight's blocks whole: 1, 2; or set model.fp8 = "
                                              r"'dequantize'"):
            parallelize(model, ParallelSection(tp=4), world_size=4)
        assert tensor_plan(model, 2) is not None  # control: tp = 2 splits whole blocks
    # control: dequantized, the same model takes tp = 4 (every plan check passes)
    assert tensor_plan(load_whole(fp8_tp_dir, fp8="dequantize"), 4) is not None


def test_an_fp8_tensor_a_plan_splits_outside_a_linear_is_refused_by_name(fp8_tp_dir):
    """Only an FP8 Linear's weight splits with its scales; any other FP8 tensor a plan would split (here an
    embedding made FP8) is refused, naming it and what to use instead."""
    model = empty_pretrained(fp8_tp_dir, task="causal-lm", fp8="keep")
    emb = model.model.embed_tokens
    emb.weight = torch.nn.Parameter(emb.weight.to(torch.float8_e4m3fn), requires_grad=False)
    with pytest.raises(ConfigError, match=r"parallel.tp = 2 with model.fp8 = 'keep': qwen3 holds "
                                          r"'model.embed_tokens.weight' .*float8_e4m3fn.*only in column- or "
                                          r"row-parallel Linears; set model.fp8 = 'dequantize'.*fsdp.*ep"):
        tensor_plan(model, 2)
