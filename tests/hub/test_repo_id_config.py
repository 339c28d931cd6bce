"""A run TOML may name its model by Hub repo id: load_run_config keeps `org/name[@rev]` as it is (not joined onto
the config's folder) when no such path exists there, and `kiln train` loads it from the (fake) HF cache."""

from __future__ import annotations

import json
from pathlib import Path

from kiln.train.config import load_run_config
from tests.hub.test_resolve import hub_cache  # noqa: F401  (the fake-cache fixture)


def _toml(folder: Path, model: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"text": f"word{i % 5} paris france", "label": f"LABEL_{i % 3}"} for i in range(8)]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = folder / "run.toml"
    path.write_text(f'[model]\npath = "{model}"\n\n[data]\ntrain = "train.jsonl"\nmax_length = 16\n\n'
                    f'[train]\nsteps = 2\nbatch_size = 4\nprogress = false\nout_dir = "{folder / "run"}"\n')
    return path


def test_repo_id_is_kept_and_local_paths_still_join(tmp_path):
    cfg = load_run_config(_toml(tmp_path / "a", "org/tiny@v1"))
    assert cfg.model.path == "org/tiny@v1"
    assert cfg.data.train == str(tmp_path / "a" / "train.jsonl")  # data paths still join onto the folder
    (tmp_path / "b" / "org" / "tiny").mkdir(parents=True)          # a folder of that name next to the TOML wins
    assert load_run_config(_toml(tmp_path / "b", "org/tiny")).model.path == str(tmp_path / "b" / "org" / "tiny")
    # control: a relative path that is not a repo id is joined even when missing (the loader names it)
    assert load_run_config(_toml(tmp_path / "c", "models/x/y")).model.path == str(tmp_path / "c" / "models/x/y")


def test_a_run_loads_a_repo_id_from_the_cache(tmp_path, hub_cache, monkeypatch):
    from huggingface_hub import constants

    from kiln.train.run import build_trainer

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    trainer = build_trainer(load_run_config(_toml(tmp_path / "run", "org/tiny@v1")))
    trainer.fit()
    saved = json.loads((tmp_path / "run" / "run" / "ckpt-000002" / "model" / "config.json").read_text())
    assert saved["architectures"] == ["BertForSequenceClassification"]  # v1's classifier; main is a masked LM
