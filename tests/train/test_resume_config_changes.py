"""Which run-config changes a resume accepts (noted) and which it refuses (naming every change)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kiln.errors import KilnError
from kiln.train.resume import breaks_exactness, check_fingerprint, config_changes

OLD = {"model": {"path": "/m", "config": {"hidden_size": 32}}, "data": {"train": "/d", "num_workers": 0},
       "train": {"out_dir": "runs/a", "lr": 1e-3, "steps": 10, "seed": 1, "eval_every": 0}, "lora": None}
PRINT = {"model": {"shapes": {"w": [2, 2]}, "dtypes": ["float32"]}, "data": {"train": "/d"}, "precision": "fp32",
         "world_size": 1}


def changed(**sections) -> dict:
    new = {k: (dict(v) if isinstance(v, dict) else v) for k, v in OLD.items()}
    for section, values in sections.items():
        new[section] = values if values is None or not isinstance(new.get(section), dict) else {**new[section],
                                                                                                 **values}
    return new


def test_allowed_changes_are_listed_and_out_dir_is_ignored():
    new = changed(train={"out_dir": "elsewhere", "lr": 2e-3, "steps": 20}, data={"num_workers": 2},
                  model={"path": "/moved"})
    refused, allowed = config_changes(OLD, new)
    assert refused == [] and allowed == ["data.num_workers 0 -> 2", "model.path '/m' -> '/moved'",
                                         "train.lr 0.001 -> 0.002", "train.steps 10 -> 20"]
    check_fingerprint(Path("ckpt"), PRINT, PRINT, (refused, allowed))  # allowed changes alone: no error
    assert config_changes(OLD, OLD) == ([], [])
    assert config_changes(None, OLD) == ([], [])  # a checkpoint from before run configs were saved


def test_changes_that_break_the_run_are_refused_with_all_changes_named():
    new = changed(model={"config": {"hidden_size": 64}}, train={"seed": 2, "lr": 5e-4}, lora={"r": 8})
    with pytest.raises(KilnError) as e:
        check_fingerprint(Path("run/ckpt-000004"), PRINT, {**PRINT, "precision": "bf16"}, config_changes(OLD, new))
    text = str(e.value)
    assert text.startswith("cannot resume from run/ckpt-000004: precision changed: fp32 -> bf16; ")
    assert "lora unset -> {'r': 8}; model.config.hidden_size 32 -> 64; train.seed 1 -> 2" in text
    assert "(also changed, which would be fine: train.lr 0.001 -> 0.0005)" in text


def test_keys_only_one_side_has_are_another_versions_schema_not_a_change():
    assert config_changes(OLD, changed(train={"group_by_length": True})) == ([], [])
    assert breaks_exactness("train.group_by_length") and not breaks_exactness("train.eval_every")
    assert breaks_exactness("data.max_length") and not breaks_exactness("data.prefetch")
