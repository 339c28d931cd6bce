"""`kiln tokenize`: formats in, shards and manifest out, worker-count independence, bad input by message."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from kiln.data.shards import ShardError, ShardSet, check_tokenizer, file_sha256, read_manifest, tokenizer_digest
from kiln.data.tokenize import TokenizeOptions, tokenize_to_shards
from kiln.errors import KilnError
from kiln.hub import Tokenizer
from tests.data.tokdata import kiln, make_docs


def _split_docs(root, split, eos):
    """The documents of a split, read back from its shards with plain numpy."""
    m = read_manifest(root)
    ids = np.concatenate([np.load(root / s["file"]) for s in m["splits"][split]["shards"]])
    ends = np.flatnonzero(ids == eos)
    assert ends[-1] == len(ids) - 1, "every document, the last one too, ends with EOS"
    return [ids[a + 1:b] for a, b in zip(np.concatenate([[-1], ends[:-1]]), ends)]


def test_formats_in_documents_back_out(tmp_path, tok_dir):
    docs = make_docs(90, 5)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("".join(json.dumps({"body": t, "n": i}) + "\n" for i, t in enumerate(docs[:30])))
    pq.write_table(pa.table({"body": docs[30:50]}), tmp_path / "in" / "b.parquet", row_group_size=7)
    feather.write_feather(pa.table({"body": docs[50:70]}), tmp_path / "in" / "c.arrow")
    for i, t in enumerate(docs[70:]):
        (tmp_path / "in" / f"d{i:02d}.txt").write_text(t)

    out = tmp_path / "shards"
    m = tokenize_to_shards([tmp_path / "in"], tok_dir, out,
                           TokenizeOptions(text_field="body", val_fraction=0.2, seed=1, shard_tokens=500, progress=False))
    tok = Tokenizer.from_dir(tok_dir)
    eos = tok.backend.token_to_id("<|endoftext|>")
    assert m["dtype"] == "uint16" and m["eos_id"] == eos and m["documents"] == 90
    train, val = _split_docs(out, "train", eos), _split_docs(out, "val", eos)
    assert len(train) + len(val) == 90 and 5 < len(val) < 35    # whole documents, about a fifth held out
    decoded = sorted(tok.decode(d.tolist()) for d in train + val)
    assert decoded == sorted(docs)                              # every document, byte for byte, once
    for split in ("train", "val"):
        s = m["splits"][split]
        assert s["tokens"] == sum(e["tokens"] for e in s["shards"])
        for e in s["shards"]:
            assert np.load(out / e["file"]).dtype == np.uint16
            assert file_sha256(out / e["file"]) == e["sha256"]
    assert len(m["splits"]["train"]["shards"]) > 3               # cut at ~500 tokens, on document ends
    assert m["tokenizer"]["sha256"] == tokenizer_digest(tok.backend.to_str())
    ShardSet(out, "train").verify()


def test_worker_count_does_not_change_the_shards(tmp_path, tok_dir):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in make_docs(300, 2)))
    sums = []
    for workers in (1, 2):
        m = tokenize_to_shards([path], tok_dir, tmp_path / f"w{workers}",
                               TokenizeOptions(val_fraction=0.1, shard_tokens=2000, workers=workers, batch_docs=16,
                                               progress=False))
        sums.append([(e["file"], e["sha256"]) for s in m["splits"].values() for e in s["shards"]])
    assert sums[0] == sums[1] and len(sums[0]) > 4


def test_cli_tokenize_and_missing_text_field_names_the_line(tmp_path, tok_dir):
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "a cat"}\n\n{"text": "the dog"}\n{"title": "no body", "id": 3}\n')
    p = kiln("tokenize", str(path), "--tokenizer", str(tok_dir / "tokenizer.json"), "--out", str(tmp_path / "o"),
             "--eos", "<|endoftext|>", "--no-progress", check=False)
    assert p.returncode == 1
    assert f"{path}:4: no field 'text' (fields here: id, title)" in " ".join(p.stderr.split())
    assert not (tmp_path / "o" / "manifest.json").exists()

    path.write_text('{"text": "a cat"}\n{"text": "the dog"}\n')
    p = kiln("tokenize", str(path), "-t", str(tok_dir), "-o", str(tmp_path / "o"), "--no-progress", "--overwrite")
    assert "train: 2 documents" in p.stdout and "uint16" in p.stdout
    with pytest.raises(KilnError, match=r"already holds token shards \(train-00000.npy, ...\); pass --overwrite"):
        tokenize_to_shards([path], tok_dir, tmp_path / "o", TokenizeOptions(progress=False))


def test_vocab_too_large_for_dtype(tmp_path, tok_dir):
    big = HFTokenizer(WordLevel({f"w{i}": i for i in range(70_000)}, unk_token="w0"))
    (tmp_path / "big").mkdir()
    big.save(str(tmp_path / "big" / "tokenizer.json"))
    (tmp_path / "in.txt").write_text("w1 w2")
    with pytest.raises(ShardError, match=r"vocabulary has 70000 ids but uint16 holds only 65536 .*use uint32"):
        tokenize_to_shards([tmp_path / "in.txt"], tmp_path / "big", tmp_path / "o",
                           TokenizeOptions(dtype="uint16", eos="w0", progress=False))
    m = tokenize_to_shards([tmp_path / "in.txt"], tmp_path / "big", tmp_path / "o", TokenizeOptions(eos="w0", progress=False))
    assert m["dtype"] == "uint32"
    # a manifest edited to claim a narrower dtype than its vocabulary allows is refused on read
    manifest = json.loads((tmp_path / "o" / "manifest.json").read_text())
    (tmp_path / "o" / "manifest.json").write_text(json.dumps({**manifest, "dtype": "uint16"}))
    with pytest.raises(ShardError, match=r"vocab_size 70000 does not fit dtype uint16"):
        read_manifest(tmp_path / "o")


@pytest.fixture()
def shard_dir(tmp_path, tok_dir):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in make_docs(60, 4)))
    out = tmp_path / "s"
    tokenize_to_shards([path], tok_dir, out, TokenizeOptions(shard_tokens=400, progress=False))
    return out


def test_empty_and_truncated_shards(shard_dir):
    first = shard_dir / "train-00001.npy"
    data = first.read_bytes()
    first.write_bytes(data[:-10])
    with pytest.raises(ShardError, match=rf"{first}: truncated or altered: {len(data) - 10} bytes, expected {len(data)}"):
        ShardSet(shard_dir, "train")
    first.write_bytes(b"")
    with pytest.raises(ShardError, match=rf"{first}: empty shard \(0 bytes\)"):
        ShardSet(shard_dir, "train")
    first.write_bytes(data[:-2] + b"\x01\x02")            # same size, other contents: only sha256 tells
    with pytest.raises(ShardError, match=rf"{first}: contents do not match the sha256"):
        ShardSet(shard_dir, "train").verify()
    with pytest.raises(ShardError, match=r"no shards in split 'val' \(splits with shards: train\)"):
        ShardSet(shard_dir, "val")


def test_manifest_of_another_tokenizer_is_refused(shard_dir, tmp_path):
    from tests.data.tokdata import make_tokenizer_dir

    other = Tokenizer.from_dir(make_tokenizer_dir(tmp_path / "other", vocab_size=280))
    with pytest.raises(ShardError, match=r"tokenized with .*bpe .*not with the run's tokenizer other .*re-run `kiln tokenize`"):
        check_tokenizer(shard_dir, read_manifest(shard_dir), tokenizer_digest(other.backend.to_str()), "other")


def test_bad_utf8_and_missing_column(tmp_path, tok_dir):
    (tmp_path / "bad.txt").write_bytes(b"caf\xe9 au lait")
    with pytest.raises(KilnError, match=r"bad.txt: not UTF-8 at byte 3 .*--encoding-errors replace"):
        tokenize_to_shards([tmp_path / "bad.txt"], tok_dir, tmp_path / "o", TokenizeOptions(progress=False))
    pq.write_table(pa.table({"content": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(KilnError, match=r"t.parquet: no column 'text' \(columns: content\)"):
        tokenize_to_shards([tmp_path / "t.parquet"], tok_dir, tmp_path / "o2", TokenizeOptions(progress=False))
