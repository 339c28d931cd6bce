"""The one JSON / JSONL reader: every error names file:line, in the caller's error class."""

from __future__ import annotations

import pytest

from kiln.errors import ConfigError, KilnError, WeightsError
from kiln.hub.jsonio import iter_jsonl, read_json


def test_read_json_names_the_line_and_raises_the_callers_class(tmp_path):
    good = tmp_path / "good.json"
    good.write_text('{"a": [1, 2]}')
    assert read_json(good, want=dict) == {"a": [1, 2]}
    bad = tmp_path / "bad.json"
    bad.write_text('{\n  "a": 1,\n  "b": ,\n}')
    with pytest.raises(ConfigError, match=r"bad\.json:3: not valid JSON \(Expecting value at column 8\)"):
        read_json(bad, error=ConfigError)
    with pytest.raises(WeightsError, match=r"good\.json: expected a JSON array at the top level, got dict"):
        read_json(good, error=WeightsError, want=list)
    with pytest.raises(KilnError, match=r"nope\.json: no such file"):
        read_json(tmp_path / "nope.json")


def test_iter_jsonl_lines_blanks_and_objects(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"t": "a"}\n\n  \n{"t": "\xc3\xa9"}\r\n')
    assert [(no, row) for no, row, _ in iter_jsonl(path)] == [(1, {"t": "a"}), (4, {"t": "é"})]
    assert [size for _, _, size in iter_jsonl(path)] == [11, 13]
    path.write_text('{"t": 1}\n[1, 2]\n')
    with pytest.raises(KilnError, match=r"rows\.jsonl:2: expected a JSON object per line, got list"):
        list(iter_jsonl(path))
    assert [v for _, v, _ in iter_jsonl(path, objects=False)] == [{"t": 1}, [1, 2]]
    path.write_text('{"t": 1}\n{"t": }\n{"t": 3}\n')
    with pytest.raises(ConfigError, match=r"rows\.jsonl:2: not valid JSON \(Expecting value at column 7\)"):
        list(iter_jsonl(path, error=ConfigError))


def test_iter_jsonl_utf8_errors_and_the_hint(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"t": "ok"}\n{"t": "caf\xe9"}\n')
    with pytest.raises(KilnError, match=r"latin1\.jsonl:2: not valid UTF-8 at byte 10 of the line "
                                        r"\(invalid continuation byte\); pass --fix"):
        list(iter_jsonl(path, hint="pass --fix"))
    assert [r["t"] for _, r, _ in iter_jsonl(path, encoding_errors="replace")] == ["ok", "caf\ufffd"]


def test_a_torn_last_line_is_dropped_only_when_asked_and_only_at_the_end(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"ste')  # the writer was killed mid-line
    assert [r["step"] for _, r, _ in iter_jsonl(path, torn_tail=True)] == [1, 2]
    with pytest.raises(KilnError, match=r"metrics\.jsonl:3: not valid JSON"):
        list(iter_jsonl(path))
    path.write_text('{"step": 1}\n{"ste\n{"step": 3}\n')  # broken in the middle: not a torn write
    with pytest.raises(KilnError, match=r"metrics\.jsonl:2: not valid JSON"):
        list(iter_jsonl(path, torn_tail=True))
