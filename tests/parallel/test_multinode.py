"""`kiln launch` across nodes, tested as two launches on this host (--nnodes 2, one process each, static
rendezvous at a free local port): the two nodes train as one 2-process run, with the loss of a 2-process
single-node launch, and only global rank 0 writes run files. Bad node flags are refused by message.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kiln.cli.main import app
from tests.kiln_cli import kiln_cli
from tests.parallel.sft_runs import free_port, losses, make_data, popen_kiln, write_toml


@pytest.mark.slow
def test_two_nodes_train_as_one_run_and_only_rank_0_writes(tmp_path):
    d = make_data(tmp_path)
    single = write_toml(d, "single", 2, {})
    p = kiln_cli("launch", "--nproc-per-node", "2", "--", "train", "--config", str(single))
    assert p.returncode == 0, p.stderr[-3000:]

    cfg, port = write_toml(d, "nodes", 2, {}), free_port()
    # node 1 is given its own train.out_dir: if any rank > 0 wrote a run file, it would land there
    nodes = [popen_kiln("launch", "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
                        "--rdzv-endpoint", f"127.0.0.1:{port}", "--", "train", "--config", str(cfg),
                        *(["--set", f'train.out_dir="{d / "node-1"}"'] if rank else []))
             for rank in (0, 1)]
    outs = [n.communicate(timeout=600) for n in nodes]
    for n, (out, err) in zip(nodes, outs):
        assert n.returncode == 0, err[-3000:]
    assert "done: step 4" in outs[0][0] and "done: step 4" not in outs[1][0]  # node 1 holds no rank 0

    run = d / "nodes"
    assert sorted(p.name for p in run.iterdir()) == ["ckpt-000002", "ckpt-000004", "kiln.lock", "metrics.jsonl",
                                                     "run_state.json"]
    assert not (d / "node-1").exists()
    assert losses(run) == losses(d / "single")  # the same two gloo ranks: bit for bit
    assert len(losses(run)) == 4


def _launch(*flags: str):
    return CliRunner().invoke(app, ["launch", *flags, "--", "train", "--config", "run.toml"])


@pytest.mark.parametrize("flags,message", [
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:29500"],
     "--node-rank 2 is out of range for --nnodes 2: node ranks run from 0 to 1"),
    (["--nnodes", "2", "--node-rank", "0"], "--nnodes 2 needs a meeting point every node can reach: --rdzv-endpoint"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:29500"], "--nnodes 2 needs --node-rank on each node"),
    (["--node-rank", "1"], "--node-rank 1 without --nnodes"),
    (["--nnodes", "two"], "--nnodes must be a number >= 1 or MIN:MAX"),
    (["--nnodes", "3:2", "--rdzv-endpoint", "h:29500"], "--nnodes must be a number >= 1 or MIN:MAX (MIN <= MAX)"),
    (["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h"], "--rdzv-endpoint must be HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "h:99999"], "--rdzv-endpoint must be HOST:PORT"),
], ids=["rank-out-of-range", "no-endpoint", "no-node-rank", "rank-without-nnodes", "nnodes-word",
        "nnodes-min-over-max", "endpoint-no-port", "endpoint-bad-port"])
def test_bad_node_flags_are_refused_by_message(flags, message):
    r = _launch(*flags)
    assert r.exit_code == 1
    assert message in r.output
    assert "Traceback" not in r.output
