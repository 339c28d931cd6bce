"""enough_prefix: tokenizing a long row's prefix keeps exactly the tokens of tokenizing the whole row and
truncating (ids, type ids, offsets), for a byte-level BPE and a lower-casing WordPiece with [CLS]/[SEP],
single texts and pairs, first prefixes that end mid-word, and a row that is one giant word (tokenized
whole). The control: a plain cut mid-word changes the kept tokens, which is what the check guards."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE, WordPiece
from tokenizers.trainers import BpeTrainer, WordPieceTrainer

from kiln.data.prefix import enough_prefix
from tests.data.tokdata import make_docs

MAX = 8  # tokens kept: the first prefix tried is 256 characters


def _bpe() -> Tokenizer:
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(make_docs(200, 1), BpeTrainer(vocab_size=500, show_progress=False,
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _wordpiece() -> Tokenizer:
    tok = Tokenizer(WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.train_from_iterator(make_docs(200, 2), WordPieceTrainer(vocab_size=400, show_progress=False,
                                                                special_tokens=["[UNK]", "[CLS]", "[SEP]"]))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))])
    return tok


@pytest.fixture(scope="module", params=["bpe", "wordpiece"])
def backend(request) -> Tokenizer:
    tok = _bpe() if request.param == "bpe" else _wordpiece()
    tok.enable_truncation(MAX)
    return tok


def _rows() -> list[str]:
    """Long rows; in each the first prefix tried (256 characters) ends inside a word, some of them inside the
    kept tokens' reach only after a long word (so the prefix must grow)."""
    rng = random.Random(0)
    out = []
    for i in range(24):
        words = " ".join(make_docs(40, 10 + i)).split()
        if i % 3 == 1:
            words[1] = "Ab" * 200  # a 400-character word among the first: 256 characters do not settle
        text = " ".join(w.capitalize() if rng.random() < 0.2 else w for w in words)
        if text[255].isspace() or text[256].isspace():  # a cut mid-word
            text = text[:255] + "xy" + text[255:]
        out.append(text)
    return out


def _same(a, b) -> bool:
    return (a.ids, a.type_ids, a.offsets) == (b.ids, b.type_ids, b.offsets)


def test_prefix_keeps_the_whole_rows_tokens(backend):
    shorter = 0
    for text in _rows():
        kept = enough_prefix(backend, text)
        assert text.startswith(kept)
        shorter += len(kept) < len(text)
        assert _same(backend.encode(kept), backend.encode(text)), text[:80]
    assert shorter == len(_rows())  # every row was cut: the check ran on real cuts
    assert backend.truncation["max_length"] == MAX  # the truncation the caller set is back


def test_pairs_keep_the_whole_pairs_tokens(backend):
    """Text pairs, truncated longest-first: each side's prefix keeps the pair's tokens. (The whole pair's
    encoding builds every combination of both sides' overflowing pieces, so the rows here are kept short.)"""
    backend.enable_truncation(32)
    try:
        shorter = 0
        for text in _rows()[:8]:
            a, b = text[:900], text[:700][::-1]
            cut_a, cut_b = enough_prefix(backend, a), enough_prefix(backend, b)
            shorter += (len(cut_a) < len(a)) + (len(cut_b) < len(b))
            assert _same(backend.encode(cut_a, cut_b), backend.encode(a, b)), a[:80]
        assert shorter >= 8  # the rows with a 400-character word near the start are kept whole
    finally:
        backend.enable_truncation(MAX)


def test_one_giant_word_is_tokenized_whole(backend):
    text = "ab" * 3000
    assert enough_prefix(backend, text) == text


def test_control_a_cut_mid_word_changes_the_kept_tokens(backend):
    """Cut inside the word that holds the last kept token: the kept tokens differ, so the tests above can fail."""
    text = "supercalifragilistic " * 3 + "antidisestablishmentarianism " * 40
    whole = backend.encode(text)
    start, _end = next((a, b) for a, b in reversed(whole.offsets) if b - a >= 2)  # a kept token of 2+ characters
    assert not _same(backend.encode(text[:start + 1]), whole)


def test_every_cut_the_rule_accepts_keeps_the_tokens(backend):
    """The rule itself, at every cut of a row of words the tokenizers know whole: where it calls the
    leading tokens settled, they are the whole row's; and it refuses the cuts where they are not (a rule that
    only counted tokens would accept some of those)."""
    from kiln.data.prefix import _leading_tokens_settled

    text = "the cat sat on a mat while dogs ran past red houses and blue cars in the rain " * 5
    whole = backend.encode(text)
    how = backend.truncation
    backend.no_truncation()
    try:
        plain = [backend.encode(text[:k], add_special_tokens=False) for k in range(1, len(text))]
    finally:
        backend.enable_truncation(**how)
    settled = wrong = 0
    for k, enc in enumerate(plain, 1):
        same = _same(backend.encode(text[:k]), whole)
        if _leading_tokens_settled(enc, k, MAX):
            settled += 1
            assert same, k
        elif len(enc.ids) > MAX - 2 and not same:  # [CLS]/[SEP] leave the WordPiece row 6 of its own
            wrong += 1  # enough tokens, but the cut changed the kept ones: refused, rightly
    assert settled > 100 and wrong > 0, (settled, wrong)
