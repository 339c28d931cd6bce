"""Sentence embeddings: a base model's token states pooled (and L2-normalised) into one vector per text,
the way sentence-transformers computes them, with its files read and written.

A sentence-transformers directory is an HF model directory plus `modules.json` (Transformer -> Pooling
[-> Normalize]), `1_Pooling/config.json` (the pooling mode, in the legacy `pooling_mode_*_tokens`
booleans or the newer `pooling_mode` string) and `sentence_bert_config.json` (`max_seq_length`).
`Pooling.read` reads them; `Pooling.write` writes the legacy layout, which every sentence-transformers
version loads. `sentence_model` gives a kiln base model the pooling: `embed()` then pools as
sentence-transformers does and `save_pretrained` writes its files beside the weights, so checkpoints
and exports of a sentence-embedding run load in `SentenceTransformer` as they are.
"""

from __future__ import annotations

import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn
from torch.nn import functional as F

from kiln.errors import KilnError
from kiln.models.auto import load_pretrained
from kiln.models.common.config import text_sizes
from kiln.models.tasks import BASE

MODES = ("mean", "cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
           "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
           "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
_TYPES = {"transformer": "sentence_transformers.models.Transformer",
          "pooling": "sentence_transformers.models.Pooling", "normalize": "sentence_transformers.models.Normalize"}


@dataclass
class Pooling:
    mode: str = "mean"                 # one of MODES
    normalize: bool = True             # a Normalize module after the pooling (unit-length embeddings)
    max_seq_length: int | None = None  # sentence-transformers truncates texts to this many tokens

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise KilnError(f"pooling mode {self.mode!r} is not one of {', '.join(MODES)}")

    @classmethod
    def read(cls, model_dir: str | os.PathLike) -> Pooling | None:
        """The pooling of a sentence-transformers directory, or None when it has no modules.json."""
        d = Path(model_dir)
        if not (d / "modules.json").is_file():
            return None
        modules = _json(d / "modules.json", list)
        kinds = [str(m.get("type", "")).rsplit(".", 1)[-1] if isinstance(m, dict) else "" for m in modules]
        if "Pooling" not in kinds:
            raise KilnError(f"{d / 'modules.json'}: no Pooling module (modules: {', '.join(kinds) or 'none'}); "
                            "kiln reads Transformer -> Pooling [-> Normalize] directories")
        unknown = [k for k in kinds if k not in ("Transformer", "Pooling", "Normalize")]
        if unknown:
            raise KilnError(f"{d / 'modules.json'}: modules kiln does not implement: {', '.join(unknown)}; "
                            "kiln reads Transformer -> Pooling [-> Normalize] directories")
        entry = modules[kinds.index("Pooling")]
        cfg = _json(d / entry.get("path", "1_Pooling") / "config.json", dict)
        mode = cfg.get("pooling_mode")
        if mode is None:
            modes = [name for key, name in _LEGACY.items() if cfg.get(key)]
        else:
            modes = [mode] if isinstance(mode, str) else list(mode)
        if len(modes) != 1:
            raise KilnError(f"{d / entry.get('path', '1_Pooling') / 'config.json'}: pooling modes {modes or 'none'}; "
                            "kiln pools with exactly one mode")
        length = None
        if (d / "sentence_bert_config.json").is_file():
            length = _json(d / "sentence_bert_config.json", dict).get("max_seq_length")
        return cls(modes[0], "Normalize" in kinds, length if isinstance(length, int) else None)

    def write(self, model_dir: str | os.PathLike, dim: int) -> None:
        """modules.json, 1_Pooling/config.json, 2_Normalize/ (when normalising), sentence_bert_config.json."""
        d = Path(model_dir)
        modules = [("", "transformer"), ("1_Pooling", "pooling")] + ([("2_Normalize", "normalize")] if self.normalize else [])
        _write_json(d / "modules.json", [{"idx": i, "name": str(i), "path": path, "type": _TYPES[kind]}
                                         for i, (path, kind) in enumerate(modules)])
        cfg: dict[str, Any] = {"word_embedding_dimension": dim}
        cfg.update({key: name == self.mode for key, name in _LEGACY.items()})
        (d / "1_Pooling").mkdir(exist_ok=True)
        _write_json(d / "1_Pooling" / "config.json", cfg)
        if self.normalize:
            (d / "2_Normalize").mkdir(exist_ok=True)
        bert_cfg: dict[str, Any] = {"do_lower_case": False}
        if self.max_seq_length is not None:
            bert_cfg["max_seq_length"] = self.max_seq_length
        _write_json(d / "sentence_bert_config.json", bert_cfg)


def _json(path: Path, want: type) -> Any:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise KilnError(f"{path}: cannot read sentence-transformers config ({e})") from None
    if not isinstance(value, want):
        raise KilnError(f"{path}: expected a JSON {want.__name__}, got {type(value).__name__}")
    return value


def _write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def pool(hidden: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """(B, T, C) token states and a (B, T) 0/1 mask -> (B, C), as sentence-transformers' Pooling computes it."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "cls":
        first = mask.to(torch.int).argmax(dim=1)  # the first real token (left padding skipped)
        return hidden[torch.arange(hidden.size(0), device=hidden.device), first]
    if mode == "max":
        return hidden.masked_fill(m == 0, float("-inf")).max(dim=1).values
    if mode in ("mean", "mean_sqrt_len_tokens"):
        count = m.sum(dim=1).clamp(min=1e-9)
        return (hidden * m).sum(dim=1) / (count if mode == "mean" else count.sqrt())
    if mode == "weightedmean":
        weights = torch.arange(1, hidden.size(1) + 1, device=hidden.device, dtype=hidden.dtype).view(1, -1, 1)
        weights = weights - mask.to(torch.int32).argmax(dim=1).view(-1, 1, 1)  # count from the first real token
        w = m * weights
        return (hidden * w).sum(dim=1) / w.sum(dim=1).clamp(min=1e-9)
    if mode == "lasttoken":
        values, back = mask.flip(1).max(1)
        back = torch.where(values == 0, hidden.size(1) - 1, back)
        last = hidden.size(1) - back - 1
        return (hidden * m)[torch.arange(hidden.size(0), device=hidden.device), last]
    raise KilnError(f"pooling mode {mode!r} is not one of {', '.join(MODES)}")


if TYPE_CHECKING:  # the mixin always sits in front of a kiln model class (sentence_model builds that class)
    from kiln.models.pretrained import PreTrainedModel as _MixedInto
else:
    _MixedInto = object


class SentenceModelMixin(_MixedInto):
    """What `sentence_model` adds to a base model class: pooled embeddings and sentence-transformers files."""
    pooling: Pooling

    def sentence_embeddings(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                            token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """(B, C) embeddings of a tokenized batch, with gradients: pooled, then normalised if the pooling says."""
        kwargs = {"token_type_ids": token_type_ids} if token_type_ids is not None else {}
        hidden = self(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
        emb = pool(hidden, attention_mask, self.pooling.mode)
        return F.normalize(emb, p=2, dim=1) if self.pooling.normalize else emb

    def embed(self, texts: list[str], normalize: bool | None = None, max_length: int | None = None,
              batch_size: int = 64) -> torch.Tensor:
        """(N, C) embeddings of `texts`, as SentenceTransformer.encode gives them (its truncation, pooling,
        normalisation); `normalize` overrides the directory's Normalize."""
        if self.tokenizer is None:
            raise KilnError("this model was loaded without a tokenizer; embed() needs one")
        length = max_length or self.pooling.max_seq_length or 512
        # what the forward reads (a decoder has no token_type_ids, which BERT-style tokenizers give)
        takes = {"input_ids", "attention_mask"} | ({"token_type_ids"} & set(inspect.signature(self.forward).parameters))
        was_training = self.training
        self.eval()
        out = []
        with torch.no_grad():
            for i in range(0, len(texts), batch_size):
                batch = self.tokenizer.encode(texts[i:i + batch_size], max_length=length)
                device = next(self.parameters()).device
                batch = {k: v.to(device) for k, v in batch.items() if k in takes}
                hidden = self(**batch).last_hidden_state
                emb = pool(hidden, batch["attention_mask"], self.pooling.mode)
                out.append(F.normalize(emb, p=2, dim=1) if (self.pooling.normalize if normalize is None else normalize)
                           else emb)
        self.train(was_training)
        return torch.cat(out).float().cpu()

    def save_pretrained(self, path: str | os.PathLike, *args: Any, **kwargs: Any) -> Path:
        out = super().save_pretrained(path, *args, **kwargs)
        self.pooling.write(out, text_sizes(self.config).hidden_size)
        return out


_CLASSES: dict[type, type] = {}


def sentence_model(model: nn.Module, pooling: Pooling) -> SentenceModelMixin:
    """`model` (a kiln base model: its forward gives last_hidden_state) as a sentence-embedding model, in
    place: same parameters and state-dict names (checkpoints and resume are unchanged), plus the pooling."""
    cls = type(model)
    if not issubclass(cls, SentenceModelMixin):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"Sentence{cls.__name__}", (SentenceModelMixin, cls), {})
        model.__class__ = _CLASSES[cls]
    sentence = cast(SentenceModelMixin, model)  # its class is one now: switched just above, or already
    sentence.pooling = pooling
    return sentence


def load_sentence_model(path: str | os.PathLike, **kwargs: Any) -> SentenceModelMixin:
    """A directory's base model with its sentence-transformers pooling (mean + normalise where it has none)."""
    return sentence_model(load_pretrained(path, task=BASE, **kwargs), Pooling.read(path) or Pooling())
