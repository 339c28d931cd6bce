"""A checkpoint that fails to load for any reason falls back to the previous one, naming the file and why
(issue 32), as a table in the bad-input suite's form (exit code, message, no traceback, the world's root
unchanged). A safetensors file cut short is test_values' resume-unreadable-checkpoint-falls-back. Each case copies the world's finished run (ckpt-000001, ckpt-000002) outside the root, breaks
ckpt-000002 and rewrites its manifest to match, so the checksums pass and only loading can tell; the resume
must then start from ckpt-000001 and write ckpt-000002 afresh. When every checkpoint is broken the resume
is refused, listing each one's reason.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.hub.files import file_sha256
from kiln.train.checkpoint import verify_checkpoint
from tests.cli.bad_inputs_world import World
from tests.cli.test_values import Case, resume_config, run_case, run_copy, w  # noqa: F401 (w: the fixture)

C = Case


def _remanifest(ck: Path) -> None:
    """The manifest rewritten to match the files as they are now (what a checksum cannot catch)."""
    files = {str(f.relative_to(ck)): {"sha256": file_sha256(f), "bytes": f.stat().st_size}
             for f in sorted(ck.rglob("*")) if f.is_file() and f.name != "manifest.json"}
    (ck / "manifest.json").write_text(json.dumps({"format": 1, "step": int(ck.name[5:]), "files": files}))


def broken(name: str, *edits: Callable[[Path], None], which: tuple[str, ...] = ("ckpt-000002",)) -> Callable:
    """Args for a resume of a copy of the world's run whose checkpoints `which` had `edits` applied."""
    def args(w: World) -> list:
        run = w.elsewhere / name
        if not run.exists():
            run_copy(w, name)
            for ck in which:
                for edit in edits:
                    edit(run / ck)
                _remanifest(run / ck)
            if "ckpt-000001" not in which:
                assert verify_checkpoint(run / "ckpt-000001", resume=True) is None  # the one to fall back to
        return ["train", "--config", resume_config(w, name, out=run), "--resume", run]
    return args


def _tensors(file: str, change: Callable[[dict], None]) -> Callable[[Path], None]:
    def edit(ck: Path) -> None:
        state = load_file(str(ck / file))
        change(state)
        save_file(state, str(ck / file), metadata={"format": "pt"})
    return edit


def _json(file: str, change: Callable[[object], object]) -> Callable[[Path], None]:
    def edit(ck: Path) -> None:
        (ck / file).write_text(json.dumps(change(json.loads((ck / file).read_text()))))
    return edit


def _head_shape(state: dict) -> None:
    state["classifier.weight"] = torch.zeros(state["classifier.weight"].shape[0] + 1, state["classifier.weight"].shape[1])


def _head_int(state: dict) -> None:
    state["classifier.weight"] = state["classifier.weight"].round().to(torch.int32)


def _optim_shape(state: dict) -> None:
    for key in ("0.exp_avg", "0.exp_avg_sq"):  # both, so the file agrees with itself: only the model can tell
        state[key] = torch.zeros(state[key].numel() + 1)


def _optim_int(state: dict) -> None:
    state["0.exp_avg"] = state["0.exp_avg"].to(torch.int32)


def _no_step(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "step"}


def _one_rng_too_many(states: list) -> list:
    return states + states


def _missing(file: str) -> Callable[[Path], None]:
    return lambda ck: (ck / file).unlink()


def _kinds(ck: Path) -> dict:
    out = {}
    for file in ("model/model.safetensors", "optimizer.safetensors"):
        out.update({f"{file}:{k}": (v.dtype, tuple(v.shape)) for k, v in load_file(str(ck / file)).items()})
    return out


def _rewritten(w: World) -> None:
    """The resume went on from ckpt-000001 and wrote ckpt-000002 afresh: it verifies, and every tensor has the
    kind and shape of ckpt-000001's (the broken one's differed)."""
    run = max(w.elsewhere.glob("fb*"), key=lambda p: p.stat().st_mtime)
    assert verify_checkpoint(run / "ckpt-000002", resume=True) is None
    assert _kinds(run / "ckpt-000002") == _kinds(run / "ckpt-000001")
    assert json.loads((run / "ckpt-000002" / "trainer.json").read_text())["step"] == 2


FALLBACK = "; using the previous checkpoint"
CASES = [
    C("model-tensor-wrong-shape", broken("fbmshape", _tensors("model/model.safetensors", _head_shape)), 0,
      "ckpt-000002: model/ cannot be loaded ("),
    C("model-tensor-int32", broken("fbmint", _tensors("model/model.safetensors", _head_int)), 0,
      "'classifier.weight' is stored as int32"),
    C("optimizer-tensor-wrong-shape", broken("fboshape", _tensors("optimizer.safetensors", _optim_shape)), 0,
      "ckpt-000002: optimizer.safetensors cannot be loaded (tensor '0.exp_avg' is torch.float32"),
    C("optimizer-json-missing", broken("fbomiss", _missing("optimizer.json")), 0,
      "ckpt-000002: optimizer.json is missing" + FALLBACK),
    C("every-checkpoint-broken", broken("fball", _tensors("model/model.safetensors", _head_shape),
                                        which=("ckpt-000001", "ckpt-000002")), 1,
      "no checkpoint can be resumed from: ckpt-000002: model/ cannot be loaded"),
    C("every-checkpoint-broken-on-verify", broken("fballv", _missing("rng.json"), which=("ckpt-000001", "ckpt-000002")),
      1, "no checkpoint can be resumed from: ckpt-000002: rng.json is missing; ckpt-000001: rng.json is missing."),
]


# Broken in ways the resume's pick of a checkpoint sees (the same path as optimizer-json-missing above, which
# runs it through the CLI): the reason verify_checkpoint gives, which the fallback line prints.
PICKED = [
    ("optimizer-tensor-int32", _tensors("optimizer.safetensors", _optim_int),
     "optimizer.safetensors: '0.exp_avg' is I32, not floating point"),
    ("trainer-json-no-step", _json("trainer.json", _no_step), "trainer.json has no 'step'"),
    ("trainer-json-step-text", _json("trainer.json", lambda s: {**s, "step": "2"}),
     "trainer.json: 'step' is str, not int"),
    ("rng-json-wrong-length", _json("rng.json", _one_rng_too_many),
     "rng.json holds 2 states, not one per process of the 1 that wrote it"),
]


@pytest.mark.parametrize("name,edit,why", PICKED, ids=[p[0] for p in PICKED])
def test_resume_skips_a_checkpoint_it_cannot_read(name: str, edit: Callable, why: str, w: World, tmp_path):
    ck = tmp_path / "ckpt-000002"
    shutil.copytree(w.run / "ckpt-000002", ck)
    assert verify_checkpoint(ck, resume=True) is None  # the control: intact, it is picked
    edit(ck)
    _remanifest(ck)
    assert verify_checkpoint(ck) is None  # an export still takes it: the model is whole
    assert verify_checkpoint(ck, resume=True) == why


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_resume_falls_back(case: Case, w: World, monkeypatch):
    if case.code == 0:  # "resume: from ckpt-000001" is in the output too; the files say it as well
        case = Case(case.id, case.args, case.code, case.says, after=_rewritten)
    run_case(case, w, monkeypatch)
