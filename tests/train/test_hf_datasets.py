"""HF datasets sources (kiln.data.hfdata): a save_to_disk folder, parquet, arrow and JSON-array files give the
same rows as the JSONL they were made from (ClassLabel ints as names); fine-tuning, SFT and `kiln tokenize` run
on them; a missing column names the file and the column; a missing `datasets` package names the extra."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from kiln.data import read_records
from kiln.data.tokenize import TokenizeOptions, tokenize_to_shards
from kiln.errors import KilnError
from kiln.train.config import load_run_config
from kiln.train.run import build_trainer
from tests.train.test_sft_train import CHATS, _toml, sft_setup  # noqa: F401  (fixture)
from tests.train.train_helpers import LABELS, make_rows, write_jsonl, write_toml

datasets = pytest.importorskip("datasets")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The same 24 labelled rows as JSONL, a save_to_disk folder (ClassLabel labels), parquet, arrow, a JSON array
    and a DatasetDict."""
    d = tmp_path_factory.mktemp("hf")
    rows = make_rows(24, 5)
    write_jsonl(d / "rows.jsonl", rows)
    features = datasets.Features({"text": datasets.Value("string"), "label": datasets.ClassLabel(names=LABELS)})
    ds = datasets.Dataset.from_dict({"text": [r["text"] for r in rows], "label": [r["label"] for r in rows]},
                                    features=features)
    ds.save_to_disk(str(d / "saved"))
    plain = datasets.Dataset.from_list(rows)
    plain.to_parquet(str(d / "rows.parquet"))
    (d / "rows.json").write_text(json.dumps(rows))
    datasets.DatasetDict(train=ds, test=ds).save_to_disk(str(d / "dict"))
    return d, rows


def test_every_source_reads_as_the_jsonl_rows(sources):
    d, rows = sources
    arrow = next((d / "saved").glob("*.arrow"))
    for path in (d / "saved", d / "rows.parquet", d / "rows.json", arrow, d / "dict" / "train"):
        records = read_records(path)
        assert [r.fields for r in records] == rows, path
        assert records[3].where == f"{path}:row 4"
    assert [r.fields for r in read_records(d / "rows.jsonl")] == rows  # control: the JSONL itself
    with pytest.raises(KilnError, match=r"dict: a DatasetDict with splits test, train; name one folder, e.g. .*dict/train"):
        read_records(d / "dict")
    with pytest.raises(KilnError, match=r"rows.parquet:row 1: no field 'sentence' \(fields here: label, text\)"):
        read_records(d / "rows.parquet")[0].get("sentence")


def test_without_datasets_the_extra_is_named(sources, monkeypatch):
    d, _ = sources
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(KilnError, match=r"saved: reading a datasets folder.*pip install 'kiln\[datasets\]'"):
        read_records(d / "saved")
    assert len(read_records(d / "rows.jsonl")) == 24  # JSONL needs no datasets


@pytest.mark.slow
def test_finetune_and_sft_train_from_datasets_sources(sources, tiny_dir, sft_setup, tmp_path):
    d, _ = sources
    cfg = load_run_config(write_toml(tmp_path / "ft.toml", tiny_dir, d / "saved", d / "rows.parquet",
                                     tmp_path / "ft", steps=2, save_every=0, eval_every=0))
    build_trainer(cfg).fit()
    last = [json.loads(x) for x in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()][-1]
    assert "eval_accuracy" in last

    datasets.Dataset.from_list([{"messages": c} for c in CHATS]).save_to_disk(str(sft_setup / "chats"))
    toml = sft_setup / "sft_ds.toml"
    toml.write_text(_toml(sft_setup, "", "sft_ds").replace('"chat.jsonl"', '"chats"').replace("steps = 12", "steps = 2"))
    build_trainer(load_run_config(toml)).fit()
    assert len((sft_setup / "sft_ds" / "metrics.jsonl").read_text().splitlines()) >= 2


def test_tokenize_reads_a_datasets_folder_like_the_jsonl(sources, sft_setup, tmp_path):
    d, _ = sources
    opts = TokenizeOptions(progress=False)
    a = tokenize_to_shards([d / "saved"], sft_setup / "tok", tmp_path / "a", opts)
    b = tokenize_to_shards([d / "rows.jsonl"], sft_setup / "tok", tmp_path / "b", opts)
    assert a["documents"] == b["documents"] == 24
    shard = a["splits"]["train"]["shards"][0]["file"]
    assert np.array_equal(np.load(tmp_path / "a" / shard), np.load(tmp_path / "b" / shard))
    with pytest.raises(KilnError, match=r"saved: no column 'body' \(columns: text, label\)"):
        tokenize_to_shards([d / "saved"], sft_setup / "tok", tmp_path / "c", TokenizeOptions(text_field="body",
                                                                                            progress=False))
