"""The bad cases of this session's sweep (issue 41's "fresh sweep"), each through the CLI: the exit code, the
message naming the key or path, no traceback, and nothing under the case's folder changed. Before: a negative
train.seed was exit 70 from inside numpy; a model.config key one typo from a real one (hiden_size) trained at the
default size, exit 0; an empty data.train folder was told only that data.dtype is unknown; a missing data.eval
was said to need "raw token ids too"; a folder given as --config was "no such run config file"."""

from __future__ import annotations

import pytest

from tests.cli.reliability_world import pretrain_config, raw_shards, run_cli, snapshot


def _refused(tmp_path, cfg, *extra, says: str) -> None:
    before = snapshot(tmp_path)
    code, out = run_cli("train", "--config", cfg, *extra)
    assert code == 1 and says in out and "Traceback" not in out, out
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_a_negative_seed_is_refused_naming_it(tmp_path):
    tok = raw_shards(tmp_path / "tok", 1)
    cfg = pretrain_config(tmp_path / "r.toml", tok, tmp_path / "out", train={"seed": -1})
    _refused(tmp_path, cfg, says="train.seed must be >= 0, got -1")


@pytest.mark.parametrize("key,means", [("hiden_size", "hidden_size"), ("intermediate_szie", "intermediate_size"),
                                       ("num_hidden_layer", "num_hidden_layers")])
def test_a_model_config_key_one_typo_from_a_real_one_is_refused(tmp_path, key, means):
    tok = raw_shards(tmp_path / "tok", 1)
    cfg = pretrain_config(tmp_path / "r.toml", tok, tmp_path / "out", config={key: 48})
    _refused(tmp_path, cfg, says=f"model.config.{key} is not a qwen3 config key; did you mean {means}?")


def test_keys_the_family_does_not_model_still_pass(tmp_path):
    """transformers' own keys kiln keeps as extras (written back to config.json) are not typos."""
    from kiln.train.recipes.base import check_config_keys

    check_config_keys("deepseek_v3", {"qk_head_dim": 24, "use_cache": True, "torch_dtype": "bfloat16"})
    tok = raw_shards(tmp_path / "tok", 1)
    code, out = run_cli("train", "--config", pretrain_config(tmp_path / "r.toml", tok, tmp_path / "out",
                                                              config={"use_cache": False}))
    assert code == 0 and "done: step 2" in out, out


def test_an_empty_data_folder_is_named(tmp_path):
    (tmp_path / "empty").mkdir()
    cfg = pretrain_config(tmp_path / "r.toml", tmp_path / "empty", tmp_path / "out")
    _refused(tmp_path, cfg, says=f"data.train {tmp_path / 'empty'} is an empty folder, so what it holds could not "
                                 "decide")


def test_a_missing_eval_file_is_named_as_missing(tmp_path):
    tok = raw_shards(tmp_path / "tok", 1)
    cfg = pretrain_config(tmp_path / "r.toml", tok, tmp_path / "out", data={"eval": str(tmp_path / "nope.bin")})
    _refused(tmp_path, cfg, says=f"data.eval {tmp_path / 'nope.bin'}: no such file or folder")


def test_a_folder_given_as_the_run_config_is_named(tmp_path):
    (tmp_path / "cfgdir").mkdir()
    _refused(tmp_path, tmp_path / "cfgdir", says=f"{tmp_path / 'cfgdir'}: is a folder, not a run config file")


def test_out_dir_naming_the_data_folder_is_refused(tmp_path):
    """A folder of raw token files looks empty to the out_dir check; the run wrote its checkpoints into it, exit 0."""
    tok = raw_shards(tmp_path / "tok", 1)
    cfg = pretrain_config(tmp_path / "r.toml", tok, tok)
    before = snapshot(tmp_path)
    code, out = run_cli("train", "--config", cfg)
    assert code == 1 and f"train.out_dir {tok} is data.train's folder" in out and "Traceback" not in out, out
    assert snapshot(tmp_path) == before



def test_some_examples_without_a_target_are_counted_once(capsys):
    """Examples whose every target is ignored (an SFT reply past data.max_length) teach nothing: refused when all
    are so (held through the CLI by tests/cli/test_bad_inputs.py), counted in one warning when some are."""
    import torch
    from torch import nn

    from kiln.constants import IGNORE_INDEX
    from kiln.errors import KilnError
    from kiln.models.tasks import get_task
    from kiln.train.checks import check_examples

    task = get_task("causal-lm")
    ids = torch.arange(6)

    def example(learn: bool) -> dict:
        return {"input_ids": ids, "labels": ids.clone() if learn else torch.full_like(ids, IGNORE_INDEX)}

    check_examples([example(True), example(False), example(False), example(True)], nn.Linear(1, 1), task,
                   "data.train x.jsonl", "replies past max_length")
    err = capsys.readouterr().err
    assert err.count("warning: data.train x.jsonl: 2 of 4 example(s) have every target ignored, so nothing is "
                     "learned from them (replies past max_length); 2 carry signal") == 1, err
    check_examples([example(True), example(False)], nn.Linear(1, 1), task, "data.train x.jsonl", say=False)
    assert capsys.readouterr().err == ""  # another rank: the main one said it
    check_examples([example(True)] * 3, nn.Linear(1, 1), task, "data.train x.jsonl")
    assert capsys.readouterr().err == ""
    with pytest.raises(KilnError, match="nothing to learn: every target of its 2 example"):
        check_examples([example(False)] * 2, nn.Linear(1, 1), task, "data.train x.jsonl")


def test_a_run_config_not_in_utf8_is_named(tmp_path):
    bad = tmp_path / "r.toml"
    bad.write_bytes(b"[train]\nsteps = 2 # \xff\xfe\n")
    _refused(tmp_path, bad, says=f"{bad}: not valid UTF-8 (byte 20); TOML files are UTF-8")


def test_a_data_link_that_loops_is_told_from_a_dangling_one(tmp_path):
    import os

    loop = tmp_path / "loop.bin"
    os.symlink(loop, loop)
    cfg = pretrain_config(tmp_path / "r.toml", loop, tmp_path / "out")
    _refused(tmp_path, cfg, says=f"data.train {loop}: a symbolic link that leads back to itself")
