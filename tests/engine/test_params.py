"""SamplingParams.validate: every bad value is caught with a message naming the field and the value."""

import math
import re

import pytest

from kiln.engine.params import SamplingParams
from kiln.errors import KilnError


def test_defaults_and_good_values_pass():
    SamplingParams().validate()
    SamplingParams(temperature=0.0, top_k=50, top_p=0.5, min_p=1.0, repetition_penalty=1.3,
                   presence_penalty=-2.0, frequency_penalty=2.0, seed=-7, stop_token_ids=(0, 99),
                   stop=("\n",), logprobs=True, top_logprobs=20, n=4, max_tokens=1).validate(vocab_size=100)


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", math.nan),
    ("min_p", -0.01), ("min_p", 1.5),
    ("top_k", -1),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("presence_penalty", math.nan), ("frequency_penalty", -math.inf),
    ("max_tokens", 0), ("n", 0), ("top_logprobs", 21), ("top_logprobs", -1),
    ("max_tokens", 2.0), ("n", True), ("temperature", "1"), ("seed", 1.5), ("logprobs", 1),
    ("stop", ("",)), ("stop", (1,)), ("stop_token_ids", (-1,)), ("stop_token_ids", ("3",)),
])
def test_bad_value_names_field_and_value(field, value):
    extra = {"logprobs": True} if field == "top_logprobs" else {}
    with pytest.raises(KilnError, match=rf"SamplingParams\.{field}={re.escape(repr(value))}: must be"):
        SamplingParams(**{field: value}, **extra).validate()


def test_stop_token_ids_checked_against_vocab():
    SamplingParams(stop_token_ids=(99,)).validate()
    with pytest.raises(KilnError, match=r"stop_token_ids.*100\).*100 is not"):
        SamplingParams(stop_token_ids=(100,)).validate(vocab_size=100)


def test_top_logprobs_needs_logprobs():
    with pytest.raises(KilnError, match="top_logprobs=3 needs logprobs=True"):
        SamplingParams(top_logprobs=3).validate()


def test_lists_become_tuples_and_one_stop_string_is_one_stop():
    p = SamplingParams(stop="</s>", stop_token_ids=[1, 2])
    assert p.stop == ("</s>",) and p.stop_token_ids == (1, 2)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    hash(p)  # frozen and hashable
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy
