"""`kiln launch` across nodes, tested as two launches on this host (--nnodes 2, one process each): the two
nodes train as one 2-process run, with the loss of a 2-process single-node launch, and only global rank 0
writes run files. Bad node flags are refused by message.

The nodes meet through the c10d rendezvous at a TCP store this test serves on a port the kernel gives it and
holds until both launches end (tests.spawn.serve_store): choosing a free port, closing it and letting node 0
bind it seconds later raced with every other process on the machine. The c10d backend joins a store that is
already there (its host fails to bind it and becomes a client), numbers the nodes itself, and rank 0's agent
serves the workers' store on a kernel-given port of its own.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kiln.cli.main import app
from tests.kiln_cli import kiln_cli
from tests.parallel.sft_runs import losses, make_data, popen_kiln, write_toml
from tests.spawn import HOST, serve_store


@pytest.mark.slow
def test_two_nodes_train_as_one_run_and_only_rank_0_writes(tmp_path):
    d = make_data(tmp_path)
    single = write_toml(d, "single", 2, {})
    p = kiln_cli("launch", "--nproc-per-node", "2", "--", "train", "--config", str(single))
    assert p.returncode == 0, p.stderr[-3000:]

    cfg, store = write_toml(d, "nodes", 2, {}), serve_store()
    # each node is given its own train.out_dir: if the rank > 0 wrote a run file, it would land in its own
    out_dirs = [d / "nodes", d / "node-1"]
    try:
        nodes = [popen_kiln("launch", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                            "--rdzv-endpoint", f"{HOST}:{store.port}", "--rdzv-id", "multinode-test", "--",
                            "train", "--config", str(cfg), *(["--set", f'train.out_dir="{out_dirs[1]}"'] if i else []))
                 for i in (0, 1)]
        outs = [n.communicate(timeout=600) for n in nodes]
    finally:
        del store
    for n, (_out, err) in zip(nodes, outs):
        assert n.returncode == 0, err[-3000:]
    # c10d numbers the nodes itself: the one that printed the end of the run held global rank 0
    main = [i for i, (out, _) in enumerate(outs) if "done: step 4" in out]
    assert len(main) == 1, [out[-500:] for out, _ in outs]
    run, other = out_dirs[main[0]], out_dirs[1 - main[0]]
    assert sorted(p.name for p in run.iterdir()) == ["ckpt-000002", "ckpt-000004", "kiln.lock", "metrics.jsonl",
                                                     "run_state.json"]
    assert not other.exists()
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
