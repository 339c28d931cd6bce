"""Context parallelism ([parallel] cp) on gloo/CPU: the load-balanced split, and cp = 2 and 4 (alone, with DP
and with FSDP over dp x cp) equal to one process on the same global batch within fp32 rounding: loss,
gradients and the AdamW-updated weights, for plain, packed and right-padded rows, and GLM-5 with its indexer trained
on the KL loss (each cp rank's loss its share of the whole rows' mean). Bad input by message.
"""

from __future__ import annotations

import pytest
import torch

from kiln.constants import IGNORE_INDEX
from kiln.errors import ConfigError, KilnError
from kiln.models.common.loss import shift_labels
from kiln.parallel.context import ContextParallel, check_model, chunk_index, gather_sequence
from tests.parallel import cp_workers, workers
from tests.spawn import spawn

JOBS_2 = [("cp-2", "qwen3", "plain", {"cp": 2}),
          ("cp-2-ring-packed", "qwen3", "packed", {"cp": 2, "cp_method": "ring"}),
          ("cp-2-llama", "llama", "plain", {"cp": 2}),
          ("cp-2-packed", "qwen3", "packed", {"cp": 2}),
          ("cp-2-padded", "qwen3", "padded", {"cp": 2}),
          ("cp-fsdp-2", "qwen3", "plain", {"cp": 2, "fsdp": True}),
          ("cp-2-compile", "qwen3", "packed", {"cp": 2, "compile": True, "compile_backend": "aot_eager"}),
          # GLM-5's indexer trained on its KL loss ([moe] indexer = "kl"): each rank's share of the whole rows'
          ("cp-2-indexer-kl", "glm_moe_dsa", "packed", {"cp": 2, "indexer_kl": True})]
JOBS_4 = [("cp-4", "qwen3", "plain", {"cp": 4}),
          ("cp-4-packed", "qwen3", "packed", {"cp": 4}),
          ("cp-dp-2x2", "qwen3", "plain", {"cp": 2, "dp": 2}),
          ("cp-dp-2x2-padded", "llama", "padded", {"cp": 2, "dp": 2}),
          ("cp-fsdp-2x2", "qwen3", "packed", {"cp": 2, "dp": 2, "fsdp": True}),
          ("cp-4-ac", "qwen3", "plain", {"cp": 4, "activation_checkpointing": "block"}),
          ("cp-4-ring", "llama", "padded", {"cp": 4, "cp_method": "ring"}),
          ("cp-dp-2x2-ring", "qwen3", "plain", {"cp": 2, "dp": 2, "cp_method": "ring"})]
JOBS = JOBS_2 + JOBS_4


def test_chunks_are_load_balanced_and_cover_the_row():
    got = [chunk_index(16, 2, r).tolist() for r in range(2)]
    assert got == [[0, 1, 2, 3, 12, 13, 14, 15], [4, 5, 6, 7, 8, 9, 10, 11]]
    parts = torch.cat([chunk_index(24, 3, r) for r in range(3)])
    assert sorted(parts.tolist()) == list(range(24))
    # causal work (keys each query sees, summed) is the same on every rank
    work = [int((chunk_index(24, 3, r) + 1).sum()) for r in range(3)]
    assert len(set(work)) == 1


def test_sequence_length_not_divisible_is_refused_by_message():
    with pytest.raises(KilnError, match=r"parallel.cp = 3 splits each sequence into 2 \* cp = 6 .*multiple of 6; "
                                        r"got a sequence of 16 tokens"):
        chunk_index(16, 3, 0)


def test_models_cp_cannot_serve_are_refused_by_message():
    from kiln.interop.tiny import TINY
    from kiln.models.auto import AutoConfig, from_config

    for family in ("mamba", "qwen3_next", "deepseek_v4"):
        model = from_config(AutoConfig.for_model(family, **TINY[family]), task="causal-lm", seed=0)
        with pytest.raises(ConfigError, match=rf"parallel.cp = 2: {family} \(\w+\) cannot be split over the sequence"):
            check_model(model, 2)
    check_model(workers.build("qwen3"), 2)  # the shared attention decoder passes, and the MLA one
    mla = from_config(AutoConfig.for_model("deepseek_v3", **TINY["deepseek_v3"]), task="causal-lm", seed=0)
    check_model(mla, 2)
    with pytest.raises(ConfigError, match=r"cp_method = 'ring': deepseek_v3 has latent \(MLA\) attention"):
        check_model(mla, 2, "ring")
    mla.config.extra["num_nextn_predict_layers"] = 1
    mla.enable_mtp("test", fresh=True)  # a live MTP layer reads the next chunk's first token: refused at the split
    with pytest.raises(KilnError, match=r"parallel.cp with a live multi-token-prediction layer"):
        ContextParallel(None, 2, 0).split(mla, (), {"input_ids": torch.ones(1, 8, dtype=torch.long)})


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("cp")
    spawn(cp_workers.run_many, 2, (str(out), JOBS_2))
    spawn(cp_workers.run_many, 4, (str(out), JOBS_4))
    return {p.stem: torch.load(p, weights_only=True) for p in out.glob("*.pt")}


@pytest.fixture(scope="module")
def references() -> dict:
    runs = {(family, kind, keys.get("indexer_kl", False)) for _, family, kind, keys in JOBS}
    return {run: cp_workers.reference(*run) for run in runs}


@pytest.mark.slow
@pytest.mark.parametrize("name,family,kind,keys", JOBS, ids=[j[0] for j in JOBS])
def test_cp_equals_one_process(results, references, name, family, kind, keys):
    assert name in results, f"rank 0 wrote no result for {name}"
    got, want = results[name], references[family, kind, keys.get("indexer_kl", False)]
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-5, atol=1e-6)
    if "indexer_loss" in want:  # the logged mean KL, which joins the loss (so the gradients below check it too)
        torch.testing.assert_close(got["indexer_loss"], want["indexer_loss"], rtol=1e-5, atol=1e-6)
    elif keys.get("dp", 1) == 1:  # .loss of labels=: the cp ranks' shares add up to the mean
        torch.testing.assert_close(got["shares"], want["loss"], rtol=1e-5, atol=1e-6)
    assert set(got["grads"]) == set(want["grads"])
    for n in want["grads"]:
        torch.testing.assert_close(got["grads"][n], want["grads"][n], rtol=1e-4, atol=1e-6, msg=lambda m: f"grad {n}: {m}")
    for n in want["weights"]:
        # AdamW's first step is lr * g / (|g| + eps): a gradient near 1e-8 turns rounding into ~1e-5 moves
        torch.testing.assert_close(got["weights"][n], want["weights"][n], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"weight {n}: {m}")
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)


@pytest.mark.slow
def test_a_wrong_split_would_be_caught(references):
    """Control: targets shifted after the split (each chunk on its own) give another loss than one process."""
    model = cp_workers.build("qwen3")
    b = cp_workers.batch("plain")
    idx = [chunk_index(16, 2, r) for r in range(2)]
    total, count = 0.0, 0
    for i in idx:
        ids = b["input_ids"][:, i]
        out = model(ids, position_ids=i[None], targets=shift_labels(ids))  # positions right, labels shifted late
        total, count = total + float(out.loss_sum.detach()), count + int(out.loss_count)
    assert abs(total / count - float(references["qwen3", "plain", False]["loss"])) > 1e-3


def test_padding_tail_is_ignored():
    """The split pads rows to a multiple of 2*cp like pad_collate: masked keys, ignored targets."""
    from kiln.parallel.context import _pad_rows

    rows = {"input_ids": torch.ones(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5, dtype=torch.long),
            "targets": torch.ones(2, 5, dtype=torch.long), "position_ids": torch.arange(5)[None]}
    out = _pad_rows(rows, 5, 4)
    assert out["input_ids"].shape == (2, 8) and out["attention_mask"][:, 5:].sum() == 0
    assert (out["targets"][:, 5:] == IGNORE_INDEX).all() and out["position_ids"][0, 5:].tolist() == [0, 1, 2]


def test_the_split_refuses_or_pads_lengths_by_what_the_batch_says():
    """Plain rows (no mask, no positions) of a length 2*cp does not divide are refused by message; padded or
    packed rows are padded to a multiple, as the loader pads them. (The split itself needs no process group.)"""
    from kiln.parallel.context import ContextParallel

    model = workers.build("qwen3")
    split = ContextParallel(None, 2, 1).split
    ids = torch.randint(1, 99, (2, 15))
    with pytest.raises(KilnError, match=r"parallel.cp = 2 .* multiple of 4; got a sequence of 15 tokens"):
        split(model, (ids,), {"labels": ids})
    _, kw = split(model, (ids,), {"attention_mask": torch.ones_like(ids), "labels": ids})
    assert kw["input_ids"].shape == (2, 8) and kw["attention_mask"] is None and "labels" not in kw
    assert kw["position_ids"][0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]  # rank 1 holds chunks 1 and 2 of 4
    # targets were shifted on the whole row: position 7 (end of chunk 1) predicts token 8 (start of chunk 2)
    assert kw["targets"][0, 3] == ids[0, 8]


def test_cp_method_is_validated_and_ring_refuses_dropout():
    from pydantic import ValidationError

    from kiln.parallel.ring import ring_attention
    from kiln.train.config import ParallelSection

    assert ParallelSection(cp=2, cp_method="ring").cp_method == "ring"
    with pytest.raises(ValidationError, match="cp_method"):
        ParallelSection(cp=2, cp_method="ulysses")
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(KilnError, match=r"cp_method = 'ring' runs attention without dropout"):
        ring_attention(q, q, q, torch.ones(1, 1, 4, 8, dtype=torch.bool), [], 1.0, 0.1, None)


def test_ring_blocks_fused_cpu_kernel_and_math_fallback_agree(monkeypatch):
    """The ring's per-block forward/backward: torch's fused CPU kernel and the fp32 math used on other devices."""
    from kiln.parallel import ring

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    mask = torch.rand(2, 1, 6, 6, generator=g) > 0.4
    mask[0, 0, 2] = False  # a row that sees none of this block's keys
    grad = torch.randn(2, 4, 6, 8, generator=g)
    fused_out, fused_lse = ring._block_forward(q, k, v, mask, 0.3)
    fused_grads = ring._block_backward(grad, q, k, v, fused_out, fused_lse, mask, 0.3)
    monkeypatch.setattr(ring, "_fused", lambda q: False)
    out, lse = ring._block_forward(q, k, v, mask, 0.3)
    assert torch.isneginf(lse[0, :, 2]).all() and torch.isneginf(fused_lse[0, :, 2]).all()
    torch.testing.assert_close(fused_out, out)
    torch.testing.assert_close(fused_lse, lse)
    for a, b in zip(fused_grads, ring._block_backward(grad, q, k, v, out, lse, mask, 0.3)):
        torch.testing.assert_close(a.float(), b)


def test_gathered_chunks_come_back_in_row_order(monkeypatch):
    """The all-gather stacks each rank's (early, late) chunk pair; gather_sequence puts the row back in order."""
    from kiln.parallel import context

    T, cp = 12, 3
    row = torch.arange(T, dtype=torch.float32)[None, None, :, None]  # (1, 1, T, 1)
    per_rank = torch.stack([row[:, :, chunk_index(T, cp, r)] for r in range(cp)])  # what the collective returns
    monkeypatch.setattr(context._GatherSequence, "apply", lambda x, group: per_rank)
    assert torch.equal(gather_sequence(per_rank[0], None), row)


def test_cp_with_tp_ep_or_pp_is_refused_by_message():
    from kiln.parallel.mesh import Degrees
    from kiln.parallel.mesh import check_model as check_degrees

    model = workers.build("qwen3")
    for other in ({"tp": 2}, {"pp": 2}):
        with pytest.raises(ConfigError, match=r"parallel.cp = 2 combines with dp and fsdp only"):
            check_degrees(Degrees(cp=2, **other), model)
    check_degrees(Degrees(cp=2, dp=2), model)
