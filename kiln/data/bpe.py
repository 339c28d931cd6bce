"""Train a byte-level BPE tokenizer (the `tokenizers` library) on text and JSONL files.

Byte-level: every string is encodable (no unknown token), decoding gives the text back. The
special tokens are added as whole tokens with the first ids; the directory written holds
tokenizer.json and a tokenizer_config.json with the special-token roles and a ChatML-style
chat template, so transformers' AutoTokenizer and `apply_chat_template` read it as is.

Input: `.txt` (one text per line) or `.jsonl` (a `text` field, `messages` contents, or
`prompt`/`response`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

from kiln.errors import KilnError
from kiln.hub import CHATML_TEMPLATE, Tokenizer
from kiln.hub.config import write_json_atomic
from kiln.hub.jsonio import iter_jsonl

# role -> token text; pad doubles as the document separator, <|im_end|> ends every chat turn (the EOS)
SPECIALS = {"pad_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
CHAT_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _texts_of(obj: object, where: str, text_field: str) -> Iterator[str]:
    if not isinstance(obj, dict):
        raise KilnError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    if text_field in obj:
        yield str(obj[text_field])
    elif "messages" in obj:
        for m in obj["messages"]:
            yield str(m.get("content", "")) if isinstance(m, dict) else str(m)
    elif "prompt" in obj and "response" in obj:
        yield str(obj["prompt"])
        yield str(obj["response"])
    else:
        raise KilnError(f"{where}: no {text_field!r}, 'messages' or 'prompt'/'response' field")


def iter_texts(paths: Sequence[str | os.PathLike[str]], text_field: str = "text") -> Iterator[str]:
    """Every text in the files, in order; errors name file:line."""
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise KilnError(f"{path}: no such file")
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json", ".ndjson"):
            for no, obj, _ in iter_jsonl(path, objects=False):
                yield from _texts_of(obj, f"{path}:{no}", text_field)
            continue
        with open(path, "rb") as f:
            for no, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise KilnError(f"{path}:{no}: not valid UTF-8 (byte {e.start} of the line); "
                                    "re-encode the file as UTF-8") from None
                if line.strip():
                    yield line.rstrip("\n")


def train_bpe(paths: Sequence[str | os.PathLike[str]], out_dir: str | os.PathLike, vocab_size: int = 4096,
              min_frequency: int = 2, text_field: str = "text", model_max_length: int = 2048,
              extra_special_tokens: tuple[str, ...] = ()) -> Tokenizer:
    """Train on `paths`, write tokenizer.json + tokenizer_config.json + special_tokens_map.json to `out_dir`.
    `extra_special_tokens` (an image-text model's vision tokens, say) get the ids after the chat tokens."""
    specials = CHAT_TOKENS + [t for t in extra_special_tokens if t not in CHAT_TOKENS]
    if vocab_size < 256 + len(specials):
        raise KilnError(f"vocab_size {vocab_size} is too small for a byte-level BPE (at least "
                        f"{256 + len(specials)}: 256 bytes + {len(specials)} special tokens)")
    tok = HFTokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=specials,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(iter_texts(paths, text_field), trainer)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **SPECIALS, "bos_token": None, "unk_token": None,
              "model_max_length": model_max_length, "chat_template": CHATML_TEMPLATE,
              "additional_special_tokens": ["<|im_start|>", *specials[len(CHAT_TOKENS):]], "clean_up_tokenization_spaces": False}
    write_json_atomic(out / "tokenizer_config.json", config)
    write_json_atomic(out / "special_tokens_map.json", dict(SPECIALS))
    return Tokenizer.from_dir(out)
