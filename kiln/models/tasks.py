"""The one task registry: what each head is trained on, how it is scored, and what transformers calls it.

A `Task` is its name (it *is* a `str`, so configs, family head tables and JSON keep plain names) plus
its behaviour: encoding records into examples, the training loss as `(sum, count)` (summed over the
units it averages: examples, or non-ignored tokens), eval metrics, the labels `verify-export` feeds
both models, the transformers Auto class and the PEFT task type. Everything else asks the registry:

    from kiln.models.tasks import get_task, SEQUENCE_CLASSIFICATION
    task = get_task(cfg.model.task)          # ConfigError naming the known tasks
    loss_sum, count, out = task.loss(model, batch)

A new task is one subclass and one line in `TASKS`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kiln.constants import BASE_TASK, IGNORE_INDEX
from kiln.data import encode as enc
from kiln.errors import ConfigError, KilnError
from kiln.models.common.loss import lm_loss_sum, shift_labels
from kiln.models.common.wrapped import unwrap


class Task(str):
    """A task name with the behaviour of its head. Subclasses override what differs."""

    hf_auto = "AutoModel"            # transformers Auto class that loads this head
    peft_type: str | None = None     # PEFT's task_type for adapters of this head
    short = ""                       # column name in the verify matrix
    label_kind: str | None = None    # "sequence" / "token": a label set read from the data; None: no label set
    encoder_head = False             # one of the five heads every encoder family has
    target_keys: tuple[str, ...] = ("labels",)  # batch keys that are targets, not model inputs

    def __new__(cls, name: str) -> Task:
        return super().__new__(cls, name)

    # ---- data -------------------------------------------------------------------------------
    def encode(self, records: list, tokenizer: Any,  # type: ignore[override]  # a Task is its name; this encodes data
               labels: list[str] | None, data: Any, name: str = "train") -> list[dict]:
        """Records -> unpadded examples; `data` is the [data] section (field names, max_length ...);
        `name` (train, eval) labels what is printed about the encoding."""
        raise ConfigError(f"task {self!r} has no record encoder; trainable from records: "
                          f"{', '.join(t for t in TASKS.values() if type(t).encode is not Task.encode)}")

    def collect_labels(self, records: list, field: str) -> list[str]:
        return enc.collect_labels(records, field, per_token=self.label_kind == "token")

    # ---- loss and metrics -------------------------------------------------------------------
    def inputs(self, batch: dict) -> dict:
        return {k: v for k, v in batch.items() if k not in self.target_keys}

    def loss(self, model: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor | int, Any]:
        """(loss summed over this batch's units, unit count, model output): the model's own mean loss
        times the number of examples."""
        out = model(**batch)
        if getattr(out, "loss", None) is None:
            raise KilnError("the model returned no loss for this batch; give the batch labels or pass step=")
        n = next(iter(batch.values())).size(0)
        return out.loss * n, n, out

    def score(self, out: Any, batch: dict) -> tuple[float, float] | None:
        """(correct, judged) for eval_accuracy, or None when the head has no accuracy."""
        return None

    # ---- verify-export ----------------------------------------------------------------------
    def verify_labels(self, batch: dict, config: Any, g: torch.Generator) -> dict:
        """Random targets for `batch` so the loss is compared too; {} where the head has none."""
        return {}


class Base(Task):
    peft_type = "FEATURE_EXTRACTION"
    short = "base"
    encoder_head = True


class SequenceClassification(Task):
    hf_auto = "AutoModelForSequenceClassification"
    peft_type: str | None = "SEQ_CLS"
    short = "seqcls"
    label_kind: str | None = "sequence"
    encoder_head = True

    def encode(self, records, tokenizer, labels, data, name="train"):
        return enc.encode_sequence_classification(records, tokenizer, labels, enc.fields_of(data), data.max_length)

    def score(self, out, batch):
        if batch["labels"].dtype != torch.long:  # regression / multi-label: no accuracy
            return None
        return float((out.logits.argmax(-1) == batch["labels"]).sum()), batch["labels"].numel()

    def verify_labels(self, batch, config, g):
        B, n = batch["input_ids"].shape[0], config.num_labels
        kind = config.problem_type or ("regression" if n == 1 else "single_label_classification")
        if kind == "single_label_classification":
            return {"labels": torch.randint(0, n, (B,), generator=g)}
        if kind == "regression":
            return {"labels": torch.randn(B, n, generator=g).squeeze(-1) if n == 1 else torch.randn(B, n, generator=g)}
        return {"labels": torch.randint(0, 2, (B, n), generator=g).float()}


class RewardModel(SequenceClassification):
    """A one-output sequence-classification head trained on preference pairs (Bradley-Terry); the model it builds
    and exports is the family's sequence-classification head, so transformers reads it as
    AutoModelForSequenceClassification. Its recipe (kiln.train.recipes.reward_model) encodes the pairs."""
    short = "reward"
    label_kind = None  # one output, no label set read from the data
    encoder_head = False

    def encode(self, records, tokenizer, labels, data, name="train"):
        raise ConfigError(f"task {self!r} reads preference pairs through its recipe (kiln.train.recipes.reward_model)")


class ImageClassification(SequenceClassification):
    """A label per image (`pixel_values` (B, C, H, W)); records are encoded by the image-classification recipe."""
    hf_auto = "AutoModelForImageClassification"
    peft_type = None
    short = "imgcls"
    encoder_head = False

    def encode(self, records, tokenizer, labels, data, name="train"):
        raise ConfigError(f"task {self!r} reads images: its records are encoded by the image-classification recipe "
                          f"([data] image_field)")

    def verify_labels(self, batch, config, g):
        return {"labels": torch.randint(0, config.num_labels, (batch["pixel_values"].shape[0],), generator=g)}


class TokenLevel(Task):
    """Heads whose loss is cross entropy per token, summed over the tokens whose label is not ignored."""

    def targets(self, labels: torch.Tensor) -> torch.Tensor:
        return labels

    def vocab(self, config: Any) -> int:
        return config.vocab_size

    def loss(self, model, batch):
        if "labels" not in batch:
            return super().loss(model, batch)
        out = model(**self.inputs(batch))
        loss_sum, count = lm_loss_sum(out.logits, self.targets(batch["labels"]))  # over (B, T) targets
        return self._with_aux(model, out, loss_sum, count)

    @staticmethod
    def _with_aux(model, out, loss_sum, count):
        aux = getattr(out, "aux_loss", None)
        if aux is not None:  # MoE load balancing (output_router_logits): weighted per token like the loss it joins
            loss_sum = loss_sum + unwrap(model).config.router_aux_loss_coef * aux * count
        return loss_sum, count, out

    def verify_labels(self, batch, config, g):
        ids = batch["input_ids"]
        labels = torch.randint(0, self.vocab(config), ids.shape, generator=g)
        labels[batch.get("attention_mask", torch.ones_like(ids)) == 0] = IGNORE_INDEX
        return {"labels": labels}


class TokenClassification(TokenLevel):
    hf_auto = "AutoModelForTokenClassification"
    peft_type = "TOKEN_CLS"
    short = "tokcls"
    label_kind = "token"
    encoder_head = True

    def vocab(self, config):
        return config.num_labels

    def encode(self, records, tokenizer, labels, data, name="train"):
        return enc.encode_token_classification(records, tokenizer, labels, enc.fields_of(data), data.max_length)

    def score(self, out, batch):
        keep = batch["labels"] != IGNORE_INDEX
        return float((out.logits.argmax(-1)[keep] == batch["labels"][keep]).sum()), float(keep.sum())


class MaskedLM(TokenLevel):
    hf_auto = "AutoModelForMaskedLM"
    short = "mlm"
    encoder_head = True


class CausalLM(TokenLevel):
    hf_auto = "AutoModelForCausalLM"
    peft_type = "CAUSAL_LM"
    short = "clm"

    def targets(self, labels):
        return shift_labels(labels)  # token t predicts t+1

    def loss(self, model, batch):
        """A model that sums over targets itself (ForCausalLM: `targets=`) gets them, so on its fast path
        the head runs only where a target is (kiln.models.common.causal_lm); others go through logits."""
        if "labels" not in batch or not getattr(unwrap(model), "sums_targets", False):
            return super().loss(model, batch)
        out = model(**self.inputs(batch), targets=self.targets(batch["labels"]))
        return self._with_aux(model, out, out.loss_sum, out.loss_count)

    def encode(self, records, tokenizer, labels, data, name="train"):
        from kiln.data.sft import encode_sft

        examples, stats = encode_sft(records, tokenizer, data.max_length, data.train_on, data.pack)
        print(f"{name} data: {stats.line()}")
        return examples


class QuestionAnswering(Task):
    hf_auto = "AutoModelForQuestionAnswering"
    peft_type = "QUESTION_ANS"
    short = "qa"
    encoder_head = True
    target_keys = ("start_positions", "end_positions")

    def encode(self, records, tokenizer, labels, data, name="train"):
        return enc.encode_question_answering(records, tokenizer, enc.fields_of(data), data.max_length)

    def score(self, out, batch):
        hit = (out.start_logits.argmax(-1) == batch["start_positions"]) & \
              (out.end_logits.argmax(-1) == batch["end_positions"])
        return float(hit.sum()), hit.numel()

    def verify_labels(self, batch, config, g):
        B, T = batch["input_ids"].shape
        return {"start_positions": torch.randint(0, T, (B,), generator=g),
                "end_positions": torch.randint(0, T + 3, (B,), generator=g)}  # some out of range: clamped, ignored


class SentenceEmbedding(Task):
    """A base model pooled into sentence embeddings (kiln.models.sentence); its recipe owns loss and eval."""
    peft_type = "FEATURE_EXTRACTION"
    short = "emb"


BASE = Base(BASE_TASK)
SEQUENCE_CLASSIFICATION = SequenceClassification("sequence-classification")
TOKEN_CLASSIFICATION = TokenClassification("token-classification")
QUESTION_ANSWERING = QuestionAnswering("question-answering")
MASKED_LM = MaskedLM("masked-lm")
CAUSAL_LM = CausalLM("causal-lm")
IMAGE_CLASSIFICATION = ImageClassification("image-classification")
SENTENCE_EMBEDDING = SentenceEmbedding("sentence-embedding")
REWARD_MODEL = RewardModel("reward-model")

TASKS: dict[str, Task] = {t: t for t in (BASE, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, QUESTION_ANSWERING,
                                          MASKED_LM, CAUSAL_LM, IMAGE_CLASSIFICATION, SENTENCE_EMBEDDING,
                                          REWARD_MODEL)}
ENCODER_HEADS: tuple[Task, ...] = tuple(t for t in TASKS.values() if t.encoder_head)


def get_task(name: str | None, where: str = "task") -> Task:
    """The registered Task for a name (None: base); a ConfigError naming `where` and the known tasks."""
    if name is None:
        return BASE
    if name not in TASKS:
        raise ConfigError(f"{where}: {name!r} is not a task; tasks: {', '.join(TASKS)}")
    return TASKS[name]


def task_of(model: nn.Module) -> Task | None:
    """The Task of a kiln model (through DDP), or None for a model that names none."""
    name = getattr(unwrap(model), "task", None)
    return TASKS.get(name) if isinstance(name, str) else None
