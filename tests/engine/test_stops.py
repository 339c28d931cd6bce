"""kiln.engine.stops.Detokenizer on real tokenizers built offline: a byte-level BPE trained in memory on text
with emoji and CJK (its tokens split characters between them) and the packaged MiniLM WordPiece tokenizer."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from kiln.engine.stops import Detokenizer
from kiln.errors import KilnError

CORPUS = ["我的猫很可爱。今天天气很好！", "emoji 🎉🎉 party 😀 and 👍🏽 thumbs", "the cat sat on the mat </s> done",  # noqa: RUF001 - the full-width mark is the test data (CJK text)
          "naïve café 日本語のテキスト"]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=400, special_tokens=["<|end|>"], show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


def run(tok, ids, stop=(), prompt=(), skip=True) -> tuple[Detokenizer, list[str], list[bool]]:
    det = Detokenizer(tok, list(prompt), stop, skip_special_tokens=skip)
    deltas, flags = [], []
    for t in ids:
        d, s = det.push(t)
        deltas.append(d)
        flags.append(s)
    return det, deltas, flags


@pytest.mark.parametrize("text", ["猫猫 日本", "🎉 party 😀👍🏽 and more", "naïve café 日本語のテキスト 我的猫很可爱",
                                  "plain ascii text, no surprises", "👍🏽👍🏽👍🏽"])
def test_incremental_text_is_the_whole_decode_and_never_half_a_character(bpe, text):
    ids = bpe.encode(text).ids
    det, deltas, flags = run(bpe, ids)
    rest = det.finish()
    assert "".join(deltas) + rest == bpe.decode(ids) == text
    assert det.text == text and not any(flags) and rest == ""
    assert not any("\ufffd" in d for d in deltas)


def test_the_tokenizer_does_split_characters(bpe):
    # the control for the test above: these texts have tokens that decode alone to half a character
    for text in ("猫猫 日本", "🎉 party 😀👍🏽 and more"):
        assert any("\ufffd" in bpe.decode([t]) for t in bpe.encode(text).ids)


def test_prompt_context_and_the_first_token(bpe):
    prompt, out = bpe.encode("the cat").ids, bpe.encode(" sat on 日本").ids
    det, deltas, _ = run(bpe, out, prompt=prompt)
    assert "".join(deltas) + det.finish() == " sat on 日本"


def test_stop_string_split_across_three_tokens(bpe):
    ids = bpe.encode("xyz </s> q").ids
    pieces = [bpe.decode([t]) for t in ids]
    assert pieces[3:6] == [" </", "s", ">"]  # "</s>" spans three tokens, the first with a space before it
    det, deltas, flags = run(bpe, ids, stop=["</s>"])
    assert flags == [False] * 5 + [True, True, True]
    assert deltas[:6] == ["x", "y", "z", " ", "", ""]  # "</" and "</s" held back until decided
    assert det.text == "xyz " and det.stop_string == "</s>"
    assert det.push(ids[0]) == ("", True) and det.finish() == "" and det.text == "xyz "


def test_stop_string_made_of_split_characters(bpe):
    ids = bpe.encode("猫猫 日本 more").ids
    for stop, before in (("日本", "猫猫 "), ("本", "猫猫 日"), ("猫 日", "猫"), ("猫", "")):
        det, deltas, flags = run(bpe, ids, stop=[stop])
        assert det.text == before and "".join(deltas) == before and det.stop_string == stop
        assert not any("\ufffd" in d for d in deltas)
        assert flags.index(True) < len(ids)


def test_several_stop_strings_the_first_to_complete_wins(bpe):
    ids = bpe.encode("the cat sat on the mat").ids
    det, _, _ = run(bpe, ids, stop=["mat", "sat", "zzz"])
    assert det.text == "the cat " and det.stop_string == "sat"
    # "at" completes (in "cat") before "cat sat on" does, though the longer one starts first
    det, _, _ = run(bpe, ids, stop=["cat sat on", "at"])
    assert det.text == "the c" and det.stop_string == "at"


def test_no_stop_emits_everything_and_finish_releases_the_held_start(bpe):
    ids = bpe.encode("abc </").ids
    det, deltas, flags = run(bpe, ids, stop=["</s>", "zz"])
    assert not any(flags) and det.text == "abc " and "".join(deltas) == "abc "
    assert det.finish() == "</" and det.text == "abc </" and det.stop_string is None
    det, deltas, _ = run(bpe, bpe.encode("the mat").ids, stop=["mat!"])
    assert det.text == "the " and det.finish() == "mat"


def test_an_incomplete_character_at_the_end_is_released_by_finish(bpe):
    ids = bpe.encode("ok 猫猫 日本").ids[:-1]  # the last character's last byte(s) never come
    assert bpe.decode(ids).endswith("\ufffd")
    det, _deltas, _ = run(bpe, ids)
    assert "\ufffd" not in det.text and det.text.startswith("ok 猫猫")
    assert det.finish().endswith("\ufffd") and det.text == bpe.decode(ids)


def test_skip_special_tokens(bpe):
    end = bpe.token_to_id("<|end|>")
    ids = bpe.encode("the cat").ids + [end] + bpe.encode(" sat").ids
    assert run(bpe, ids)[0].text == "the cat sat"
    assert run(bpe, ids, skip=False)[0].text == "the cat<|end|> sat"


def test_wordpiece_pieces_join_as_the_whole_decode(minilm_dir):
    from kiln.hub import Tokenizer as KilnTokenizer

    tok = KilnTokenizer.from_dir(minilm_dir)
    prompt = tok.backend.encode("a question:", add_special_tokens=False).ids
    out = tok.backend.encode("tokenization splits unbelievably long words", add_special_tokens=False).ids
    assert any(tok.id_to_token(t).startswith("##") for t in out)  # "##" pieces join their word
    det, deltas, _ = run(tok, out, prompt=prompt)
    whole = tok.decode(prompt + out)
    assert whole.endswith("".join(deltas) + det.finish()) and det.text == " " + tok.decode(out)


def test_bad_stop_strings_are_named(bpe):
    with pytest.raises(KilnError, match="stop strings must be non-empty"):
        Detokenizer(bpe, [], ["ok", ""])
