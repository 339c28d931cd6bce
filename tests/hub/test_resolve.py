"""Hub repo ids (`org/name[@revision]`) resolved through the HF cache, offline: a fake cache in huggingface_hub's
own layout (blobs, snapshot symlinks, refs), checked by huggingface_hub's scanner, loaded by kiln and `kiln inspect`."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest
import torch

from kiln.errors import KilnError
from kiln.hub.resolve import parse_repo_id, resolve_model_dir
from kiln.models import load_pretrained
from tests.kiln_cli import kiln_cli

MAIN = "a" * 40   # commit of refs/main
OLD = "b" * 40    # an older commit, also tagged v1


def _add_snapshot(repo_dir: Path, commit: str, src: Path) -> None:
    """Files of `src` as huggingface_hub stores a download: content in blobs/, symlinks under snapshots/<commit>/."""
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = repo_dir / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_factory) -> Path:
    """models--org--tiny: main = a masked-LM BERT, v1 (OLD) = a sequence classifier; nothing else cached."""
    from huggingface_hub.file_download import repo_folder_name

    cache = tmp_path_factory.mktemp("hf-cache")
    repo_dir = cache / repo_folder_name(repo_id="org/tiny", repo_type="model")
    _add_snapshot(repo_dir, MAIN, tiny_factory("bert", "masked-lm"))
    _add_snapshot(repo_dir, OLD, tiny_factory("bert", "sequence-classification"))
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(MAIN)
    (repo_dir / "refs" / "v1").write_text(OLD)
    return cache


def test_the_fake_cache_has_huggingface_hubs_layout(hub_cache):
    from huggingface_hub import scan_cache_dir

    info = scan_cache_dir(hub_cache)
    assert not info.warnings, info.warnings
    (repo,) = info.repos
    assert repo.repo_id == "org/tiny" and repo.repo_type == "model"
    assert {r.commit_hash: sorted(r.refs) for r in repo.revisions} == {MAIN: ["main"], OLD: ["v1"]}


@pytest.mark.parametrize("name,parsed", [
    ("org/name", ("org/name", None)),
    ("answerdotai/ModernBERT-base@v1.0", ("answerdotai/ModernBERT-base", "v1.0")),
    ("org/name@refs/pr/3", ("org/name", "refs/pr/3")),
    ("./org/name", None), ("/abs/org/name", None), ("a/b/c", None), ("name", None), ("org/name@", None),
])
def test_parse_repo_id(name, parsed):
    assert parse_repo_id(name) == parsed


def test_local_paths_are_returned_as_they_are(tmp_path, hub_cache):
    (tmp_path / "org" / "tiny").mkdir(parents=True)  # a local directory wins over a cached repo of that name
    cwd = os.getcwd()
    try:
        os.chdir(tmp_path)
        assert resolve_model_dir("org/tiny", cache_dir=hub_cache) == Path("org/tiny")
    finally:
        os.chdir(cwd)
    assert resolve_model_dir(tmp_path / "nothing" / "here/x") == tmp_path / "nothing" / "here/x"  # not an id: as is


@pytest.mark.parametrize("name,commit", [("org/tiny", MAIN), ("org/tiny@main", MAIN), ("org/tiny@v1", OLD),
                                         (f"org/tiny@{OLD}", OLD)])
def test_repo_ids_resolve_to_cached_snapshots(name, commit, hub_cache):
    path = resolve_model_dir(name, cache_dir=hub_cache)
    assert path == hub_cache / "models--org--tiny" / "snapshots" / commit
    assert (path / "config.json").is_file()


def test_load_pretrained_takes_a_repo_id(hub_cache, tiny_factory, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))  # the default cache, as HF_HUB_CACHE sets it
    mlm, clf = load_pretrained("org/tiny"), load_pretrained("org/tiny@v1")
    assert (mlm.task, clf.task) == ("masked-lm", "sequence-classification")
    local = load_pretrained(tiny_factory("bert", "masked-lm"))
    ids = torch.tensor([[2, 7, 9, 4, 3]])
    with torch.no_grad():
        assert torch.equal(mlm(input_ids=ids).logits, local(input_ids=ids).logits)
    assert mlm.tokenizer is not None


def test_missing_ids_fail_with_the_cache_named(hub_cache):
    with pytest.raises(KilnError, match=r"org/absent is not a local directory and not in the HF cache \(.*hf-cache"
                                        r".*downloads are off \(HF_HUB_OFFLINE=1\).*hf download org/absent"):
        resolve_model_dir("org/absent", cache_dir=hub_cache)
    with pytest.raises(KilnError, match=r"org/tiny@nope is not a local directory and not in the HF cache"):
        resolve_model_dir("org/tiny@nope", cache_dir=hub_cache)


def test_without_huggingface_hub_the_extra_is_named(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails as if not installed
    with pytest.raises(KilnError, match=r"org/tiny: no such directory; .*pip install 'kiln\[hub\]'"):
        resolve_model_dir("org/tiny")


def test_cli_takes_repo_ids(hub_cache):
    env = {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1", "COLUMNS": "300"}  # wide: the path unclipped
    r = kiln_cli("inspect", "org/tiny@v1", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bert" in r.stdout and "BertForSequenceClassification" in r.stdout and OLD in r.stdout
    r = kiln_cli("fill-mask", "org/tiny", "paris is the [MASK] of france", "-k", "2", env=env)
    assert r.returncode == 0 and r.stdout.count("paris is the") == 2, r.stdout + r.stderr
    r = kiln_cli("inspect", "org/absent", env=env)
    assert r.returncode == 1
    assert "org/absent is not a local directory and not in the HF cache" in r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
