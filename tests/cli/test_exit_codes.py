"""Exit codes a scheduler can act on, and no orphans (issue 41, class 4). The README's table is the contract: each
code of it is held here (or, named below, by the test that already holds it), and the spawned cases run a real
`kiln launch` of two ranks on a tiny from-scratch model and signal it as a scheduler, a user or the OOM killer
would: the launcher SIGKILLed leaves no process of the run behind; a rank SIGKILLed ends every rank with exit 76
and one line naming it; one SIGTERM to the launcher and one to a rank both stop with a checkpoint (75), told apart
by the launcher's line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.cli import common
from tests.cli.reliability_world import pretrain_config, raw_shards, run_cli
from tests.kiln_cli import REPO

README = (REPO / "README.md").read_text()


def test_the_readme_table_is_the_codes_kiln_uses():
    table = README[README.index("Exit codes of `kiln train`"):]
    table = table[:table.index("\n\n", table.index("| code |"))]
    rows = dict(re.findall(r"^\| (\d+(?: \+ N)?) \| (.+) \|$", table, re.M))
    assert rows.keys() == {"0", "1", "2", "3", "70", "75", "76", "128 + N"}, rows
    for name, code in (("EXIT_OK", 0), ("EXIT_USER_ERROR", 1), ("EXIT_NON_FINITE", 3), ("EXIT_INTERNAL", 70),
                       ("EXIT_STOPPED", 75), ("EXIT_PEER_LOST", 76)):
        assert getattr(common, name) == code and str(code) in rows
    assert "requeue" in rows["76"] and "lost" in rows["76"]


def test_codes_0_1_2_in_process(tmp_path):
    """0 done, 1 user error, 2 usage error (3 is held by tests/train/test_guard.py, 70 below, 75 in
    tests/train/test_preempt.py and the spawned cases here)."""
    tok = raw_shards(tmp_path / "tok", 1)
    code, out = run_cli("train", "--config", pretrain_config(tmp_path / "ok.toml", tok, tmp_path / "ok"))
    assert code == 0 and "done: step 2" in out, out
    code, out = run_cli("train", "--config", pretrain_config(tmp_path / "bad.toml", tok, tmp_path / "bad",
                                                              train={"lr": float("nan")}))
    assert code == 1 and "train.lr must be a finite number >= 0, got nan" in out, out
    code, out = run_cli("train", "--no-such-flag")
    assert code == 2 and "No such option" in out, out


def test_code_70_is_a_bug_with_its_traceback(tmp_path, monkeypatch):
    tok = raw_shards(tmp_path / "tok", 1)

    def broken(*args, **kwargs):
        raise ZeroDivisionError("a bug in kiln")

    monkeypatch.setattr("kiln.train.run.build_trainer", broken)
    code, out = run_cli("train", "--config", pretrain_config(tmp_path / "r.toml", tok, tmp_path / "out"))
    assert code == 70 and "Traceback" in out and "ZeroDivisionError: a bug in kiln" in out, out


def test_a_lost_peer_is_told_from_a_bug():
    """gloo's "Connection closed by peer" (a plain RuntimeError) and the store's errors are a lost peer only
    inside a process group; another RuntimeError stays a bug."""
    from kiln.parallel import world

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:4332")
    assert world.lost_peer(gloo) is None  # no process group here: not a peer's loss
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{Path(os.environ.get('TMPDIR', '/tmp')) / f'pg-{os.getpid()}'}",
                            rank=0, world_size=1)
    try:
        assert world.lost_peer(gloo) == "Connection closed by peer [127.0.0.1]:4332"
        assert world.lost_peer(RuntimeError("shape mismatch")) is None
        assert world.lost_peer(dist.DistNetworkError("store gone")) == "store gone"
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("value", [0, -5, float("inf"), float("nan")])
def test_collective_timeout_is_a_finite_positive_number(tmp_path, value):
    tok = raw_shards(tmp_path / "tok", 1)
    cfg = pretrain_config(tmp_path / "r.toml", tok, tmp_path / "out", parallel={"collective_timeout": value})
    code, out = run_cli("train", "--config", cfg)
    assert code == 1 and f"parallel.collective_timeout must be a finite number > 0, got {float(value)}" in out, out
    assert not (tmp_path / "out").exists()


def test_collective_timeout_reaches_the_process_group(monkeypatch):
    """init_world hands the setting to init_process_group (gloo here; nccl alike), the default without one."""
    from datetime import timedelta

    import torch

    from kiln.parallel import world
    from kiln.parallel.config import COLLECTIVE_TIMEOUT_S, ParallelSection

    seen: list[dict] = []
    for name, value in (("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(world.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(world.dist, "init_process_group", lambda **kw: seen.append(kw))
    monkeypatch.setattr(world.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(world.dist, "get_world_size", lambda: 2)
    assert world.init_world(torch.device("cpu"), 12.5) == world.World(0, 2, 0)
    world.init_world(torch.device("cpu"))
    assert seen == [{"backend": "gloo", "timeout": timedelta(seconds=12.5)},
                    {"backend": "gloo", "timeout": timedelta(seconds=COLLECTIVE_TIMEOUT_S)}]
    assert ParallelSection().collective_timeout == COLLECTIVE_TIMEOUT_S == 600


# ---- spawned: a real launch of two ranks ------------------------------------------------------------------------
def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, session) of a live process; None when it is gone (or a zombie nobody reaped)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else (fields[0], int(fields[1]), int(fields[3]))


def _run_processes(launcher: int) -> dict[int, int]:
    """{pid: rank} of torchrun (rank -1) and its ranks under `launcher`."""
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (st := _proc_stat(int(d.name))) and st[1] == launcher:
            out[int(d.name)] = -1
    for torchrun in list(out):
        for d in Path("/proc").iterdir():
            # torchrun starts each rank in a session of its own: its children, by parent
            if d.name.isdigit() and (st := _proc_stat(int(d.name))) and st[1] == torchrun:
                try:
                    env = Path(f"/proc/{d.name}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
                if rank is not None:
                    out[int(d.name)] = rank
    return out


def _gone(pids, within: float) -> list[int]:
    deadline = time.time() + within
    while time.time() < deadline:
        left = [p for p in pids if _proc_stat(p) is not None]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if _proc_stat(p) is not None]


class _Launch:
    """`kiln launch --nproc-per-node 2 -- train` of a long run, started and waited for until it trains."""

    def __init__(self, tmp_path: Path, parallel: dict | None = None):
        tok = raw_shards(tmp_path / "tok", 2, tokens=4000)
        self.out = tmp_path / "out"
        cfg = pretrain_config(tmp_path / "run.toml", tok, self.out, train={"steps": 100000, "save_every": 2},
                              parallel=parallel or {})
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        self.p = subprocess.Popen([sys.executable, "-m", "kiln.cli.main", "launch", "--nproc-per-node", "2", "--",
                                   "train", "--config", str(cfg)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env, cwd=REPO)
        deadline = time.time() + 120
        while time.time() < deadline and not list(self.out.glob("ckpt-*")):
            if self.p.poll() is not None:
                raise AssertionError(f"the launch ended early ({self.p.returncode}): {self.p.communicate()}")
            time.sleep(0.2)
        self.procs = _run_processes(self.p.pid)
        assert sorted(self.procs.values()) == [-1, 0, 1], self.procs

    def rank(self, r: int) -> int:
        return next(pid for pid, rank in self.procs.items() if rank == r)

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        try:
            out, err = self.p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            raise
        return self.p.returncode, " ".join((out + err).split())

    def kill_all(self) -> None:
        for pid in [self.p.pid, *self.procs]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def launch(tmp_path):
    runs: list[_Launch] = []

    def start(**parallel) -> _Launch:
        runs.append(_Launch(tmp_path / f"launch{len(runs)}", parallel))
        return runs[-1]
    yield start
    for r in runs:  # whatever a failed assertion left running
        r.kill_all()


TIMEOUT = 10.0  # parallel.collective_timeout of the spawned runs that lose a rank


@pytest.mark.slow
def test_launcher_sigkilled_leaves_no_process_of_the_run(launch):
    run = launch()
    os.kill(run.p.pid, signal.SIGKILL)
    run.p.wait()
    left = _gone(list(run.procs), within=30)
    assert left == [], f"still running 30 s after kiln launch was SIGKILLed: {left} of {run.procs}"


@pytest.mark.slow
def test_a_rank_sigkilled_ends_every_rank_with_76_and_one_line(launch):
    run = launch(collective_timeout=TIMEOUT)
    killed = time.monotonic()
    os.kill(run.rank(1), signal.SIGKILL)
    code, out = run.finish()
    assert time.monotonic() - killed < TIMEOUT, out  # torchrun sees the death; no collective has to time out
    assert code == common.EXIT_PEER_LOST, out
    assert out.count("kiln launch: rank 1 ended by SIGKILL; every rank of the run ended with it (exit 76: requeue "
                     "with --resume)") == 1, out
    assert "Traceback" not in out and "Connection" not in out and "SIGTERM received" not in out, out
    assert _gone(list(run.procs), within=5) == []


# torchrun's own grace between its SIGTERM to a rank and its SIGKILL (a stopped rank answers only the second)
TORCHRUN_GRACE_S = 30


@pytest.mark.slow
def test_a_hung_rank_ends_every_rank_after_the_collective_timeout_with_76(launch):
    """A rank that stops answering without dying (SIGSTOP here; a wedged driver, a swapped-out node): torchrun
    cannot see it, the peer's next collective times out after parallel.collective_timeout and that rank exits 76;
    torchrun then ends the hung one (SIGTERM, then SIGKILL after its grace)."""
    run = launch(collective_timeout=TIMEOUT)
    hung = time.monotonic()
    os.kill(run.rank(1), signal.SIGSTOP)
    code, out = run.finish(timeout=TIMEOUT + TORCHRUN_GRACE_S + 60)
    took = time.monotonic() - hung
    assert code == common.EXIT_PEER_LOST, out
    assert out.count("kiln launch: rank 0 lost a peer (") == 1 and "parallel.collective_timeout" in out, out
    assert "every rank of the run ended with it (exit 76: requeue with --resume)" in out, out
    assert "Traceback" not in out, out
    # the timeout, then torchrun's grace for the stopped rank; the margin is a loaded machine's step and exit
    assert TIMEOUT <= took < TIMEOUT + TORCHRUN_GRACE_S + 30, (took, out)
    assert _gone(list(run.procs), within=5) == []


@pytest.mark.slow
def test_one_sigterm_to_the_launcher_stops_every_rank_with_75(launch):
    run = launch()
    os.kill(run.p.pid, signal.SIGTERM)
    code, out = run.finish()
    assert code == common.EXIT_STOPPED and "SIGTERM received: stopping after the step in flight" in out, out
    assert "stopped by SIGTERM at step" in out and "sent to one of its ranks" not in out, out


@pytest.mark.slow
def test_one_sigterm_to_a_rank_is_told_apart_from_one_to_the_launcher(launch):
    run = launch()
    os.kill(run.rank(1), signal.SIGTERM)
    code, out = run.finish()
    assert code == common.EXIT_STOPPED and "stopped by SIGTERM at step" in out, out
    assert "kiln launch: the run stopped on a signal sent to one of its ranks (not to kiln launch)" in out, out
    assert "SIGTERM received" not in out
