"""examples/digits_vlm's plumbing at a few steps: its data, stage 1 from scratch, the export, stage 2's LoRA on
the exported base through `kiln train`, and the adapter checkpoint loaded (base + adapters) to answer held-out
digits. The commands run in this process (`kiln ARGS` through the CLI app, as the example runs them in its
folder); the accuracy run itself is the README's."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("PIL")
pytest.importorskip("sklearn")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits_vlm"


def _example():
    spec = importlib.util.spec_from_file_location("digits_vlm_run", EXAMPLE / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_two_stages_run_and_the_adapters_load(tmp_path, monkeypatch):
    from kiln.cli.main import app
    from kiln.models import AutoModelForImageTextToText

    run = _example()
    commands = []

    def kiln(work: Path, *args: str) -> float:  # the example's `kiln ARGS` in WORK, without a new process
        monkeypatch.chdir(work)
        commands.append(args[:3])
        r = CliRunner().invoke(app, list(args))
        assert r.exit_code == 0, r.output
        return 0.0

    monkeypatch.setattr(run, "kiln", kiln)
    out = run.main(["--out", str(tmp_path), "--steps", "2,2", "--train", "40", "--held", "8"])
    ckpt = tmp_path / "runs" / "base" / "ckpt-000002"
    assert commands == [("train", "--config", "base.toml"), ("export", "--checkpoint", str(ckpt)),
                        ("train", "--config", "lora.toml")]
    base_rows = [json.loads(x) for x in (tmp_path / "data" / "base_train.jsonl").read_text().splitlines()]
    assert {int(r["messages"][1]["content"]) for r in base_rows} == {0, 1, 2, 3, 4}  # stage 1 never shows 5-9
    def images(name: str) -> set[str]:
        rows = (tmp_path / "data" / name).read_text().splitlines()
        return {json.loads(r)["messages"][0]["content"][0]["image"] for r in rows}

    held, trained = images("lora_eval.jsonl"), images("lora_train.jsonl")
    assert len(held) == 8 and len(trained) == 40 and not held & trained
    processor = json.loads((tmp_path / "runs" / "base-model" / "preprocessor_config.json").read_text())
    assert processor["min_pixels"] == 256  # the export keeps the processor stage 1 trained with
    adapters = out["adapters"]
    assert (adapters / "adapter_model.safetensors").is_file() and (adapters / "adapter_config.json").is_file()
    model = AutoModelForImageTextToText.from_pretrained(adapters)
    lora = [n for n, _ in model.named_parameters() if "lora_" in n]
    assert any("visual." in n for n in lora) and any("visual." not in n for n in lora)  # tower and language model
    assert set(out["accuracy"]) == {"base", "base + LoRA"} and (tmp_path / "runs" / "curves.png").is_file()
