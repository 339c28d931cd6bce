"""Task models shared by the encoder families: base, sequence/token classification, QA, masked LM.

A task model holds the family's backbone as `model` and a head; losses follow transformers'
definitions (problem_type for sequence classification, -100 ignored, QA positions clamped).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from kiln.errors import KilnError
from kiln.models.common.activations import activation
from kiln.models.pretrained import PreTrainedModel
from kiln.models.tasks import BASE, MASKED_LM, QUESTION_ANSWERING, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION


@dataclass
class ModelOutput:
    logits: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    last_hidden_state: torch.Tensor | None = None
    pooler_output: torch.Tensor | None = None
    start_logits: torch.Tensor | None = None
    end_logits: torch.Tensor | None = None


# ---- head modules ---------------------------------------------------------------------------
class PooledClassifier(nn.Module):
    """dropout(pooled) -> classifier (BERT, ALBERT)."""

    def __init__(self, dim: int, num_labels: int, dropout: float):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(dim, num_labels)

    def forward(self, hidden: torch.Tensor, pooled: torch.Tensor | None) -> torch.Tensor:
        return self.classifier(self.dropout(pooled))


class FirstTokenClassifier(nn.Module):
    """h[:, 0] -> dropout -> dense -> act -> dropout -> out_proj (RoBERTa, XLM-R; DistilBERT with relu)."""

    def __init__(self, dim: int, num_labels: int, dropout: float, act: str = "tanh", dropout_first: bool = True):
        super().__init__()
        self.dense = nn.Linear(dim, dim)
        self.act = activation(act)
        self.dropout = nn.Dropout(dropout)
        self.out_proj = nn.Linear(dim, num_labels)
        self.dropout_first = dropout_first

    def forward(self, hidden: torch.Tensor, pooled: torch.Tensor | None) -> torch.Tensor:
        x = hidden[:, 0]  # (B, C)
        if self.dropout_first:
            x = self.dropout(x)
        return self.out_proj(self.dropout(self.act(self.dense(x))))


class MLMHead(nn.Module):
    """dense -> act -> norm -> logits against the (tied) word embeddings, plus an output bias."""

    def __init__(self, dim: int, vocab_size: int, act: str, eps: float, out_dim: int | None = None,
                 tied: bool = True, decoder_bias: bool = False):
        super().__init__()
        out_dim = out_dim or dim
        self.dense = nn.Linear(dim, out_dim)
        self.act = activation(act)
        self.norm = nn.LayerNorm(out_dim, eps=eps)
        self.bias = nn.Parameter(torch.zeros(vocab_size))
        # decoder_bias: an untied decoder brings its own bias and `bias` goes unused (HF ties the two only
        # when it ties the weights: ALBERT, DeBERTa's legacy head).
        self.decoder = None if tied else nn.Linear(out_dim, vocab_size, bias=decoder_bias)

    def reset_parameters_hf(self, std: float) -> None:
        nn.init.zeros_(self.bias)

    def forward(self, hidden: torch.Tensor, embedding_weight: torch.Tensor) -> torch.Tensor:
        x = self.norm(self.act(self.dense(hidden)))
        if self.decoder is not None and self.decoder.bias is not None:
            return self.decoder(x)  # (B, T, V)
        weight = embedding_weight if self.decoder is None else self.decoder.weight
        return F.linear(x, weight, self.bias)  # (B, T, V)


# ---- task models ----------------------------------------------------------------------------
def _backbone_inputs(kwargs: dict) -> dict:
    return {k: kwargs[k] for k in ("input_ids", "attention_mask", "token_type_ids", "position_ids", "inputs_embeds")
            if kwargs.get(k) is not None}


class BaseModel(PreTrainedModel):
    default_task = BASE

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None) -> ModelOutput:
        hidden, pooled = self.model(**_backbone_inputs(locals()))
        return ModelOutput(last_hidden_state=hidden, pooler_output=pooled)

    def embed(self, texts: list[str], normalize: bool = True, max_length: int = 512) -> torch.Tensor:
        """Mean-pooled sentence embeddings over real tokens (sentence-transformers' recipe)."""
        if self.tokenizer is None:
            raise KilnError("this model was loaded without a tokenizer; embed() needs one")
        batch = self.tokenizer.encode(texts, max_length=max_length)
        with torch.no_grad():
            hidden = self(**batch).last_hidden_state
        mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
        emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return F.normalize(emb, p=2, dim=1) if normalize else emb


class ForSequenceClassification(PreTrainedModel):
    default_task = SEQUENCE_CLASSIFICATION

    def __init__(self, model: nn.Module, head: nn.Module):
        super().__init__()
        self.model = model
        self.head = head

    def problem_type(self, labels: torch.Tensor) -> str:
        if self.config.problem_type:
            return self.config.problem_type
        n = self.config.num_labels
        if n == 1:
            return "regression"
        if labels.dtype in (torch.long, torch.int):
            return "single_label_classification"
        return "multi_label_classification"

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None) -> ModelOutput:
        hidden, pooled = self.model(**_backbone_inputs(locals()))
        logits = self.head(hidden, pooled)  # (B, num_labels)
        return ModelOutput(logits=logits, loss=None if labels is None else self.loss(logits, labels),
                           last_hidden_state=hidden)

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """transformers' sequence-classification loss for the config's (or the labels') problem type."""
        kind, n = self.problem_type(labels), self.config.num_labels
        if kind == "regression":
            return F.mse_loss(logits.squeeze(), labels.squeeze()) if n == 1 else F.mse_loss(logits, labels)
        if kind == "single_label_classification":
            return F.cross_entropy(logits.view(-1, n), labels.view(-1))
        if kind == "multi_label_classification":
            return F.binary_cross_entropy_with_logits(logits, labels)
        raise KilnError(f"config problem_type {kind!r} is not one of regression, "
                        "single_label_classification, multi_label_classification")


class ForTokenClassification(PreTrainedModel):
    default_task = TOKEN_CLASSIFICATION

    def __init__(self, model: nn.Module, dim: int, num_labels: int, dropout: float,
                 transform: nn.Module | None = None):
        super().__init__()
        self.model = model
        self.transform = transform if transform is not None else nn.Identity()  # ModernBERT: dense-act-norm first
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(dim, num_labels)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None) -> ModelOutput:
        hidden, _ = self.model(**_backbone_inputs(locals()))
        logits = self.classifier(self.dropout(self.transform(hidden)))  # (B, T, num_labels)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, self.config.num_labels), labels.view(-1))
        return ModelOutput(logits=logits, loss=loss, last_hidden_state=hidden)


class ForQuestionAnswering(PreTrainedModel):
    default_task = QUESTION_ANSWERING

    def __init__(self, model: nn.Module, dim: int, dropout: float = 0.0, transform: nn.Module | None = None):
        super().__init__()
        self.model = model
        self.transform = transform if transform is not None else nn.Identity()  # ModernBERT: dense-act-norm first
        self.dropout = nn.Dropout(dropout)  # DistilBERT drops out before qa_outputs; others pass 0
        self.qa_outputs = nn.Linear(dim, 2)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, start_positions=None, end_positions=None) -> ModelOutput:
        hidden, _ = self.model(**_backbone_inputs(locals()))
        logits = self.qa_outputs(self.dropout(self.transform(hidden)))  # (B, T, 2)
        start, end = logits.split(1, dim=-1)
        start, end = start.squeeze(-1).contiguous(), end.squeeze(-1).contiguous()
        loss = None
        if start_positions is not None and end_positions is not None:
            if start_positions.dim() > 1:
                start_positions = start_positions.squeeze(-1)
            if end_positions.dim() > 1:
                end_positions = end_positions.squeeze(-1)
            ignored = start.size(1)  # positions outside the sequence are clamped here and ignored
            start_positions, end_positions = start_positions.clamp(0, ignored), end_positions.clamp(0, ignored)
            loss = (F.cross_entropy(start, start_positions, ignore_index=ignored)
                    + F.cross_entropy(end, end_positions, ignore_index=ignored)) / 2
        return ModelOutput(loss=loss, start_logits=start, end_logits=end, last_hidden_state=hidden)


def word_embedding_weight(backbone: nn.Module) -> torch.Tensor:
    """The encoder backbone's word embedding table (`embeddings.word_embeddings`), which a masked LM head scores
    against."""
    table = backbone.get_submodule("embeddings.word_embeddings")
    if not isinstance(table, nn.Embedding):
        raise KilnError(f"{type(backbone).__name__}.embeddings.word_embeddings is a {type(table).__name__}, "
                        "not the nn.Embedding a masked LM head scores against")
    return table.weight


class ForMaskedLM(PreTrainedModel):
    default_task = MASKED_LM

    def __init__(self, model: nn.Module, head: nn.Module):  # (hidden, embedding weight) -> logits: an MLMHead
        super().__init__()
        self.model = model
        self.head = head

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, labels=None) -> ModelOutput:
        hidden, _ = self.model(**_backbone_inputs(locals()))
        logits = self.head(hidden, word_embedding_weight(self.model))  # (B, T, V)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))
        return ModelOutput(logits=logits, loss=loss, last_hidden_state=hidden)

    def fill_mask(self, text: str, k: int = 5) -> list[dict]:
        """Top-k fillers for each mask token in `text`: [{token, token_id, score, sequence}]."""
        tok = self.tokenizer
        if tok is None or tok.mask_token is None:
            raise KilnError("fill-mask needs a tokenizer with a mask token; none was found in the model directory")
        batch = tok.encode([text])
        ids = batch["input_ids"][0]
        mask_id = tok.token_id("mask_token")
        if mask_id is None:
            raise KilnError(f"the mask token {tok.mask_token} is not in the tokenizer's vocabulary")
        where = (ids == mask_id).nonzero().flatten().tolist()
        if not where:
            raise KilnError(f"no {tok.mask_token} token in the text; put {tok.mask_token} where a word should go")
        self.eval()
        with torch.no_grad():
            logits = self(**batch).logits[0]
        results = []
        for pos in where:
            probs = logits[pos].float().softmax(-1)
            top = probs.topk(k)
            for score, idx in zip(top.values.tolist(), top.indices.tolist()):
                filled = ids.clone()
                filled[pos] = idx
                results.append({"position": pos, "token_id": idx, "token": tok.decode([idx]).strip() or tok.id_to_token(idx),
                                "score": score, "sequence": tok.decode(filled.tolist())})
        return results
