"""Record encoders: word tags on first sub-tokens, QA answer spans from offsets, file:line errors."""

from __future__ import annotations

import json

import pytest

from kiln.data import Fields, collect_labels, read_records
from kiln.data.encode import encode_question_answering, encode_sequence_classification, encode_token_classification
from kiln.errors import KilnError
from kiln.hub import Tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("vocab")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "who", "?", "play",
             "##ing", "paris", "is", "in", "france", "where", "."]
    (d / "vocab.txt").write_text("\n".join(vocab) + "\n")
    return Tokenizer.from_dir(d)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_token_tags_go_to_first_subtoken(tmp_path, tok):
    recs = read_records(_jsonl(tmp_path / "t.jsonl", [{"tokens": ["the", "cat", "playing"], "label": ["O", "B", "O"]}]))
    labels = collect_labels(recs, "label", per_token=True)
    assert labels == ["B", "O"]
    ex = encode_token_classification(recs, tok, labels, Fields(), 32)[0]
    # [CLS] the cat play ##ing [SEP]
    assert ex["input_ids"].tolist() == [2, 5, 6, 12, 13, 3]
    assert ex["labels"].tolist() == [-100, 1, 0, 1, -100, -100]


def test_qa_answer_span_and_truncated_answer(tmp_path, tok):
    ctx = "paris is in france ."
    rows = [{"question": "where is paris ?", "context": ctx, "answers": {"text": ["france"], "answer_start": [12]}}]
    recs = read_records(_jsonl(tmp_path / "q.jsonl", rows))
    ex = encode_question_answering(recs, tok, Fields(), 32)[0]
    ids = ex["input_ids"].tolist()
    assert ids[int(ex["start_positions"])] == 17 and int(ex["start_positions"]) == int(ex["end_positions"])
    short = encode_question_answering(recs, tok, Fields(), 9)[0]  # france cut off
    assert int(short["start_positions"]) == 0 == int(short["end_positions"])
    rows[0]["answers"]["answer_start"] = [3]
    with pytest.raises(KilnError, match=r"q.jsonl:1: answer 'france' is not at character 3 of the context"):
        encode_question_answering(read_records(_jsonl(tmp_path / "q.jsonl", rows)), tok, Fields(), 32)


def test_csv_and_numeric_labels(tmp_path, tok):
    f = tmp_path / "d.csv"
    f.write_text('text,label\n"the cat, on the mat",10\nthe cat sat,2\n')
    recs = read_records(f)
    assert collect_labels(recs, "label") == ["2", "10"]
    exs = encode_sequence_classification(recs, tok, ["2", "10"], Fields(), 32)
    assert [int(e["labels"]) for e in exs] == [1, 0]
    with pytest.raises(KilnError, match=r"d.csv:3: label '2' is not in the label set \[10, 3\]"):
        encode_sequence_classification(recs, tok, ["10", "3"], Fields(), 32)  # (one label: a regression head)


def test_non_object_jsonl_line(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text('{"text": "a", "label": 1}\n\n[1, 2]\n')
    with pytest.raises(KilnError, match=r"x.jsonl:3: expected a JSON object per line, got list"):
        read_records(f)
