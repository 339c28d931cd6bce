"""Values stay what they are (issue 32), the pieces below the CLI: a chat turn's null content, SIGTERM during a
staged write, a sharded checkpoint missing a shard, the default thread count. The CLI tables are in
tests/cli/test_values.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from kiln.hub.files import file_sha256


def test_tool_call_turn_may_have_null_content():
    """The one null content a chat record may hold: an assistant turn that carries tool calls (transformers'
    templates render those from tool_calls); the same turn without them is refused (control)."""
    from kiln.data.records import Record
    from kiln.data.sft import conversation
    from kiln.errors import KilnError

    call = {"type": "function", "function": {"name": "now", "arguments": {}}}
    turns = [{"role": "user", "content": "time?"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert conversation(Record({"messages": turns}, "t.jsonl:1"))[1] == {"role": "assistant", "content": None,
                                                                         "tool_calls": [call]}
    with pytest.raises(KilnError, match=r"t.jsonl:2: messages\[1\] must be an object with string 'role'"):
        conversation(Record({"messages": [turns[0], {"role": "assistant", "content": None}]}, "t.jsonl:2"))
    with pytest.raises(KilnError, match=r"t.jsonl:3: messages\[0\] must be"):  # a user turn: tool_calls do not count
        conversation(Record({"messages": [{"role": "user", "content": None, "tool_calls": [call]}]}, "t.jsonl:3"))


def test_sigterm_removes_the_staging_folder(tmp_path):
    """A process killed by SIGTERM while writing through staged_dir leaves no hidden .kiln-tmp folder and no
    output, and still dies by the signal (what a shell or scheduler sees). The control: SIGKILL, which nothing
    can catch, does leave the folder, so the check can fail."""
    import signal
    import subprocess
    import sys

    script = ("import os, signal, sys, time\n"
              "from kiln.hub.outdir import staged_dir\n"
              "with staged_dir(sys.argv[1]) as tmp:\n"
              "    (tmp / 'model.safetensors').write_bytes(b'x' * 1000)\n"
              "    os.kill(os.getpid(), int(sys.argv[2]))\n"
              "    time.sleep(30)\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for sig, left in ((signal.SIGTERM, []), (signal.SIGKILL, [".out-kill.kiln-tmp"])):
        out = tmp_path / ("out" if sig == signal.SIGTERM else "out-kill")
        p = subprocess.run([sys.executable, "-c", script, str(out), str(int(sig))], env=env, timeout=120,
                           capture_output=True, text=True)
        assert p.returncode == -sig, (p.returncode, p.stderr)
        assert "Traceback" not in p.stderr, p.stderr
        assert [f.name.rsplit("-", 1)[0] for f in tmp_path.glob(f".{out.name}.kiln-tmp-*")] == left
        assert not out.exists()


def test_dcp_shard_missing_names_the_shard(tmp_path):
    """A sharded checkpoint with a shard file removed (and nothing else to say so) loads as a KilnError
    naming the missing file, not torch's CheckpointException traceback."""
    import torch.distributed.checkpoint as dcp

    from kiln.errors import KilnError
    from kiln.parallel.checkpoint import _dcp_load

    model = torch.nn.Linear(4, 3)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    fresh = {"model": torch.nn.Linear(4, 3).state_dict()}
    _dcp_load(fresh, tmp_path, no_dist=True)  # the control: whole, it loads
    assert torch.equal(fresh["model"]["weight"], model.weight.detach())
    shard = next((tmp_path / "dcp").glob("*.distcp"))
    shard.unlink()
    with pytest.raises(KilnError, match=rf"a shard of this sharded checkpoint cannot be read \(rank 0: .*{shard.name}"):
        _dcp_load({"model": torch.nn.Linear(4, 3).state_dict()}, tmp_path, no_dist=True)


def test_threads_share_the_cores(monkeypatch, tmp_path):
    """The default thread count divides the cores over the kiln processes running here (their entries, this
    command's own processes included) and says so; entries of processes that are gone do not count (the
    control: a dead pid's entry is removed, not counted); OMP_NUM_THREADS wins, silently."""
    import subprocess
    import sys

    from kiln.cli import common

    monkeypatch.setattr(common, "_REGISTRY", tmp_path / "reg")
    monkeypatch.setattr(common.os, "sched_getaffinity", lambda pid: set(range(12)), raising=False)
    monkeypatch.setattr(common.atexit, "register", lambda *a, **k: None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    said: list[str] = []
    monkeypatch.setattr(common, "note", said.append)
    (tmp_path / "reg").mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    try:
        (tmp_path / "reg" / str(sleeper.pid)).write_text(f"{common._start_time(sleeper.pid)} 2")  # a 2-rank launch
        (tmp_path / "reg" / dead.stdout.strip()).write_text("123 1")
        assert common.share_cores() == 12 // 3
        assert "4 per process (12 cores over this process and 2 other kiln process(es) running here)" in said[-1]
        assert not (tmp_path / "reg" / dead.stdout.strip()).exists()
        assert common.share_cores(3) == 12 // 5  # a launch of 3 ranks beside the sleeper's 2
        common.share_cores_for(["inspect", "x"])  # only a train takes a share at the entry point
        assert len(said) == 2
        before = torch.get_num_threads()
        try:
            common.share_cores_for(["train", "--config", "x.toml"])
            assert torch.get_num_threads() == 12 // 3 and len(said) == 3
        finally:
            torch.set_num_threads(before)
        monkeypatch.setenv("OMP_NUM_THREADS", "7")
        assert common.share_cores() is None and len(said) == 3
    finally:
        sleeper.kill()
        sleeper.wait()


def _sharded_run(run: Path, steps: list[int]) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    """Sharded (DCP) checkpoints of a Linear and its AdamW at `steps`, written by one process; and the
    fingerprint they record."""
    from kiln.train import plans
    from kiln.train.checkpoint import rng_state
    from kiln.train.resume import model_fingerprint

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    fp = {"model": model_fingerprint(model), "data": {}, "precision": "fp32", "world_size": 1}
    for step in steps:
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        state = {"step": step, "skipped": 0, "best": None, "evals_since_best": 0, "data": {}, "fingerprint": fp}
        plans.save_sharded_checkpoint(run, step, model, opt, state, [rng_state()])
    return model, opt, fp


def _remanifest(ck: Path) -> None:
    files = {str(f.relative_to(ck)): {"sha256": file_sha256(f), "bytes": f.stat().st_size}
             for f in sorted(ck.rglob("*")) if f.is_file() and f.name != "manifest.json"}
    (ck / "manifest.json").write_text(json.dumps({"format": 1, "step": int(ck.name[5:]), "files": files}))


def test_dcp_shard_missing_from_manifest_too(tmp_path):
    """A sharded checkpoint whose shard was removed and its manifest edited to match: verify_checkpoint (what a
    resume uses to pick a checkpoint, and export to accept one) names the missing shard, so a resume falls back
    to the previous checkpoint. The control: the same checkpoint whole verifies clean."""
    from kiln.train.checkpoint import verify_checkpoint

    _sharded_run(tmp_path, [1])
    ck = tmp_path / "ckpt-000001"
    assert verify_checkpoint(ck, resume=True) is None
    shard = next((ck / "dcp").glob("*.distcp"))
    shard.unlink()
    _remanifest(ck)
    assert verify_checkpoint(ck) == f"dcp/{shard.name} is missing (dcp/.metadata names it)"


def test_dcp_shard_that_does_not_read_falls_back(tmp_path, capsys):
    """A DCP shard cut short (its manifest rewritten to match, so only loading can tell): the resume's sharded
    load names the shard and falls back to the previous checkpoint, whose state it then holds; with no previous
    one the refusal lists the reason. The control: the intact checkpoint loads as it is."""
    from types import SimpleNamespace

    from kiln.errors import KilnError
    from kiln.parallel.world import World
    from kiln.train import fallback

    model, _opt, fp = _sharded_run(tmp_path, [1, 2])
    want = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = SimpleNamespace(model=torch.nn.Linear(4, 3), fingerprint=fp, run_config={}, data_shards=1,
                              world=World(), reshard=None, config_notes=[])
    trainer.optimizer = torch.optim.AdamW(trainer.model.parameters())
    assert fallback.load_sharded(trainer, tmp_path / "ckpt-000002", sharded=True).name == "ckpt-000002"  # control
    assert all(torch.equal(v, want[k]) for k, v in trainer.model.state_dict().items())
    ck = tmp_path / "ckpt-000002"
    shard = next((ck / "dcp").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    _remanifest(ck)
    assert fallback.load_sharded(trainer, ck, sharded=True).name == "ckpt-000001"
    said = capsys.readouterr().out
    assert "resume: ckpt-000002: dcp/ cannot be loaded (" in said and "; using the previous checkpoint" in said
    assert not all(torch.equal(v, want[k]) for k, v in trainer.model.state_dict().items())  # step 1's weights
    (tmp_path / "ckpt-000001" / "dcp" / ".metadata").unlink()  # now neither loads
    with pytest.raises(KilnError, match=r"no checkpoint can be resumed from: ckpt-000002: dcp/ cannot be loaded "
                                        r"\(.*; ckpt-000001: "):
        fallback.load_sharded(trainer, ck, sharded=True)
