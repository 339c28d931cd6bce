"""Records to model inputs for the encoder tasks: sequence/token classification and extractive QA.

Each example becomes a dict of 1-D int tensors (unpadded); `kiln.data.loader.pad_collate` pads a
batch. Word-level tags go to each word's first sub-token (the rest get -100, as HF does); QA
answers are located through the tokenizer's character offsets.

Values are checked by kind before they are encoded, never turned into text: a text field must be a
string; a class label a string or an integer (1.0 is the integer 1, so `1` and `1.0` are one class);
null, lists, objects, booleans, fractions, NaN and infinities are refused naming file:line and field.
A label set of one name is a regression head (transformers reads num_labels = 1 so): there each
label must be a finite number (a CSV's numeric text included) and is encoded as a float target.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kiln.constants import IGNORE_INDEX
from kiln.data.prefix import enough_prefix
from kiln.data.records import Record
from kiln.errors import KilnError
from kiln.hub import Tokenizer

Example = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Fields:
    text: str = "text"
    text_pair: str | None = None
    label: str = "label"
    tokens: str = "tokens"
    question: str = "question"
    context: str = "context"
    answers: str = "answers"


def fields_of(data: Any) -> Fields:
    """The field names a [data] section (anything with `text_field`, `label_field`, ... attributes) sets."""
    return Fields(text=data.text_field, text_pair=data.text_pair_field, label=data.label_field,
                  tokens=data.tokens_field, question=data.question_field, context=data.context_field,
                  answers=data.answers_field)


def _as_list(value: Any, where: str, name: str) -> list:
    if not isinstance(value, list):
        raise KilnError(f"{where}: field {name!r} must be a list, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    """How a JSON value reads in a message: null, a list, 0.5 ..."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, (list, dict)):
        shown = repr(value)
        return f"{'a list' if isinstance(value, list) else 'an object'} ({shown[:60]}{'...' if len(shown) > 60 else ''})"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    return type(value).__name__


def text_value(value: Any, where: str, name: str) -> str:
    """A text field's string; anything else (null, a number, a list) is refused, never written out as "None"."""
    if not isinstance(value, str):
        raise KilnError(f"{where}: field {name!r} must be a string, got {_kind(value)}")
    return value


def label_key(value: Any, where: str, name: str) -> str:
    """A class label's name in the label set: a string as it is, an integer (or an integral float: 1.0
    is 1) as its digits. Everything else is refused, naming what it is."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return str(int(value))
    hint = ""
    if isinstance(value, float) and math.isfinite(value):
        hint = "; a number to regress on needs a regression head: model.num_labels = 1"
    elif isinstance(value, list):
        hint = "; a record has one class label here (tags per word are token-classification)"
    raise KilnError(f"{where}: field {name!r} must be a class label (a string or an integer), got {_kind(value)}{hint}")


def regression_target(value: Any, where: str, name: str) -> float:
    """A regression label: a finite number, or text that reads as one (CSV cells are text)."""
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if number is None or not math.isfinite(number):
        raise KilnError(f"{where}: field {name!r} must be a finite number for this regression head "
                        f"(num_labels = 1), got {_kind(value) if not isinstance(value, str) else repr(value)}")
    return number


def collect_labels(records: list[Record], field: str, per_token: bool = False) -> list[str]:
    """The sorted set of label names used in the data (for a label set the config does not give);
    `per_token`: each record's `field` is a list of tags."""
    seen: set[str] = set()
    for r in records:
        value = r.get(field)
        values = _as_list(value, r.where, field) if per_token else [value]
        seen.update(label_key(v, r.where, field) for v in values)
    if all(s.lstrip("-").isdigit() for s in seen):  # integer labels: 2 before 10
        return sorted(seen, key=int)
    return sorted(seen)


def _label_id(value: Any, label2id: dict[str, int], where: str, name: str = "label") -> int:
    key = label_key(value, where, name)
    if key not in label2id:
        raise KilnError(f"{where}: label {key!r} is not in the label set [{', '.join(label2id)}]")
    return label2id[key]


def _tensors(enc: Any) -> Example:
    return {"input_ids": torch.tensor(enc.ids, dtype=torch.long),
            "token_type_ids": torch.tensor(enc.type_ids, dtype=torch.long)}


@contextlib.contextmanager
def _truncating(tokenizer: Tokenizer, max_length: int, **how: Any) -> Iterator[Any]:
    """The tokenizer's backend truncating to `max_length` inside the block, as it was after it."""
    backend = tokenizer.backend
    backend.enable_truncation(max_length, **how)
    try:
        yield backend
    finally:
        backend.no_truncation()


def encode_sequence_classification(records: list[Record], tokenizer: Tokenizer, labels: list[str] | None,
                                   fields: Fields, max_length: int) -> list[Example]:
    """Text (and text pair) -> ids, the record's label name -> its index in `labels`; with one label
    (num_labels = 1, a regression head) the label's number -> a float target."""
    label2id = {name: i for i, name in enumerate(labels or [])}
    regression = len(label2id) == 1
    out: list[Example] = []
    with _truncating(tokenizer, max_length) as backend:
        for r in records:
            text = enough_prefix(backend, text_value(r.get(fields.text), r.where, fields.text))
            e = (backend.encode(text, enough_prefix(backend, text_value(r.get(fields.text_pair), r.where,
                                                                        fields.text_pair)))
                 if fields.text_pair else backend.encode(text))
            ex = _tensors(e)
            value = r.get(fields.label)
            ex["labels"] = (torch.tensor(regression_target(value, r.where, fields.label), dtype=torch.float32)
                            if regression else torch.tensor(_label_id(value, label2id, r.where, fields.label)))
            out.append(ex)
    return out


def encode_token_classification(records: list[Record], tokenizer: Tokenizer, labels: list[str] | None,
                                fields: Fields, max_length: int) -> list[Example]:
    """Pre-split words and one tag per word; each word's first sub-token carries its tag, the rest are ignored."""
    label2id = {name: i for i, name in enumerate(labels or [])}
    out: list[Example] = []
    with _truncating(tokenizer, max_length) as backend:
        for r in records:
            words = [text_value(w, r.where, f"{fields.tokens}[{i}]")
                     for i, w in enumerate(_as_list(r.get(fields.tokens), r.where, fields.tokens))]
            tags = _as_list(r.get(fields.label), r.where, fields.label)
            if len(tags) != len(words):
                raise KilnError(f"{r.where}: {len(words)} tokens but {len(tags)} labels")
            tag_ids = [_label_id(t, label2id, r.where, f"{fields.label}[{i}]") for i, t in enumerate(tags)]
            e = backend.encode(words, is_pretokenized=True)
            ex = _tensors(e)
            lab, prev = [], None
            for wid in e.word_ids:
                lab.append(IGNORE_INDEX if wid is None or wid == prev else tag_ids[wid])
                prev = wid
            ex["labels"] = torch.tensor(lab, dtype=torch.long)
            out.append(ex)
    return out


def encode_question_answering(records: list[Record], tokenizer: Tokenizer, fields: Fields,
                              max_length: int) -> list[Example]:
    """Question + context -> ids; the answer's character span -> start/end token positions."""
    with _truncating(tokenizer, max_length, strategy="only_second") as backend:
        return [_encode_qa(r, backend, fields) for r in records]


def _encode_qa(r: Record, backend: Any, fields: Fields) -> Example:
    context = text_value(r.get(fields.context), r.where, fields.context)
    answers = r.get(fields.answers)
    if not isinstance(answers, dict) or "text" not in answers or "answer_start" not in answers:
        raise KilnError(f"{r.where}: field {fields.answers!r} must be "
                        '{"text": [...], "answer_start": [...]} (SQuAD layout)')
    texts, starts = answers["text"], answers["answer_start"]
    text, start = (texts[0], starts[0]) if isinstance(texts, list) and isinstance(starts, list) and texts and starts \
        else (texts, starts)
    text = text_value(text, r.where, f"{fields.answers}.text")
    if not isinstance(start, int) or isinstance(start, bool) or start < 0:
        raise KilnError(f"{r.where}: field '{fields.answers}.answer_start' must be a character offset (an integer "
                        f">= 0), got {_kind(start) if not isinstance(start, str) else repr(start)}")
    end = start + len(text)
    if context[int(start):end] != text:
        raise KilnError(f"{r.where}: answer {text!r} is not at character {start} of the context")
    enc = backend.encode(text_value(r.get(fields.question), r.where, fields.question), enough_prefix(backend, context))
    ex = _tensors(enc)
    s_tok = e_tok = 0  # an answer cut off by truncation points at [CLS], as HF does
    for i, (seq, (a, b)) in enumerate(zip(enc.sequence_ids, enc.offsets)):
        if seq != 1:
            continue
        if a <= int(start) < b and s_tok == 0:
            s_tok = i
        if a < end <= b:
            e_tok = i
    if s_tok == 0 or e_tok == 0:
        s_tok = e_tok = 0
    ex["start_positions"] = torch.tensor(s_tok)
    ex["end_positions"] = torch.tensor(e_tok)
    return ex
