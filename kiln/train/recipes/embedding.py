"""sentence-embedding: an encoder (or any base model with token states) trained as a sentence-transformers
model. model.task = "sentence-embedding"; the [embedding] table picks the loss:

- `mnrl` (multiple negatives ranking): rows `{anchor, positive[, negative]}`; each anchor's positive is the
  right answer among every positive (and negative) of the batch, cross entropy over scale * cosine;
- `cosent`: rows `{sentence1, sentence2, score}`; every pair scored higher must have the higher cosine,
  log(1 + sum exp(scale * (cos_low - cos_high)));
- `triplet`: rows `{anchor, positive, negative}`; relu(|a - p| - |a - n| + margin), Euclidean distances.

These are sentence-transformers' definitions (MultipleNegativesRankingLoss, CoSENTLoss, TripletLoss with their
default scale 20 and margin 5). Pooling and normalisation come from the model directory's
sentence-transformers files (mean + normalise where it has none) unless [embedding] sets them; checkpoints
and `kiln export` write them back (kiln.models.sentence). Eval: the loss, and for anchor/positive rows
eval_retrieval_accuracy, the share of eval anchors whose nearest eval positive (cosine) is their own.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import nn
from torch.nn import functional as F

from kiln.data import read_records
from kiln.data.hfdata import source_sha256
from kiln.data.records import Record
from kiln.errors import ConfigError, KilnError
from kiln.models.common.wrapped import unwrap
from kiln.models.sentence import Pooling, pool, sentence_model
from kiln.models.tasks import BASE, SENTENCE_EMBEDDING
from kiln.parallel.world import World
from kiln.train.config import DataSection, NonNegative, Positive, RunConfig, Section
from kiln.train.recipes.base import Extension, Recipe, RunParts, add_lora, build_model, check_text_model
from kiln.train.recipes.finetune import RecordsData

Mode = Literal["mean", "cls", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken"]


class EmbeddingData(RecordsData):
    """[data] of a sentence-embedding run: the record fields each loss reads."""
    anchor_field: str = "anchor"         # mnrl, triplet
    positive_field: str = "positive"
    negative_field: str = "negative"     # triplet; optional for mnrl (one hard negative per row)
    sentence1_field: str = "sentence1"   # cosent
    sentence2_field: str = "sentence2"
    score_field: str = "score"


class EmbeddingSection(Section):
    """How the embeddings are trained and pooled."""
    loss: Literal["mnrl", "cosent", "triplet"] = "mnrl"
    scale: Positive = 20.0                  # mnrl, cosent: multiplies the cosines
    margin: NonNegative = 5.0                  # triplet: Euclidean margin
    pooling: Mode | None = None          # default: the directory's 1_Pooling, else mean
    normalize: bool | None = None        # default: the directory's 2_Normalize, else true


def _sides(cfg: RunConfig, loss: str, first: Record) -> list[tuple[str, str]]:
    """(side name, record field) per text of a row, for this loss."""
    d = cfg.data
    assert isinstance(d, EmbeddingData), f"the embedding recipe reads its own [data] schema, got {type(d).__name__}"
    if loss == "cosent":
        return [("s1", d.sentence1_field), ("s2", d.sentence2_field)]
    sides = [("anchor", d.anchor_field), ("positive", d.positive_field)]
    if loss == "triplet" or d.negative_field in first.fields:
        sides.append(("negative", d.negative_field))
    return sides


def encode_rows(records: list[Record], tokenizer: Any, sides: list[tuple[str, str]], score_field: str | None,
                max_length: int) -> list[dict[str, torch.Tensor]]:
    """Per row, each side's `<side>_input_ids` / `_attention_mask` / `_token_type_ids` (and `score`)."""
    out = []
    tokenizer.backend.enable_truncation(max_length)
    try:
        for r in records:
            ex: dict[str, torch.Tensor] = {}
            for side, field in sides:
                text = r.get(field)
                if not isinstance(text, str) or not text.strip():
                    raise KilnError(f"{r.where}: {field!r} must be a non-empty string, got {text!r}")
                e = tokenizer.backend.encode(text)
                ex[f"{side}_input_ids"] = torch.tensor(e.ids, dtype=torch.long)
                ex[f"{side}_attention_mask"] = torch.ones(len(e.ids), dtype=torch.long)
                ex[f"{side}_token_type_ids"] = torch.tensor(e.type_ids, dtype=torch.long)
            if score_field is not None:
                score = r.get(score_field)
                if isinstance(score, bool) or not isinstance(score, (int, float)):
                    raise KilnError(f"{r.where}: {score_field!r} must be a number, got {score!r}")
                ex["score"] = torch.tensor(float(score))
            out.append(ex)
    finally:
        tokenizer.backend.no_truncation()
    return out


def embed_side(model: nn.Module, batch: dict[str, torch.Tensor], side: str, pooling: Pooling) -> torch.Tensor:
    """(B, C) embeddings of one side of a batch, through `model`'s own forward (so DDP sees the call)."""
    mask, types = batch[f"{side}_attention_mask"], batch[f"{side}_token_type_ids"]
    # all-zero type ids are every encoder's default, and a decoder has none: passed only when they say something
    kwargs = {"token_type_ids": types} if bool(types.any()) else {}
    hidden = model(input_ids=batch[f"{side}_input_ids"], attention_mask=mask, **kwargs).last_hidden_state
    emb = pool(hidden, mask, pooling.mode)
    return F.normalize(emb, p=2, dim=1) if pooling.normalize else emb


def _cos(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.normalize(a, p=2, dim=-1) @ F.normalize(b, p=2, dim=-1).T


def embedding_loss(e: EmbeddingSection, pooling: Pooling) -> Callable[[nn.Module, dict], tuple[torch.Tensor, int]]:
    """The step: (loss summed over the batch's rows, rows)."""

    def step(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        n = batch[next(k for k in batch if k.endswith("_input_ids"))].size(0)
        if e.loss == "cosent":
            a, b = embed_side(model, batch, "s1", pooling), embed_side(model, batch, "s2", pooling)
            cos = F.cosine_similarity(a, b, dim=-1) * e.scale
            diff = cos[None, :] - cos[:, None]  # [i, j] = cos_j - cos_i: counted where pair i is scored above j
            higher = batch["score"][:, None] > batch["score"][None, :]
            diff = diff.masked_fill(~higher, float("-inf"))
            terms = torch.cat([torch.zeros(1, device=diff.device, dtype=diff.dtype), diff.flatten()])
            return torch.logsumexp(terms, dim=0) * n, n
        anchor, positive = embed_side(model, batch, "anchor", pooling), embed_side(model, batch, "positive", pooling)
        negative = embed_side(model, batch, "negative", pooling) if "negative_input_ids" in batch else None
        if e.loss == "triplet":
            if negative is None:
                raise KilnError("embedding.loss = 'triplet' needs a negative in every row")
            hinge = F.relu(F.pairwise_distance(anchor, positive) - F.pairwise_distance(anchor, negative) + e.margin)
            return hinge.sum(), n
        candidates = positive if negative is None else torch.cat([positive, negative])
        scores = _cos(anchor, candidates) * e.scale  # (B, B or 2B): row i's answer is column i
        return F.cross_entropy(scores, torch.arange(n, device=scores.device), reduction="sum"), n

    return step


def retrieval_accuracy(anchors: torch.Tensor, positives: torch.Tensor) -> float:
    """Share of anchors whose most similar positive (cosine) is their own (row i <-> row i)."""
    best = _cos(anchors, positives).argmax(dim=1)
    return float((best == torch.arange(len(anchors), device=best.device)).float().mean())


def make_evaluate(examples: list[dict[str, torch.Tensor]], e: EmbeddingSection, pooling: Pooling, pad_id: int
                  ) -> Callable[[Any], dict[str, float]]:
    """eval_loss over batches of train.batch_size, and eval_retrieval_accuracy over the whole eval set."""
    from kiln.data.loader import pad_collate

    loss_fn = embedding_loss(e, pooling)

    @torch.no_grad()
    def evaluate(trainer: Any) -> dict[str, float]:
        model, size = trainer.model, trainer.args.batch_size
        model.eval()
        loss_sum, count = 0.0, 0
        sides: dict[str, list[torch.Tensor]] = {"anchor": [], "positive": []}
        try:
            for i in range(0, len(examples), size):
                batch = {k: v.to(trainer.device) for k, v in pad_collate(examples[i:i + size], pad_id).items()}
                with trainer.autocast():
                    s, n = loss_fn(model, batch)
                    if "anchor_input_ids" in batch:
                        for side in sides:
                            sides[side].append(embed_side(model, batch, side, pooling).float())
                loss_sum, count = loss_sum + float(s), count + n
        finally:
            model.train()
        metrics = {"eval_loss": loss_sum / max(count, 1)}
        if sides["anchor"]:
            metrics["eval_retrieval_accuracy"] = retrieval_accuracy(torch.cat(sides["anchor"]), torch.cat(sides["positive"]))
        return metrics

    return evaluate


class SentenceEmbedding(Recipe):
    name = SENTENCE_EMBEDDING
    summary = "sentence embeddings (mnrl, cosent or triplet loss) written as a sentence-transformers model"
    when = f"model.task = {SENTENCE_EMBEDDING!r}"
    data_schema: type[DataSection] = EmbeddingData
    shortcuts = ()

    def matches(self, task: str, data: Mapping[str, Any]) -> bool:
        return task == SENTENCE_EMBEDDING

    def build(self, cfg: RunConfig, on_model: Callable[[nn.Module], None], world: World) -> RunParts:
        d = cfg.data
        assert isinstance(d, EmbeddingData), f"{self.name} builds from its own [data] schema, got {type(d).__name__}"
        e = getattr(cfg, "embedding", None) or EmbeddingSection()
        train_records = read_records(d.train, d.format)
        eval_records = read_records(d.eval, d.format) if d.eval else None
        if not train_records:
            raise KilnError(f"data.train {d.train}: no rows")
        base_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"task": BASE})})
        model = build_model(base_cfg, None)
        read = (Pooling.read(cfg.model.path) if cfg.model.path else None) or Pooling()
        pooling = Pooling(e.pooling or read.mode, read.normalize if e.normalize is None else e.normalize, d.max_length)
        model = sentence_model(model, pooling)
        on_model(model)
        check_text_model(cfg, model, d.max_length)
        tok = model.tokenizer
        assert tok is not None, "check_text_model refuses a model without a tokenizer"
        add_lora(cfg, model)
        sides = _sides(cfg, e.loss, train_records[0])
        score = d.score_field if e.loss == "cosent" else None
        train = encode_rows(train_records, tok, sides, score, d.max_length)
        if e.loss == "mnrl" and len(train) > 1 and cfg.train.batch_size < 2:
            raise ConfigError("embedding.loss = 'mnrl' takes the other rows of a batch as negatives: "
                              "train.batch_size must be at least 2")
        if e.loss == "mnrl":
            check_negatives(train_records, d, any(name == "negative" for name, _ in sides), world)
        parts = RunParts(model, train, step=embedding_loss(e, pooling),
                         fingerprint={"train": str(d.train), "train_sha256": source_sha256(d.train),
                                      "max_length": d.max_length, "loss": e.loss, "fields": [f for _, f in sides]})
        if eval_records:
            evals = encode_rows(eval_records, tok, sides, score, d.max_length)
            parts.evaluate = make_evaluate(evals, e, pooling, tok.pad_token_id)
        return parts


def check_negatives(records: list[Record], d: Any, hard_negatives: bool, world: World) -> None:
    """mnrl scores each anchor against every positive of its batch: rows that share a positive text are each
    other's negatives of the same text, which carries no signal. Every row sharing one positive (one row alone
    included) and no hard negative: nothing to learn, refused; some repeats: said once, counted."""
    positives = [json.dumps(r.fields.get(d.positive_field), sort_keys=True) for r in records]
    distinct = len(set(positives))
    if distinct == 1 and not hard_negatives:
        what = "its one row" if len(records) == 1 else f"all {len(records)} rows share one positive"
        raise KilnError(f"data.train {d.train}: {what}, so embedding.loss = 'mnrl' has no other positive to tell it "
                        "from (the loss is constant, its gradient 0); add rows with other positives, or a "
                        f"{d.negative_field!r} field (hard negatives)")
    repeats = len(records) - distinct
    if repeats and world.main:
        print(f"warning: data.train {d.train}: {repeats} of {len(records)} rows repeat another row's positive; in a "
              "batch together each is the other's negative of the same text (no signal from that pair); "
              f"{distinct} distinct positives carry signal", file=sys.stderr)


class EmbeddingExtension(Extension):
    """[embedding]: read by the sentence-embedding recipe when it builds; refused on any other run."""
    section = "embedding"
    schema = EmbeddingSection
    summary = "loss (mnrl, cosent, triplet), scale, margin, pooling and normalisation of a sentence-embedding run"
    recipes = (SENTENCE_EMBEDDING,)

    def extend(self, cfg: RunConfig, parts: RunParts) -> None:
        # the recipe built the step and eval from this table; what is left is to check they are its own
        if not hasattr(unwrap(parts.model), "pooling"):
            raise ConfigError("[embedding] belongs to model.task = 'sentence-embedding' runs")


RECIPE = SentenceEmbedding()
EXTENSION = EmbeddingExtension()
