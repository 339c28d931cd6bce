"""`kiln probe` reports the machine."""

from __future__ import annotations

import torch
from typer.testing import CliRunner

from kiln.cli.main import app


def test_probe_reports_torch_devices_and_backends():
    r = CliRunner().invoke(app, ["probe", "--no-compile"], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert torch.__version__ in r.output and "gloo" in r.output
    assert ("cuda:0" in r.output) == torch.cuda.is_available()
