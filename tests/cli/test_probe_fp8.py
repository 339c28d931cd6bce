"""`kiln probe` reports FP8 by running a tiny torch._scaled_mm, not by reading the device name."""

from __future__ import annotations

import torch
from typer.testing import CliRunner

from kiln.cli.main import app


def test_probe_runs_scaled_mm(monkeypatch):
    r = CliRunner().invoke(app, ["probe", "--no-compile"], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert "cpu fp8" in r.output and "yes (_scaled_mm)" in r.output  # torch 2.13 runs it on CPU

    def refuses(*args, **kwargs):
        raise RuntimeError("_scaled_mm is not supported on this device")

    monkeypatch.setattr(torch, "_scaled_mm", refuses)
    r = CliRunner().invoke(app, ["probe", "--no-compile"], terminal_width=200)
    assert "no, emulated (RuntimeError: _scaled_mm is not supported on this device)" in r.output
