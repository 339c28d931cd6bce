"""Every input a run reads is read or refused (issue 41, class 1): a token shard, document, records file or image
behind a dangling symbolic link (an unmounted NFS path), a folder where a file belongs, or an empty image is
refused naming it, by `kiln train`, `kiln tokenize DIR` and `kiln launch`, before anything is written. Each case
asserts the exit code, the message and that nothing under the case's folder changed (links seen as links)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from kiln.hub.files import UnreadableInput, check_readable, folder_files
from tests.cli.bad_inputs_world import write_toml
from tests.cli.reliability_world import pretrain_config, raw_shards, run_cli, snapshot
from tests.kiln_cli import kiln_cli

PIL = pytest.importorskip("PIL.Image")


def test_folder_files_refuses_every_unreadable_entry(tmp_path):
    for name in ("a.bin", "b.bin", "notes.txt"):
        (tmp_path / name).write_bytes(b"xx")
    (tmp_path / "c.bin").symlink_to("/mnt/unmounted/c.bin")
    (tmp_path / "d.bin").mkdir()
    (tmp_path / "ignored.tmp").symlink_to("/mnt/unmounted/x")  # not selected: not the folder's data
    with pytest.raises(UnreadableInput) as e:
        folder_files(tmp_path, lambda p: p.suffix == ".bin", what="token file")
    msg = str(e.value)
    assert "2 token files of this folder cannot be read" in msg
    assert "c.bin is a dangling symbolic link (to /mnt/unmounted/c.bin" in msg and "d.bin is not a regular file" in msg
    assert "ignored.tmp" not in msg
    (tmp_path / "c.bin").unlink()
    (tmp_path / "d.bin").rmdir()
    assert [p.name for p in folder_files(tmp_path, lambda p: p.suffix == ".bin")] == ["a.bin", "b.bin"]
    # a control: a link to a file that exists is read like the file
    (tmp_path / "e.bin").symlink_to(tmp_path / "a.bin")
    assert [p.name for p in folder_files(tmp_path, lambda p: p.suffix == ".bin")] == ["a.bin", "b.bin", "e.bin"]
    (tmp_path / "empty.png").write_bytes(b"")
    with pytest.raises(UnreadableInput, match="empty.png: the image is empty"):
        check_readable(tmp_path / "empty.png", "image", empty_ok=False)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads a mode-000 file")
def test_an_unreadable_shard_is_named(tmp_path):
    raw_shards(tmp_path / "tok", 2)
    os.chmod(tmp_path / "tok" / "shard-001.bin", 0)
    with pytest.raises(UnreadableInput, match=r"shard-001.bin cannot be opened \(Permission denied\)"):
        folder_files(tmp_path / "tok", lambda p: p.suffix == ".bin")


def _dangle(folder: Path, *names: str) -> None:
    for name in names:
        (folder / name).unlink(missing_ok=True)
        (folder / name).symlink_to(f"/nfs/unmounted/{name}")


def test_train_refuses_a_token_folder_with_a_dangling_shard(tmp_path):
    tok = raw_shards(tmp_path / "tok", 4)
    _dangle(tok, "shard-001.bin", "shard-003.bin")
    cfg = pretrain_config(tmp_path / "run.toml", tok, tmp_path / "out")
    before = snapshot(tmp_path)
    code, out = run_cli("train", "--config", cfg)
    assert code == 1, out
    assert "2 token files of this folder cannot be read, so the run would silently use part of its data" in out
    assert "shard-001.bin is a dangling symbolic link (to /nfs/unmounted/shard-001.bin" in out and "shard-003.bin" in out
    assert "Traceback" not in out and snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_train_refuses_a_named_dangling_token_file_and_a_folder_named_like_a_shard(tmp_path):
    tok = raw_shards(tmp_path / "tok", 2)
    (tmp_path / "gone.bin").symlink_to("/nfs/unmounted/gone.bin")
    (tok / "shard-009.bin").mkdir()
    before = snapshot(tmp_path)
    code, out = run_cli("train", "--config", pretrain_config(tmp_path / "a.toml", tmp_path / "gone.bin", tmp_path / "o"))
    # named at config load, before a recipe is picked by what the path is
    assert code == 1 and "data.train " in out and "gone.bin: a dangling symbolic link" in out, out
    code, out = run_cli("train", "--config", pretrain_config(tmp_path / "b.toml", tok, tmp_path / "o"))
    assert code == 1 and "shard-009.bin is not a regular file" in out, out
    before.pop("a.toml", None), before.pop("b.toml", None)
    after = snapshot(tmp_path)
    after.pop("a.toml"), after.pop("b.toml")
    assert after == before and not (tmp_path / "o").exists()


def test_tokenize_refuses_a_folder_with_dangling_documents(tmp_path, tiny_factory):
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(5):
        (docs / f"doc{i}.txt").write_text(f"the cat sat on the mat {i}\n")
    _dangle(docs, "doc1.txt", "doc4.txt")
    (docs / "sub").mkdir()
    _dangle(docs / "sub", "deep.jsonl")
    tok = tiny_factory("qwen3", "causal-lm")
    before = snapshot(tmp_path)
    code, out = run_cli("tokenize", docs, "--tokenizer", tok, "--out", tmp_path / "shards", "--no-progress")
    assert code == 1, out
    assert "3 document files of this folder cannot be read" in out, out
    assert all(n in out for n in ("doc1.txt", "doc4.txt", "sub/deep.jsonl")), out
    assert snapshot(tmp_path) == before and not (tmp_path / "shards").exists()


def test_records_file_behind_a_dangling_link_is_named(tmp_path, tiny_factory):
    cls = tiny_factory("bert", "sequence-classification")
    (tmp_path / "train.jsonl").symlink_to("/nfs/unmounted/train.jsonl")
    cfg = write_toml(tmp_path / "run.toml", {
        "model": {"path": cls, "task": "sequence-classification"},
        "data": {"train": tmp_path / "train.jsonl", "max_length": 16},
        "train": {"out_dir": tmp_path / "out", "steps": 1, "batch_size": 2, "progress": False, "device": "cpu"}})
    before = snapshot(tmp_path)
    code, out = run_cli("train", "--config", cfg)
    assert code == 1 and "train.jsonl: a dangling symbolic link (to /nfs/unmounted/train.jsonl" in out, out
    assert snapshot(tmp_path) == before


VIT = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48, image_size=8,
           patch_size=4, num_channels=3)


def _images(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    for label in ("a", "b"):
        (tmp_path / "train" / label).mkdir(parents=True)
        for i in range(4):
            PIL.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), mode="L").save(
                tmp_path / "train" / label / f"{i}.png")
    return tmp_path / "train"


def _vit_config(tmp_path: Path, train: Path) -> Path:
    return write_toml(tmp_path / "vit.toml", {
        "model": {"family": "vit", "task": "image-classification", "config": VIT},
        "data": {"train": train},
        "train": {"out_dir": tmp_path / "out", "steps": 1, "batch_size": 2, "progress": False, "device": "cpu"}})


def test_image_folder_with_a_dangling_or_empty_image_is_refused(tmp_path):
    train = _images(tmp_path)
    _dangle(train / "a", "2.png")
    (train / "b" / "3.png").write_bytes(b"")
    cfg = _vit_config(tmp_path, train)
    before = snapshot(tmp_path)
    code, out = run_cli("train", "--config", cfg)
    assert code == 1 and "2 images of this folder cannot be read" in out, out
    assert "a/2.png is a dangling symbolic link" in out and "b/3.png is empty" in out, out
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_image_records_name_every_unreadable_image_before_encoding(tmp_path):
    train = _images(tmp_path)
    rows = [{"image": f"train/a/{i}.png", "label": "a"} for i in range(4)] + \
           [{"image": "train/b/gone.png", "label": "b"}, {"image": "train/b", "label": "b"}]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    _dangle(train / "b", "gone.png")
    cfg = _vit_config(tmp_path, tmp_path / "rows.jsonl")
    before = snapshot(tmp_path)
    code, out = run_cli("train", "--config", cfg)
    assert code == 1 and "2 images named in" in out, out
    assert "rows.jsonl:5: " in out and "gone.png is a dangling symbolic link" in out, out
    assert "rows.jsonl:6: " in out and "train/b is not a regular file" in out, out
    assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_launch_refuses_a_dangling_shard_once(tmp_path):
    tok = raw_shards(tmp_path / "tok", 4)
    _dangle(tok, "shard-002.bin")
    cfg = pretrain_config(tmp_path / "run.toml", tok, tmp_path / "out")
    before = snapshot(tmp_path)
    p = kiln_cli("launch", "--nproc-per-node", "2", "--", "train", "--config", str(cfg))
    out = " ".join((p.stdout + p.stderr).split())
    assert p.returncode == 1, out
    assert out.count("shard-002.bin is a dangling symbolic link") == 1, out
    assert "Traceback" not in out and snapshot(tmp_path) == before


def test_a_linked_class_folder_is_read_and_a_link_loop_walked_once(tmp_path):
    (tmp_path / "elsewhere" / "b").mkdir(parents=True)
    (tmp_path / "elsewhere" / "b" / "1.png").write_bytes(b"png")
    (tmp_path / "root" / "a").mkdir(parents=True)
    (tmp_path / "root" / "a" / "0.png").write_bytes(b"png")
    (tmp_path / "root" / "b").symlink_to(tmp_path / "elsewhere" / "b")
    (tmp_path / "root" / "a" / "loop").symlink_to(tmp_path / "root")
    names = [p.relative_to(tmp_path / "root").as_posix() for p in
             folder_files(tmp_path / "root", lambda p: p.suffix == ".png", recursive=True)]
    assert names == ["a/0.png", "b/1.png"], names


def test_data_train_a_dangling_link_to_a_folder_is_named_not_taken_for_records(tmp_path):
    """Found by the sweep: the recipe was picked as if the path were a records file ("unknown key data.dtype")."""
    (tmp_path / "tok").symlink_to("/nfs/unmounted/tokdir")
    cfg = pretrain_config(tmp_path / "run.toml", tmp_path / "tok", tmp_path / "out")
    before = snapshot(tmp_path)
    code, out = run_cli("train", "--config", cfg)
    assert code == 1 and "data.train " in out and "tok: a dangling symbolic link (to /nfs/unmounted/tokdir" in out, out
    assert snapshot(tmp_path) == before


def test_an_image_class_folder_behind_a_dangling_link_is_refused(tmp_path):
    """Found by the sweep: class folder b, a link into an unmounted share, was skipped; the run trained on a."""
    train = _images(tmp_path)
    shutil.rmtree(train / "b")
    (train / "b").symlink_to("/nfs/unmounted/b")
    cfg = _vit_config(tmp_path, train)
    before = snapshot(tmp_path)
    code, out = run_cli("train", "--config", cfg)
    assert code == 1 and "1 image of this folder cannot be read" in out, out
    assert "train/b is a dangling symbolic link (to /nfs/unmounted/b" in out, out
    assert snapshot(tmp_path) == before and not (tmp_path / "out").exists()


def test_readers_refuse_a_dangling_file_named_from_python(tmp_path):
    """The same reasons from the Python API, where no run config names the file first."""
    from kiln.data import read_records
    from kiln.data.raw import raw_files
    from kiln.errors import KilnError

    (tmp_path / "gone.bin").symlink_to("/nfs/unmounted/gone.bin")
    (tmp_path / "rows.jsonl").symlink_to("/nfs/unmounted/rows.jsonl")
    with pytest.raises(KilnError, match="gone.bin: the token file is a dangling symbolic link"):
        raw_files(tmp_path / "gone.bin")
    with pytest.raises(KilnError, match="rows.jsonl: data file is a dangling symbolic link"):
        read_records(tmp_path / "rows.jsonl")
