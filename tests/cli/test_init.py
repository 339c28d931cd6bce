"""`kiln init NAME --template T` writes a folder that `kiln train --config NAME/run.toml` trains as it is (checked
here for 2 steps of each template), refuses a non-empty NAME without --overwrite; `kiln examples` lists only
examples that exist in the repository."""

from __future__ import annotations

import json

import pytest

from tests.kiln_cli import REPO, kiln, kiln_cli

from kiln.cli.init import EXAMPLES


@pytest.mark.slow
@pytest.mark.parametrize("template", ["classify", "sft", "pretrain", "mamba"])
def test_each_template_trains_as_it_is(tmp_path, template):
    kiln("init", "proj", "--template", template, cwd=tmp_path)
    assert {p.name for p in (tmp_path / "proj").iterdir()} == {"run.toml", "README.md", "data"}
    kiln("train", "--config", "proj/run.toml", "--set", "train.steps=2", "--set", "train.progress=false",
         cwd=tmp_path)
    rows = [json.loads(x) for x in (tmp_path / "runs" / "proj" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["step"] == 2 and r["loss"] > 0 for r in rows if "loss" in r)  # log_every = 5: the last step logs
    assert any("eval_loss" in r for r in rows)
    assert (tmp_path / "runs" / "proj" / "ckpt-000002" / "model" / "model.safetensors").is_file()


@pytest.mark.slow
def test_a_non_empty_folder_is_refused_without_overwrite(tmp_path):
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "notes.txt").write_text("mine")
    r = kiln("init", "proj", "--template", "classify", cwd=tmp_path, check=False)
    assert r.returncode == 1 and "proj: already exists and is not empty" in r.stdout + r.stderr
    assert "Traceback" not in r.stderr and [p.name for p in (tmp_path / "proj").iterdir()] == ["notes.txt"]
    kiln("init", "proj", "--template", "classify", "--overwrite", cwd=tmp_path)
    assert (tmp_path / "proj" / "notes.txt").read_text() == "mine"  # only the template's own paths are replaced
    assert (tmp_path / "proj" / "run.toml").is_file()
    r = kiln_cli("init", str(tmp_path / "x"), "--template", "bert")
    assert r.returncode == 1 and "choose one of classify, sft, pretrain, mamba" in r.stdout + r.stderr


def test_examples_lists_what_exists():
    r = kiln("examples")
    for path, _, how in EXAMPLES:
        assert (REPO / path).exists(), path
        assert path in r.stdout and how in r.stdout
