"""The model-directory commands, end to end, and their error handling (message, no traceback, rc 1)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from kiln.cli.main import app

runner = CliRunner()  # stdout and stderr mixed into .output


@pytest.mark.slow
def test_inspect_export_verify_on_minilm(minilm_dir, tmp_path):
    r = runner.invoke(app, ["inspect", str(minilm_dir)], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert "bert" in r.output and "22,713,216" in r.output and "WordPiece" in r.output
    r = runner.invoke(app, ["export", str(minilm_dir), "--out", str(tmp_path / "x")])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["verify-export", str(tmp_path / "x"), "--source", str(minilm_dir)], terminal_width=200)
    assert r.exit_code == 0, r.output
    assert r.output.count("PASS") == 8 and "FAIL" not in r.output and "all 8 checks passed" in r.output


def test_export_re_heads_and_writes_architectures(tiny_factory, tmp_path):
    src = tiny_factory("roberta", "masked-lm")
    r = runner.invoke(app, ["export", str(src), "--out", str(tmp_path / "b"), "--head", "base"])
    assert r.exit_code == 0, r.output
    assert '"RobertaModel"' in (tmp_path / "b" / "config.json").read_text()
    r = runner.invoke(app, ["verify-export", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output


def test_fill_mask_on_bert_and_roberta(tiny_factory):
    for model_type, mask in (("bert", "[MASK]"), ("roberta", "<mask>"), ("xlm-roberta", "<mask>"),
                             ("distilbert", "[MASK]")):
        src = tiny_factory(model_type, "masked-lm")
        r = runner.invoke(app, ["fill-mask", str(src), f"paris is the {mask} of france", "-k", "3"],
                          terminal_width=200)
        assert r.exit_code == 0, r.output
        assert r.output.count("paris is the") == 3, r.output


def test_fill_mask_without_mask_token_is_an_error(tiny_factory):
    r = runner.invoke(app, ["fill-mask", str(tiny_factory("bert", "masked-lm")), "no mask here"])
    assert r.exit_code == 1 and "no [MASK] token in the text" in r.output


def test_verify_export_fails_on_a_tampered_export(tiny_factory, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    src = tiny_factory("bert", "sequence-classification")
    runner.invoke(app, ["export", str(src), "--out", str(tmp_path / "e")])
    state = load_file(str(tmp_path / "e" / "model.safetensors"))
    state["classifier.bias"] = state["classifier.bias"] + 1e-3
    save_file(state, str(tmp_path / "e" / "model.safetensors"), metadata={"format": "pt"})
    r = runner.invoke(app, ["verify-export", str(tmp_path / "e"), "--source", str(src)], terminal_width=200)
    assert r.exit_code == 1
    assert "FAIL  tensors equal source" in r.output and "checks failed" in r.output
    assert torch.isfinite(state["classifier.bias"]).all()


def test_user_errors_print_a_message_without_traceback(tmp_path):
    for args, message in (
        (["inspect", str(tmp_path / "missing")], "no such directory"),
        (["inspect", str(tmp_path)], "no config.json in this directory"),
        (["export", "--out", str(tmp_path / "o")], "give exactly one of SRC or --checkpoint"),
    ):
        p = subprocess.run([sys.executable, "-m", "kiln.cli.main", *args], capture_output=True, text=True)
        assert p.returncode == 1, (args, p.stdout, p.stderr)
        assert message in p.stderr, (args, p.stderr)
        assert "Traceback" not in p.stderr + p.stdout
