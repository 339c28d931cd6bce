"""`[parallel.cadence]` under `kiln launch ... -- train`: two gloo ranks, rank 1 slowed by KILN_SLOW_RANK.

The fast rank runs more batches per round, the rounds add up to the lockstep budget (steps x world
batches), the held-out loss stays within 10% of lockstep DDP on the same budget, and a run SIGKILLed
after a checkpoint resumes to the same losses and weights as the uninterrupted one.

The slow rank sleeps 0.5 s a batch, far more than a tiny model's batch takes: the planner's counts
then sit at their caps (anchor 1, the fast rank at anchor + max_batch_diff), the same in every run,
which is what lets two runs be compared loss for loss.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.hub import load_weights
from tests.kiln_cli import kiln_cli

CHATS = [[{"role": "user", "content": f"what is {a} plus {b}?"}, {"role": "assistant", "content": f"{a + b}."}]
         for a in range(8) for b in range(5)]
HELD_OUT = [[{"role": "user", "content": f"what is {a} plus {b}?"}, {"role": "assistant", "content": f"{a + b}."}]
            for a in range(8, 11) for b in range(5, 8)]
DENSE = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, eos_token_id=2,
             tie_word_embeddings=False)
STEPS, CAP = 12, 4
CADENCE = {"anchor": 1, "target_sync_share": 0.5, "max_staleness": CAP, "max_batch_diff": CAP - 1}
SLOW = {"KILN_SLOW_RANK": "1:0.5"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Path:
    from kiln.data.bpe import train_bpe

    d = tmp_path_factory.mktemp("cadence")
    for name, chats in (("train", CHATS), ("eval", HELD_OUT)):
        (d / f"{name}.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    train_bpe([d / "train.jsonl"], d / "tok", vocab_size=300, min_frequency=1)
    return d


def _toml(d: Path, name: str, cadence: dict | None) -> Path:
    body = (f'[model]\nfamily = "qwen3"\ntask = "causal-lm"\ntokenizer = "{d / "tok"}"\n[model.config]\n'
            + "".join(f"{k} = {json.dumps(v)}\n" for k, v in DENSE.items())
            + f'[data]\ntrain = "{d / "train.jsonl"}"\neval = "{d / "eval.jsonl"}"\nmax_length = 48\npack = true\n'
            + f'[train]\nout_dir = "{d / name}"\nsteps = {STEPS}\nbatch_size = 2\nlr = 3e-3\n'
            + "weight_decay = 0.0\nwarmup_steps = 1\nclip_grad_norm = 1.0\nsave_every = 3\nkeep_last = 10\n"
            + "progress = false\nlog_every = 1\nseed = 5\n"
            + ("[parallel.cadence]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in cadence.items())
               if cadence else ""))
    path = d / f"{name}.toml"
    path.write_text(body)
    return path


def _launch(cfg: Path, *extra: str, env: dict | None = None):
    return kiln_cli("launch", "--nproc-per-node", "2", "--", "train", "--config", str(cfg), *extra, env=env)


def _records(run: Path) -> list[dict]:
    return list(map(json.loads, (run / "metrics.jsonl").read_text().splitlines()))


@pytest.mark.slow
def test_cadence_from_toml_fast_rank_works_more_and_resumes_exactly(setup):
    p = _launch(_toml(setup, "lockstep", None))
    assert p.returncode == 0, p.stderr[-3000:]
    p = _launch(_toml(setup, "cadence", CADENCE), env=SLOW)
    assert p.returncode == 0, p.stderr[-3000:]

    rounds = [r for r in _records(setup / "cadence") if "batches" in r]
    counts = [r["batches"] for r in rounds]
    assert counts[0] == [1, 1]                                 # no timings yet: everyone runs the anchor
    assert sum(map(sum, counts)) == STEPS * 2                  # the lockstep budget, exactly
    assert sum(c[0] for c in counts) > 2 * sum(c[1] for c in counts)   # the fast rank did the work
    assert all(max(c) <= CAP for c in counts)                  # the staleness bound
    assert all(max(c) - r["anchor"] <= CAP - 1 for c, r in zip(counts, rounds))
    assert all(0.0 <= r["sync_share"] < 1.0 for r in rounds)
    assert rounds[-1]["step"] == STEPS and len(rounds) < STEPS  # fewer syncs than lockstep steps

    held_out = {run: next(r["eval_loss"] for r in _records(setup / run) if "eval_loss" in r)
                for run in ("lockstep", "cadence")}
    assert abs(held_out["cadence"] - held_out["lockstep"]) <= 0.1 * held_out["lockstep"], held_out

    # SIGKILL rank 0 after a step logged past a checkpoint; resume from that checkpoint at a sync
    steps = [r["step"] for r in rounds]
    saved = sorted(int(c.name.split("-")[1]) for c in (setup / "cadence").glob("ckpt-*"))
    kill_at = next(s for s in steps if s > saved[1] and s < STEPS)
    newest = max(s for s in saved if s < kill_at)
    cfg, run = _toml(setup, "killed", CADENCE), setup / "killed"
    p = _launch(cfg, env={**SLOW, "KILN_FAULT": f"step:{kill_at}"})
    assert p.returncode != 0
    assert (run / f"ckpt-{newest:06d}").is_dir() and not (run / f"ckpt-{STEPS:06d}").exists()
    p = _launch(cfg, "--resume", str(run), env=SLOW)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"from ckpt-{newest:06d}" in p.stdout
    again = [r for r in _records(run) if "batches" in r]
    assert [r["batches"] for r in again] == counts
    assert [r["loss"] for r in again] == [r["loss"] for r in rounds]      # bit for bit
    a, b = (load_weights(r / f"ckpt-{STEPS:06d}" / "model") for r in (setup / "cadence", run))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_cadence_refuses_what_it_cannot_run(tmp_path):
    from kiln.errors import ConfigError
    from kiln.train import Trainer
    from kiln.train.config import ParallelSection

    model = torch.nn.Linear(3, 1)
    data = [{"x": torch.ones(3), "labels": torch.zeros(1)} for _ in range(4)]
    trainer = Trainer(model, data, step=lambda m, b: ((m(b["x"]) - b["labels"]) ** 2).mean(), steps=2,
                      batch_size=2, grad_accum=2, out_dir=str(tmp_path / "r"), progress=False,
                      parallel=ParallelSection(cadence={}))
    with pytest.raises(ConfigError, match=r"parallel.cadence .*train.grad_accum must be 1, got 2"):
        trainer.fit()


def _linear_run(out: Path, cadence: dict | None, steps: int = 6, resume: Path | None = None):
    from kiln.train import Trainer
    from kiln.train.config import ParallelSection

    torch.manual_seed(0)
    data = [{"x": torch.randn(3), "labels": torch.randn(1)} for _ in range(16)]
    model = torch.nn.Linear(3, 1)
    return Trainer(model, data, step=lambda m, b: ((m(b["x"]) - b["labels"]) ** 2).mean(), steps=steps,
                   batch_size=4, lr=0.05, save_every=2, out_dir=str(out), progress=False, resume=resume,
                   parallel=ParallelSection(cadence=cadence) if cadence is not None else None).fit()


def test_lockstep_cadence_in_one_process_equals_the_plain_trainer_and_resumes(tmp_path):
    """max_batch_diff = 0 is lockstep: one batch a round, the mean gradient, one optimizer step."""
    plain = _linear_run(tmp_path / "plain", None)
    lock = _linear_run(tmp_path / "lock", {"max_batch_diff": 0})
    rounds = _records(tmp_path / "lock")
    assert [r["batches"] for r in rounds] == [[1]] * 6 and [r["step"] for r in rounds] == list(range(1, 7))
    for a, b in zip(plain.model.parameters(), lock.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close([r["loss"] for r in rounds], [r["loss"] for r in _records(tmp_path / "plain")])

    import shutil
    shutil.copytree(tmp_path / "lock", tmp_path / "again")
    for late in ("ckpt-000006", "ckpt-000004"):
        shutil.rmtree(tmp_path / "again" / late)
    again = _linear_run(tmp_path / "again", {"max_batch_diff": 0}, resume=tmp_path / "again")
    assert all(torch.equal(a, b) for a, b in zip(lock.model.parameters(), again.model.parameters()))
    assert [r["loss"] for r in _records(tmp_path / "again") if "batches" in r] == [r["loss"] for r in rounds]
