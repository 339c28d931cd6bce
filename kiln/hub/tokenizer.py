"""Tokenizers through the `tokenizers` library: tokenizer.json, or vocab.txt for a BERT directory.

`Tokenizer` keeps tokenizer_config.json and special_tokens_map.json as read, so a save writes
back what a transformers user expects to find.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import normalizers, pre_tokenizers, processors
from tokenizers.models import WordPiece

from kiln.errors import KilnError
from kiln.hub.config import write_json_atomic
from kiln.hub.files import write_atomic
from kiln.hub.jsonio import read_json

if TYPE_CHECKING:
    from kiln.hub.chat import ChatTemplate

_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # serialised AddedToken
        return value.get("content")
    return value if isinstance(value, str) else None


def _wordpiece_from_vocab(vocab_path: Path, lowercase: bool, specials: dict[str, str]) -> _HFTokenizer:
    """Build the BERT WordPiece pipeline from a vocab.txt, as BertTokenizerFast does."""
    vocab = {}
    for i, line in enumerate(vocab_path.read_text(encoding="utf-8").splitlines()):
        vocab[line.rstrip("\n")] = i
    unk = specials.get("unk_token", "[UNK]")
    tok = _HFTokenizer(WordPiece(vocab, unk_token=unk, max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = specials.get("cls_token", "[CLS]"), specials.get("sep_token", "[SEP]")
    for name in (cls, sep):
        if name not in vocab:
            raise KilnError(f"{vocab_path}: special token {name!r} is not in the vocabulary")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls}:0 $A:0 {sep}:0",
        pair=f"{cls}:0 $A:0 {sep}:0 $B:1 {sep}:1",
        special_tokens=[(cls, vocab[cls]), (sep, vocab[sep])],
    )
    from tokenizers import decoders

    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([t for t in specials.values() if t in vocab])
    return tok


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the special tokens and side files of its HF directory."""

    def __init__(self, tokenizer: _HFTokenizer, config: dict | None = None, special_map: dict | None = None,
                 source_dir: Path | None = None):
        self.backend = tokenizer
        self.config = dict(config or {})
        self.special_map = dict(special_map or {})
        self.source_dir = source_dir
        # No truncation or fixed padding from the file: callers ask for what they need per call.
        self.backend.no_truncation()
        self.backend.no_padding()
        self.specials: dict[str, str] = {}
        for name in _SPECIALS:
            text = _token_text(self.config.get(name)) or _token_text(self.special_map.get(name))
            if text is not None and self.backend.token_to_id(text) is not None:
                self.specials[name] = text

    # ---- loading and saving -------------------------------------------------------------
    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> Tokenizer:
        model_dir = Path(model_dir)
        tc, sm = model_dir / "tokenizer_config.json", model_dir / "special_tokens_map.json"
        config = read_json(tc, want=dict) if tc.is_file() else {}
        smap = read_json(sm, want=dict) if sm.is_file() else {}
        tj = model_dir / "tokenizer.json"
        if tj.is_file():
            try:
                backend = _HFTokenizer.from_file(str(tj))
            except Exception as e:  # noqa: BLE001 - the Rust library reports parse errors as plain Exceptions
                raise KilnError(f"{tj}: cannot be read by the tokenizers library ({e})") from None
        elif (model_dir / "vocab.txt").is_file():
            specials = {n: t for n in _SPECIALS if (t := _token_text(config.get(n) or smap.get(n)))}
            backend = _wordpiece_from_vocab(model_dir / "vocab.txt", bool(config.get("do_lower_case", True)), specials)
        else:
            raise KilnError(f"{model_dir}: no tokenizer.json or vocab.txt in this directory")
        return cls(backend, config, smap, source_dir=model_dir)

    @staticmethod
    def present(model_dir: str | os.PathLike) -> bool:
        d = Path(model_dir)
        return (d / "tokenizer.json").is_file() or (d / "vocab.txt").is_file()

    def save(self, out_dir: str | os.PathLike) -> list[Path]:
        """Write tokenizer.json plus tokenizer_config.json / special_tokens_map.json."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        written = [out / "tokenizer.json"]
        src = self.source_dir / "tokenizer.json" if self.source_dir is not None else None
        if src is not None and src.is_file():
            kept = src  # (narrowed, for the closure)
            write_atomic(written[0], lambda tmp: shutil.copyfile(kept, tmp))  # unchanged: kept byte for byte
        else:
            write_atomic(written[0], lambda tmp: self.backend.save(str(tmp)))
        config = dict(self.config)
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        for name, text in self.specials.items():
            config.setdefault(name, text)
        write_json_atomic(out / "tokenizer_config.json", config)
        written.append(out / "tokenizer_config.json")
        smap = dict(self.special_map) or dict(self.specials)
        write_json_atomic(out / "special_tokens_map.json", smap)
        written.append(out / "special_tokens_map.json")
        if self.source_dir is not None:
            for extra in ("vocab.txt", "sentencepiece.bpe.model", "spm.model", "merges.txt", "vocab.json",
                          "chat_template.jinja"):
                src = self.source_dir / extra
                if src.is_file() and not (out / extra).exists():
                    shutil.copyfile(src, out / extra)
                    written.append(out / extra)
        return written

    # ---- use ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_id(self, name: str) -> int | None:
        """Id of a special token by role (`"mask_token"`, `"pad_token"`, ...), or None."""
        text = self.specials.get(name)
        return None if text is None else self.backend.token_to_id(text)

    @property
    def mask_token(self) -> str | None:
        return self.specials.get("mask_token")

    @property
    def pad_token_id(self) -> int:
        pid = self.token_id("pad_token")
        return 0 if pid is None else pid

    def encode(self, texts: list[str] | str, pairs: list[str] | None = None, max_length: int | None = None,
               add_special_tokens: bool = True) -> dict[str, torch.Tensor]:
        """Encode a batch, right-padded to its longest row: input_ids, attention_mask, token_type_ids."""
        if isinstance(texts, str):
            texts = [texts]
        if max_length:
            self.backend.enable_truncation(max_length)
        try:
            inputs = list(zip(texts, pairs)) if pairs is not None else texts
            encs = self.backend.encode_batch(inputs, add_special_tokens=add_special_tokens)
        finally:
            self.backend.no_truncation()
        width = max(len(e.ids) for e in encs)
        ids = torch.full((len(encs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(encs), width), dtype=torch.long)
        types = torch.zeros((len(encs), width), dtype=torch.long)
        for i, e in enumerate(encs):
            n = len(e.ids)
            ids[i, :n] = torch.tensor(e.ids)
            mask[i, :n] = 1
            types[i, :n] = torch.tensor(e.type_ids)
        return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self.backend.id_to_token(i)

    # ---- chat ------------------------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        """tokenizer_config.json `chat_template` (the "default" one of a list), else chat_template.jinja."""
        tpl = self.config.get("chat_template")
        if isinstance(tpl, list):
            tpl = next((t.get("template") for t in tpl if isinstance(t, dict) and t.get("name") == "default"), None)
        if tpl is None and self.source_dir is not None and (self.source_dir / "chat_template.jinja").is_file():
            tpl = (self.source_dir / "chat_template.jinja").read_text(encoding="utf-8")
        return tpl

    def chat(self) -> ChatTemplate:
        """The chat template, ready to render with this tokenizer's special tokens."""
        from kiln.hub.chat import ChatTemplate

        tpl = self.chat_template
        where = self.source_dir or "this tokenizer"
        if not tpl:
            raise KilnError(f"{where}: no chat template (tokenizer_config.json has no chat_template and there is "
                            "no chat_template.jinja); train one with `kiln tokenizer train` or add one")
        specials = dict(self.specials)
        for name in _SPECIALS:  # template variables are the strings, present in the vocabulary or not
            text = _token_text(self.config.get(name)) or _token_text(self.special_map.get(name))
            if text is not None:
                specials.setdefault(name, text)
        return ChatTemplate(tpl, specials, source=f"{where}/tokenizer_config.json chat_template")
