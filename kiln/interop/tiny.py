"""Tiny random HF checkpoints built by transformers itself, for parity tests and the verify matrix.

What to build comes from each family's `Tiny` (kiln/models/<family>.py, on the registry's Family): config,
special tokens, tokenizer kind, tensors to draw at random beyond transformers' init.

Every parameter is drawn at random (not HF's zero biases and unit norms), so a swapped or
dropped tensor cannot hide behind an initial value.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import WordPiece

from kiln.errors import KilnError
from kiln.models.auto import REGISTRY, family_for
from kiln.models.pretrained import Tiny
from kiln.models.tasks import get_task


def _tinies() -> dict[str, Tiny]:
    return {model_type: family.tiny for model_type, family in REGISTRY.items() if family.tiny is not None}


class _Configs(Mapping[str, dict[str, Any]]):
    """model_type -> its tiny transformers config kwargs, read from the registry each time (so a registry
    patched in a test is what everyone sees)."""

    def __getitem__(self, model_type: str) -> dict[str, Any]:
        return _tinies()[model_type].config

    def __iter__(self) -> Iterator[str]:
        return iter(_tinies())

    def __len__(self) -> int:
        return len(_tinies())


# Each family declares its tiny model beside its config (`Tiny` in kiln/models/<family>.py, on the registry's
# Family); TINY is the view of their config kwargs that tests and benchmarks build from.
TINY: Mapping[str, dict[str, Any]] = _Configs()


def tiny_of(model_type: str) -> Tiny:
    """The registered family's Tiny spec; a clear error for an unknown type or a family that declares none."""
    family = family_for(model_type)
    if family.tiny is None:
        raise KilnError(missing_tiny_message(model_type))
    return family.tiny


def missing_tiny_message(model_type: str) -> str:
    return (f"registered family {model_type!r} declares no tiny test model: add `tiny=Tiny(...)` to its Family "
            f"in kiln/models/ so the verify matrix and the parity tests can build it")


_WORDS = (["the", "a", "of", "to", "and", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "it", "be", "are", "this", "an", "paris", "france", "capital", "city", "london", "king", "queen", "man", "woman", "dog", "cat", "runs", "red", "blue", "green", "good", "bad", "day", "night", "river", "sea"])


def tiny_tokenizer(specials: dict[str, str], vocab_size: int) -> HFTokenizer:
    """A WordPiece tokenizer over a small English word list, padded with letters to `vocab_size`."""
    vocab = list(specials.values())
    for w in _WORDS + list("abcdefghijklmnopqrstuvwxyz.,") + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]:
        if len(vocab) >= vocab_size:
            break
        if w not in vocab:
            vocab.append(w)
    ids = {t: i for i, t in enumerate(vocab)}
    tok = HFTokenizer(WordPiece(ids, unk_token=specials["unk_token"]))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls = specials.get("cls_token") or specials.get("bos_token")
    sep = specials.get("sep_token") or specials.get("eos_token")
    assert cls is not None and sep is not None, specials  # every tiny family names both
    tok.post_processor = processors.TemplateProcessing(
        single=f"{cls} $A {sep}", pair=f"{cls} $A {sep} $B:1 {sep}:1", special_tokens=[(cls, ids[cls]), (sep, ids[sep])])
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(list(specials.values()))
    return tok


def tiny_unigram_tokenizer(specials: dict[str, str], vocab_size: int) -> HFTokenizer:
    """A SentencePiece-style Unigram tokenizer (Metaspace, `<s> $A </s>`) trained on the word list."""
    from tokenizers import SentencePieceUnigramTokenizer

    sp = SentencePieceUnigramTokenizer()
    text = [" ".join(_WORDS[i:] + _WORDS[:i]) for i in range(len(_WORDS))]
    sp.train_from_iterator(text, vocab_size=vocab_size, special_tokens=list(specials.values()),
                           unk_token=specials["unk_token"], show_progress=False)
    tok = sp._tokenizer
    bos, eos = specials["bos_token"], specials["eos_token"]
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", pair=f"{bos} $A {eos} {eos} $B {eos}",
        special_tokens=[(bos, tok.token_to_id(bos)), (eos, tok.token_to_id(eos))])
    return tok


def make_tiny(model_type: str, task: str, out_dir: str | os.PathLike, seed: int = 0, tokenizer: bool = True,
              **overrides: Any) -> Path:
    """Build a random `model_type` x `task` model with transformers and save it (plus a tokenizer)."""
    import json

    import transformers

    transformers.utils.logging.disable_progress_bar()
    family = family_for(model_type)
    tiny = tiny_of(model_type)
    arch = family.tasks[task].architecture
    kwargs = {**tiny.config, **overrides}
    if get_task(task).label_kind is not None:
        kwargs.setdefault("num_labels", 3)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    text = config.get_text_config()
    if get_task(task).label_kind == "sequence" and getattr(text, "pad_token_id", 0) is None and tiny.specials:
        # a decoder reads each row's score at its last non-pad token: the tokenizer's pad (id 0) names it
        text.pad_token_id = list(tiny.specials).index("pad_token") if "pad_token" in tiny.specials else 0
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    out = Path(out_dir)
    model.save_pretrained(out)
    if tiny.randomize is not None:
        _randomize(out / "model.safetensors", tiny.randomize)
    if tokenizer and tiny.specials:  # a family without text (ViT) declares no special tokens: no tokenizer
        specials = tiny.specials
        build = tiny_unigram_tokenizer if tiny.unigram else tiny_tokenizer
        build(specials, config.get_text_config().vocab_size).save(str(out / "tokenizer.json"))  # image-text: nested
        (out / "tokenizer_config.json").write_text(json.dumps(
            {**specials, "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 64}, indent=2))
        (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2))
    return out


def _randomize(path: Path, change: Callable[[str, torch.Tensor, torch.Generator], torch.Tensor | None]) -> None:
    """Rewrite, in the saved file, the tensors `change` replaces; one seeded generator serves every call, in the
    file's order, so the checkpoint stays a function of (model_type, task, seed, overrides)."""
    weights = load_file(str(path))
    g = torch.Generator().manual_seed(11)
    changed = False
    for name, tensor in weights.items():
        new = change(name, tensor, g)
        if new is not None:
            weights[name] = new.to(tensor.dtype)
            changed = True
    if changed:
        save_file(weights, str(path), metadata={"format": "pt"})
