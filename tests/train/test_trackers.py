"""[train] report_to: TensorBoard, W&B (offline) and Trackio (local) each receive metrics.jsonl's scalars at its
steps and the run config as hyper-parameters, read back with each library's own reader; a missing library is a
ConfigError before any work; the old `tensorboard = true` maps to report_to."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kiln.errors import ConfigError
from kiln.train.config import TrainSection, load_run_config
from kiln.train.metrics import read_metrics
from kiln.train.run import build_trainer
from kiln.train.trackers import scalars
from tests.train.train_helpers import kiln, write_toml


def _expected(run: Path) -> dict[str, dict[int, float]]:
    """{scalar: {step: value}} from metrics.jsonl, what every tracker must hold."""
    out: dict[str, dict[int, float]] = {}
    for r in read_metrics(run / "metrics.jsonl"):
        for k, v in scalars(r).items():
            out.setdefault(k, {})[r["step"]] = v
    return out


def _tensorboard(run: Path) -> tuple[dict, dict]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    got = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    info = plugin_data_pb2.HParamsPluginData.FromString(acc.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    hp = {k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind")) for k, v in info.session_start_info.hparams.items()}
    return got, hp


def _wandb_records(path: Path):
    """The protobuf payloads of a W&B transaction log (run-*.wandb): a 7-byte header, then 32 KiB blocks of
    chunks (crc32, length, kind: 1 whole, 2 first, 3 middle, 4 last), as W&B writes offline runs.
    (wandb >= 0.2x ships no Python reader for it.)"""
    import struct
    import zlib

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", raw[:7]
    pos, block, payload = 7, 32768, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        if length == 0 and kind == 0:
            break
        data = raw[pos + 7:pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + data) & 0xFFFFFFFF == crc, f"bad chunk crc at {pos}"
        payload = data if kind in (1, 2) else payload + data
        if kind in (1, 4):
            yield payload
        pos += 7 + length


def _wandb(run: Path) -> tuple[dict, dict]:
    from wandb.proto import wandb_internal_pb2

    (log,) = run.glob("wandb/offline-run-*/run-*.wandb")
    got: dict[str, dict[int, float]] = {}
    config: dict = {}
    for data in _wandb_records(log):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        kind = rec.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
            for k, v in items.items():
                if not k.startswith("_"):
                    got.setdefault(k, {})[items["_step"]] = v
        elif kind in ("config", "run"):
            update = rec.config.update if kind == "config" else rec.run.config.update
            config.update({i.key: json.loads(i.value_json) for i in update})
    return got, config


def _trackio(project: str, name: str) -> tuple[dict, dict]:
    from trackio.sqlite_storage import SQLiteStorage

    got: dict[str, dict[int, float]] = {}
    for row in SQLiteStorage.get_logs(project, name):
        for k, v in row.items():
            if k not in ("step", "timestamp") and isinstance(v, (int, float)):
                got.setdefault(k, {})[row["step"]] = v
    return got, SQLiteStorage.get_run_config(project, name) or {}


@pytest.mark.slow
def test_every_tracker_gets_the_metrics_and_the_config(tmp_path, tiny_dir, data_files, monkeypatch):
    train, eval_ = data_files
    run = tmp_path / "trk"
    cfg = write_toml(tmp_path / "run.toml", tiny_dir, train, eval_, run, steps=4, save_every=0, eval_every=2,
                     report_to=["tensorboard", "wandb", "trackio"], project="kiln-test")
    store = tmp_path / "trackio"
    kiln("train", "--config", str(cfg), env={"WANDB_MODE": "offline", "WANDB_SILENT": "true",
                                             "TRACKIO_DIR": str(store)})
    want = _expected(run)
    assert {"loss", "lr", "eval_loss", "eval_accuracy"} <= want.keys() and len(want["loss"]) == 4

    got, hp = _tensorboard(run)
    assert got.keys() == want.keys()
    for k in want:  # event files hold float32
        assert got[k] == pytest.approx(want[k], rel=1e-6), k
    assert hp["train.lr"] == 2e-3 and hp["train.steps"] == 4 and hp["model.task"] == "sequence-classification"

    got, config = _wandb(run)
    assert got == want
    assert config["train"]["lr"] == 2e-3 and config["train"]["steps"] == 4

    monkeypatch.setenv("TRACKIO_DIR", str(store))
    sys.modules.pop("trackio.utils", None)
    sys.modules.pop("trackio.sqlite_storage", None)
    got, config = _trackio("kiln-test", "trk")
    assert {k: got[k] for k in want} == want
    assert config["train"]["lr"] == 2e-3


def test_a_missing_tracker_library_is_named_before_any_work(tmp_path, tiny_dir, data_files, monkeypatch):
    train, eval_ = data_files
    cfg = load_run_config(write_toml(tmp_path / "run.toml", tiny_dir, train, eval_, tmp_path / "out",
                                     report_to=["tensorboard", "wandb"]))
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"report_to includes 'wandb' but the wandb package is not installed; "
                                          r"pip install 'kiln\[wandb\]'"):
        build_trainer(cfg)
    assert not (tmp_path / "out").exists()
    monkeypatch.delitem(sys.modules, "wandb")   # control: installed, so the same config passes the check
    build_trainer(cfg)


def test_the_old_tensorboard_switch_maps_to_report_to():
    assert TrainSection(steps=1, tensorboard=True).report_to == ["tensorboard"]
    assert TrainSection(steps=1, tensorboard=True, report_to=["tensorboard", "wandb"]).report_to == ["tensorboard", "wandb"]
    with pytest.raises(ValueError, match="report_to"):
        TrainSection(steps=1, report_to=["mlflow"])
