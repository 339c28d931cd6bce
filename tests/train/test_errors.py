"""User mistakes are reported by message: config keys, data files, JSONL lines, labels."""

from __future__ import annotations

import pytest

from kiln.errors import ConfigError, KilnError
from kiln.train.config import load_run_config
from kiln.train.run import build_trainer
from tests.train.train_helpers import kiln, make_rows, write_jsonl, write_toml


def test_unknown_key_names_key_file_and_line_on_the_cli(tmp_path, tiny_dir, data_files):
    cfg = write_toml(tmp_path / "run.toml", tiny_dir, *data_files, tmp_path / "run", lr_schedule="cosine")
    p = kiln("train", "--config", str(cfg), check=False)
    assert p.returncode == 1
    line = cfg.read_text().splitlines().index('lr_schedule = "cosine"') + 1
    assert f"{cfg}:{line}: unknown key 'train.lr_schedule'" in p.stderr
    assert "Traceback" not in p.stderr


def test_mistyped_value_and_missing_section(tmp_path, tiny_dir, data_files):
    cfg = write_toml(tmp_path / "run.toml", tiny_dir, *data_files, tmp_path / "run", batch_size="eight")
    with pytest.raises(ConfigError,
                       match=r"run.toml:\d+: train.batch_size: Input should be a valid number, not text: got 'eight'"):
        load_run_config(cfg)
    bad = tmp_path / "nodata.toml"
    bad.write_text(f'[model]\npath = "{tiny_dir}"\n[train]\nsteps = 1\n')
    with pytest.raises(ConfigError, match=r"nodata.toml: missing key 'data'"):
        load_run_config(bad)


def test_missing_data_file(tmp_path, tiny_dir, data_files):
    cfg = load_run_config(write_toml(tmp_path / "run.toml", tiny_dir, tmp_path / "nope.jsonl", None, tmp_path / "r"))
    with pytest.raises(KilnError, match=r"nope.jsonl: data file not found"):
        build_trainer(cfg)


def test_jsonl_line_that_is_not_json_names_file_and_line(tmp_path, tiny_dir):
    data = write_jsonl(tmp_path / "train.jsonl", make_rows(6, 0))
    data.write_text(data.read_text() + '{"text": "red cat", "label": "animal"\n')
    cfg = load_run_config(write_toml(tmp_path / "run.toml", tiny_dir, data, None, tmp_path / "r"))
    with pytest.raises(KilnError, match=rf"{data}:7: not valid JSON"):
        build_trainer(cfg)


def test_label_outside_the_label_set_names_line_and_set(tmp_path, tiny_dir):
    rows = make_rows(6, 0)
    rows[4]["label"] = "vehicle"
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    path = write_toml(tmp_path / "run.toml", tiny_dir, data, None, tmp_path / "r")
    path.write_text(path.read_text().replace("[data]", 'labels = ["animal", "colour", "place"]\n\n[data]'))
    with pytest.raises(KilnError, match=rf"{data}:5: label 'vehicle' is not in the label set \[animal, colour, place\]"):
        build_trainer(load_run_config(path))


def test_missing_field_and_bad_freeze(tmp_path, tiny_dir):
    data = tmp_path / "train.csv"
    data.write_text("body,label\nred cat,animal\n")
    cfg = load_run_config(write_toml(tmp_path / "run.toml", tiny_dir, data, None, tmp_path / "r"))
    with pytest.raises(KilnError, match=rf"{data}:2: no field 'text' \(fields here: body, label\)"):
        build_trainer(cfg)
    good = write_jsonl(tmp_path / "t.jsonl", make_rows(12, 0))
    cfg = load_run_config(write_toml(tmp_path / "f.toml", tiny_dir, good, None, tmp_path / "r", freeze=["model.encoder"]))
    with pytest.raises(ConfigError, match=r"train.freeze: \['model.encoder'\] match no parameter name"):
        build_trainer(cfg).fit()


def test_fresh_run_into_a_used_out_dir_is_refused(tmp_path, tiny_dir, data_files):
    cfg = load_run_config(write_toml(tmp_path / "run.toml", tiny_dir, *data_files, tmp_path / "r", steps=2))
    build_trainer(cfg).fit()
    with pytest.raises(KilnError, match=r"/r already holds a run \(metrics.jsonl, ckpt-000002\); "
                                        r"continue it with --resume"):
        build_trainer(cfg).fit()
