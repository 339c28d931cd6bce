"""Tokenizers: tokenizer.json and the vocab.txt fallback agree with transformers; save keeps them."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from kiln.errors import KilnError
from kiln.hub import Tokenizer

TEXTS = ["Hello, world!", "Tokenizers handle unaffable words.", "naïve café"]


def test_tokenizer_json_matches_transformers(minilm_dir):
    ours = Tokenizer.from_dir(minilm_dir).encode(TEXTS, pairs=["a pair", "b", "c d e"])
    theirs = transformers.AutoTokenizer.from_pretrained(minilm_dir)(TEXTS, ["a pair", "b", "c d e"], padding=True,
                                                                    return_tensors="pt")
    for key in ("input_ids", "attention_mask", "token_type_ids"):
        assert torch.equal(ours[key], theirs[key]), key


def test_vocab_txt_fallback_equals_tokenizer_json(minilm_dir, tmp_path):
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
        shutil.copy(minilm_dir / name, tmp_path / name)
    from_vocab = Tokenizer.from_dir(tmp_path)
    from_json = Tokenizer.from_dir(minilm_dir)
    a, b = from_vocab.encode(TEXTS), from_json.encode(TEXTS)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert from_vocab.mask_token == "[MASK]"


def test_save_round_trip(minilm_dir, tmp_path):
    tok = Tokenizer.from_dir(minilm_dir)
    tok.save(tmp_path)
    assert (tmp_path / "tokenizer.json").read_bytes() == (minilm_dir / "tokenizer.json").read_bytes()
    again = Tokenizer.from_dir(tmp_path)
    assert torch.equal(again.encode(TEXTS)["input_ids"], tok.encode(TEXTS)["input_ids"])
    assert again.specials == tok.specials
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert hf.mask_token == "[MASK]" and hf("Hello")["input_ids"] == tok.encode("Hello")["input_ids"][0].tolist()


def test_directory_without_tokenizer(tmp_path):
    with pytest.raises(KilnError, match="no tokenizer.json or vocab.txt"):
        Tokenizer.from_dir(tmp_path)
