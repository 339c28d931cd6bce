"""Preemption: SIGTERM (at a random step, or mid-checkpoint) stops `kiln train` after the step in flight with a
checkpoint, one line and exit 75, and the resumed run ends bit-identical to an uninterrupted one; a second signal
stops at once; train.max_time stops the same way; one writer per run directory (kiln.train.lock)."""

from __future__ import annotations

import hashlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from kiln.errors import KilnError
from kiln.train import lock
from kiln.train.config import TrainSection
from kiln.train.metrics import read_metrics
from kiln.train.plot import plot_run
from tests.kiln_cli import REPO
from tests.train.train_helpers import kiln, write_toml

STOPPED = 75
LINE = re.compile(r"^stopped by (SIG\w+|train\.max_time \([^)]*\)) at step (\d+); checkpoint (ckpt-\d+); "
                  r"resume with the same command and --resume$", re.MULTILINE)
STEPS = dict(steps=24, save_every=8, eval_every=8)


def _start(cfg: Path, *extra: str, env: dict | None = None) -> subprocess.Popen:
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "kiln.cli.main", *extra, "train", "--config", str(cfg)]
                            if extra[:1] == ("launch",) else
                            [sys.executable, "-m", "kiln.cli.main", "train", "--config", str(cfg), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=full_env, cwd=REPO)


def _steps_logged(run: Path) -> int:
    try:
        return sum(1 for r in read_metrics(run / "metrics.jsonl") if "loss" in r)
    except (OSError, ValueError):
        return 0


def _signal_after(p: subprocess.Popen, run: Path, steps: int, sig: int = signal.SIGTERM) -> tuple[str, str]:
    """Send `sig` once `steps` steps are logged, then wait for the process to end."""
    deadline = time.time() + 240
    while _steps_logged(run) < steps and p.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    assert p.poll() is None, "the run ended before the signal was sent"
    p.send_signal(sig)
    return p.communicate(timeout=240)


def _weights(ckpt: Path) -> dict:
    return load_file(str(ckpt / "model" / "model.safetensors"))


def _curve(run: Path) -> list[tuple]:
    return [tuple(sorted((k, v) for k, v in r.items() if not k.endswith("_per_s"))) for r in
            read_metrics(run / "metrics.jsonl")]


def _same_end(run: Path, ref: Path) -> None:
    a, b = _weights(ref / "ckpt-000024"), _weights(run / "ckpt-000024")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), "weights differ at the end"
    assert _curve(run) == _curve(ref)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, tiny_dir, data_files) -> Path:
    d = tmp_path_factory.mktemp("ref")
    kiln("train", "--config", str(write_toml(d / "ref.toml", tiny_dir, *data_files, d / "ref", **STEPS)))
    return d / "ref"


@pytest.mark.slow
@pytest.mark.parametrize("moment", ["random-step", "mid-checkpoint"])
def test_sigterm_saves_at_the_stop_step_and_resume_is_exact(tmp_path, tiny_dir, data_files, reference, moment):
    cfg = write_toml(tmp_path / "run.toml", tiny_dir, *data_files, tmp_path / "run", **STEPS)
    run = tmp_path / "run"
    if moment == "random-step":
        seed = random.randrange(10**6)
        target = random.Random(seed).randint(1, 15)
        p = _start(cfg)
        out, err = _signal_after(p, run, target)
    else:  # the signal lands while ckpt-000008 is being written (weights on disk, no manifest yet)
        seed, target = None, 8
        p = _start(cfg, env={"KILN_FAULT": "ckpt:8", "KILN_FAULT_SIGNAL": "SIGTERM"})
        out, err = p.communicate(timeout=240)
    assert p.returncode == STOPPED, f"seed {seed}: {p.returncode}\n{out}\n{err}"
    m = LINE.search(out)
    assert m and m.group(1) == "SIGTERM", f"seed {seed}:\n{out}\n{err}"
    step = int(m.group(2))
    assert target <= step < 24 and m.group(3) == f"ckpt-{step:06d}", out
    assert "SIGTERM received: stopping after the step in flight" in err
    assert (run / f"ckpt-{step:06d}" / "manifest.json").is_file() and not list(run.glob(".ckpt-*.tmp"))
    assert _steps_logged(run) == step  # nothing past the stop step was taken
    if moment == "mid-checkpoint":
        assert step == 8

    p = kiln("train", "--config", str(cfg), "--resume", str(run))
    assert f"from ckpt-{step:06d} (step {step})" in p.stdout
    _same_end(run, reference)


SECOND_SIGNAL = """
import os, signal, sys, time
from types import SimpleNamespace
from kiln.train.preempt import Stop
trainer = SimpleNamespace(args=SimpleNamespace(max_time=None), world=SimpleNamespace(main=True, rank=0, active=False))
stop = Stop(trainer).install()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)  # the handler runs at the next bytecode; the process goes on
print("after the first:", stop.agreed(), flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.2)
print("not reached", flush=True)
"""


def test_second_signal_stops_at_once():
    # The first SIGTERM is a request (the process goes on, the reason agreed); the second ends it by the signal.
    p = subprocess.run([sys.executable, "-c", SECOND_SIGNAL], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.stdout == "after the first: SIGTERM\n", (p.stdout, p.stderr)
    assert "SIGTERM received: stopping after the step in flight (send it again to stop at once)" in p.stderr
    assert p.returncode == -signal.SIGTERM


STEPS_FOREVER = 1_000_000


@pytest.mark.slow
def test_max_time_stops_and_saves(tmp_path, tiny_dir, data_files):
    # a million steps cannot finish in 25 s on any CPU (an idle 2-core machine ran 4000 of these tiny steps in
    # under 25 s); the stop must come before the limit, with the save (it stopped at step 40 after 22 s under load).
    cfg = write_toml(tmp_path / "run.toml", tiny_dir, *data_files, tmp_path / "run", steps=STEPS_FOREVER,
                     save_every=0, eval_every=0, max_time="25s")
    started = time.time()
    p = kiln("train", "--config", str(cfg), check=False)
    took = time.time() - started
    assert p.returncode == STOPPED, (p.stdout, p.stderr)
    m = LINE.search(p.stdout)
    assert m and m.group(1) == "train.max_time (25s)", p.stdout
    assert took < 25 + 5, took  # the process's end, a little after its clock's (this one started first)
    step = int(m.group(2))
    assert 0 < step < STEPS_FOREVER and (tmp_path / "run" / f"ckpt-{step:06d}" / "manifest.json").is_file()


@pytest.mark.parametrize("stop_save", [True, False])
def test_fit_stops_in_process_with_or_without_the_save(tmp_path, tiny_dir, data_files, capsys, stop_save):
    from kiln.train.config import load_run_config
    from kiln.train.run import build_trainer
    from kiln.train.trainer import Callback

    class SignalAt(Callback):  # SIGTERM to this process while step 3 is being recorded
        def on_step(self, trainer, record):
            if trainer.step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

    cfg = load_run_config(write_toml(tmp_path / "run.toml", tiny_dir, *data_files, tmp_path / "run", steps=8,
                                     save_every=2, eval_every=0, stop_save=stop_save))
    t = build_trainer(cfg)
    t.callbacks.append(SignalAt())
    t.fit()
    assert t.stopped_by == "SIGTERM" and t.step == 3
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers given back after fit
    out = capsys.readouterr().out
    saved = sorted(p.name for p in (tmp_path / "run").glob("ckpt-*"))
    if stop_save:
        assert saved == ["ckpt-000002", "ckpt-000003"]
        assert "stopped by SIGTERM at step 3; checkpoint ckpt-000003; resume with the same command and --resume" in out
    else:
        assert saved == ["ckpt-000002"]
        assert ("stopped by SIGTERM at step 3; no checkpoint written (train.stop_save = false; the newest is "
                "ckpt-000002); resume with the same command and --resume") in out


def test_bad_max_time():
    with pytest.raises(ValueError, match=r"train.max_time must be a duration such as .+ got '3 hours'"):
        TrainSection(steps=1, max_time="3 hours")
    with pytest.raises(ValueError, match=r"train.max_time must be longer than 0 seconds"):
        TrainSection(steps=1, max_time="0m")
    assert TrainSection(steps=1, max_time="3h50m").max_time == "3h50m"


# ---- one writer per run directory ------------------------------------------------------------------------
def _snapshot(run: Path) -> dict[str, tuple[str, int]]:
    return {str(p.relative_to(run)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
            for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_second_writer_refused_until_the_first_dies(tmp_path, tiny_dir, data_files):
    cfg = write_toml(tmp_path / "run.toml", tiny_dir, *data_files, tmp_path / "run", steps=400, save_every=2,
                     eval_every=0, keep_last=2)
    run = tmp_path / "run"
    kiln("train", "--config", str(cfg), "--set", "train.steps=2")  # a checkpoint to resume from
    first = _start(cfg, "--resume", str(run))
    deadline = time.time() + 240
    while _steps_logged(run) < 6 and first.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    first.send_signal(signal.SIGSTOP)  # frozen, still holding the lock: the directory must not change under us
    try:
        before = _snapshot(run)
        second = kiln("train", "--config", str(cfg), "--resume", str(run), check=False)
        assert second.returncode == 1, second.stderr
        assert re.search(rf"kiln: {re.escape(str(run))} is in use by another kiln train \(pid {first.pid} on "
                         rf"\S+, started \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d", second.stderr), second.stderr
        assert _snapshot(run) == before
        # readers take no lock
        assert plot_run(run, tmp_path / "curves.png").is_file()
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    assert first.returncode == -signal.SIGKILL
    third = kiln("train", "--config", str(cfg), "--resume", str(run), "--set", "train.steps=12")
    assert "done: step 12" in third.stdout


def test_lock_in_process(tmp_path):
    held = lock.acquire(tmp_path / "new" / "run")
    with pytest.raises(KilnError, match=rf"is in use by another kiln train \(pid {os.getpid()} on "):
        lock.acquire(tmp_path / "new" / "run")  # a second Trainer of this process conflicts too (flock, not lockf)
    held.release(undo=True)  # a failed run: the lock file and the directories made for it go
    assert not (tmp_path / "new").exists()
    lock.acquire(tmp_path / "run").release()
    path = tmp_path / "run" / lock.LOCK_NAME
    os.utime(path, ns=(10**18, 10**18))
    before = (path.read_bytes(), path.stat().st_mtime_ns)
    lock.acquire(tmp_path / "run").release(undo=True)  # an existing file: its holder's name and times put back
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before
    held = lock.acquire(tmp_path / "run")
    assert path.stat().st_mtime_ns != before[1]  # the control: a run that goes on names itself (writes the file)
    held.release()


def test_refused_setup_frees_the_lock(tmp_path, tiny_dir, data_files):
    from kiln.train.config import load_run_config
    from kiln.train.run import build_trainer

    build_trainer(load_run_config(write_toml(tmp_path / "a.toml", tiny_dir, *data_files, tmp_path / "run",
                                             steps=2))).fit()
    changed = load_run_config(write_toml(tmp_path / "b.toml", tiny_dir, *data_files, tmp_path / "run", steps=2,
                                         precision="bf16"))
    for _ in range(2):  # refused inside setup, after the lock was taken: given back each time (else "in use")
        with pytest.raises(KilnError, match="precision changed"):
            build_trainer(changed, resume=tmp_path / "run").fit()
    lock.acquire(tmp_path / "run").release()


# ---- exit codes ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_non_finite_abort_exits_3(tmp_path, tiny_dir, data_files):
    # lr 1e30 without clipping: the first update blows the weights up and step 2's loss is NaN
    cfg = write_toml(tmp_path / "run.toml", tiny_dir, *data_files, tmp_path / "run", steps=6, eval_every=0, lr=1e30,
                     non_finite="fail")
    cfg.write_text(cfg.read_text().replace("[train]\n", "[train]\nclip_grad_norm = 0.0\n"))
    p = kiln("train", "--config", str(cfg), check=False)
    assert p.returncode == 3, (p.returncode, p.stderr)
    assert "kiln: non-finite loss nan at step 2; stopping (train.non_finite = 'fail')" in p.stderr


def test_exit_codes_of_train():
    import typer

    from kiln.cli.common import EXIT_INTERNAL, EXIT_NON_FINITE, exit_codes
    from kiln.errors import NonFiniteError

    def raising(e: BaseException):
        @exit_codes
        def command() -> None:
            raise e
        return command

    for error, code in ((NonFiniteError("non-finite loss nan at step 2"), EXIT_NON_FINITE),
                        (RuntimeError("a bug"), EXIT_INTERNAL), (typer.Exit(75), 75)):
        with pytest.raises(typer.Exit) as info:
            raising(error)()
        assert info.value.exit_code == code, error
    with pytest.raises(KilnError, match="bad key"):  # user errors go on to the CLI's boundary (exit 1)
        raising(KilnError("bad key"))()
