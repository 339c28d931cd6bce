"""Pipeline parallelism on gloo/CPU: every schedule at 2 and 4 stages, given stage sizes, and PP x DP 2x2
(plain and FSDP) equal one process on the same global batch within fp32 rounding (loss, every
parameter's gradient gathered from the stages, the global gradient norm), tied embeddings too (a copy on
the last stage, gradients summed with the first's); bad splits refused by message.

An 8-block tiny qwen3 (interleaved at 4 stages needs 8 virtual stages); one spawn per world size.
"""

from __future__ import annotations

import pytest
import torch

from kiln.errors import ConfigError
from kiln.parallel.apply import parallelize
from tests.parallel import pipeline_workers as workers
from tests.spawn import spawn

JOBS_2 = [("gpipe-2", {"pp": 2, "pp_schedule": "gpipe"}),
          ("1f1b-2", {"pp": 2}),
          ("interleaved-2", {"pp": 2, "pp_schedule": "interleaved"}),
          ("stages-5-3", {"pp": 2, "pp_stages": [5, 3], "microbatches": 2}),
          ("tied-2", {"pp": 2, "model": {"tie_word_embeddings": True}}),
          ("lengths-2", {"pp": 2, "lengths": (16, 12, 16)}),
          ("checkpointed-2", {"pp": 2, "activation_checkpointing": "block"}),  # blocks recomputed in the backward
          ("moe-2", {"pp": 2, "model": {"family": "qwen3_moe"}}),
          ("mla-moe-2", {"pp": 2, "pp_stages": [1, 3], "microbatches": 2, "model": {"family": "deepseek_v3"}}),
          ("bad-microbatches", {"pp": 2, "microbatches": 3})]
JOBS_4 = [("gpipe-4", {"pp": 4, "pp_schedule": "gpipe"}),
          ("1f1b-4", {"pp": 4}),
          ("interleaved-4", {"pp": 4, "pp_schedule": "interleaved"}),
          ("pp-dp-2x2", {"pp": 2, "dp": 2, "microbatches": 2}),
          ("pp-fsdp-2x2", {"pp": 2, "dp": 2, "fsdp": True, "microbatches": 2}),
          ("lengths-fsdp-2x2", {"pp": 2, "dp": 2, "fsdp": True, "microbatches": 2, "lengths": (16, 12, 16)}),
          ("tied-interleaved-4", {"pp": 4, "pp_schedule": "interleaved", "model": {"tie_word_embeddings": True}}),
          ("tied-fsdp-2x2", {"pp": 2, "dp": 2, "fsdp": True, "microbatches": 2,
                             "model": {"tie_word_embeddings": True}})]
PARITY = [j for j in JOBS_2 + JOBS_4 if not j[0].startswith("bad")]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("pipeline")
    spawn(workers.run_many, 2, (str(out), JOBS_2))
    spawn(workers.run_many, 4, (str(out), JOBS_4))
    return {p.stem: torch.load(p, weights_only=True) for p in out.glob("*.pt")}


def _reference_of(keys: dict) -> dict:
    """One process on the job's model and batches."""
    return workers.reference(lengths=keys.get("lengths", (16,)), **keys.get("model", {}))


@pytest.fixture(scope="module")
def reference() -> dict:
    return workers.reference()


@pytest.mark.slow
@pytest.mark.parametrize("name", [j[0] for j in PARITY])
def test_pipeline_equals_one_process(results, name):
    """Tied embeddings: the last stage's copy and the first stage's gradient summed give the one tensor's.
    lengths-*: three batches accumulated, one of another sequence length (a schedule of its own; FSDP's
    setup of it must not drop the gradients accumulated so far). moe / mla-moe: Qwen3-MoE and DeepSeek-V3
    (MLA, dense first layer) stages run their own backbone forward."""
    got = results[name]
    reference = _reference_of(dict(PARITY)[name])
    torch.testing.assert_close(got["loss"], reference["loss"], rtol=1e-6, atol=1e-6)
    assert set(got["grads"]) == set(reference["grads"])  # every parameter came back from some stage
    for n, want in reference["grads"].items():
        torch.testing.assert_close(got["grads"][n], want, rtol=1e-4, atol=1e-6, msg=lambda m: f"grad {n}: {m}")
    assert got["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-5)


@pytest.mark.slow
def test_pipeline_control_a_wrong_count_fails(results, reference):
    """The comparison can fail: gradients divided by one rank's share of the targets are not the mean's."""
    got = results["pp-dp-2x2"]
    n = "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(AssertionError):
        torch.testing.assert_close(got["grads"][n] * 2, reference["grads"][n], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_microbatches_must_divide_the_batch(results):
    assert "parallel.microbatches = 3 does not divide the batch of 8 rows (train.batch_size)" in \
        results["bad-microbatches"]["error"]


def test_a_stage_cannot_open_on_a_shared_indexer_layer():
    from kiln.interop.tiny import TINY
    from kiln.models.auto import AutoConfig, from_config

    cfg = AutoConfig.for_model("glm_moe_dsa", **{**TINY["glm_moe_dsa"], "num_hidden_layers": 4,
                                                 "indexer_types": ["full", "shared", "full", "shared"]})
    with pytest.raises(ConfigError, match=r"stage 1 would start at layer 1 of glm_moe_dsa, which reuses"):
        parallelize(from_config(cfg, task="causal-lm", seed=0), workers.plan(pp=2, pp_stages=[1, 3]), world_size=2)
    with pytest.raises(ConfigError, match=r"stage 1 would start at layer 3"):  # even: [2, 2] is fine, [3, 1] not
        parallelize(from_config(cfg, task="causal-lm", seed=0), workers.plan(pp=2, pp_stages=[3, 1]), world_size=2)


@pytest.mark.parametrize("keys,message", [
    ({"pp": 16}, r"parallel.pp = 16 is more than the 8 blocks of qwen3; .* pp <= 8"),
    ({"pp": 8, "pp_schedule": "interleaved"}, r"2 x parallel.pp = 16 interleaved stages is more than the 8 blocks"),
    ({"pp": 2, "pp_stages": [4, 3]}, r"parallel.pp_stages \[4, 3\] adds up to 7 blocks but qwen3 has 8"),
    ({"pp": 2, "pp_stages": [4, 4], "pp_schedule": "interleaved"}, r"pp_stages is for the gpipe and 1f1b"),
    ({"pp": 2, "tp": 2}, r"parallel.pp = 2 combines with dp \(and fsdp\) only; got tp = 2"),
])
def test_bad_splits_are_refused_by_message(keys, message):
    world = keys["pp"] * keys.get("tp", 1)
    with pytest.raises(ConfigError, match=message):
        parallelize(workers.build(), workers.plan(**keys), world_size=world)
