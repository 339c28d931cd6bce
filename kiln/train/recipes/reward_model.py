"""reward-model: a Bradley-Terry reward model on preference pairs; model.task = "reward-model".

The rows are `[dpo]`'s (TRL's preference format; kiln.data.reward tokenizes them as TRL 1.16's RewardTrainer,
prompt and reply scored whole, an optional per-row `margin`). The model is the family's sequence-classification
head with one output (a decoder reads it at each row's last non-pad token), so the checkpoints and `kiln export`
are a `{Arch}ForSequenceClassification` that transformers' AutoModelForSequenceClassification and TRL read.
The loss is TRL's `RewardTrainer.compute_loss`: per pair `-logsigmoid(r_chosen - r_rejected - margin)`, plus
`center_rewards_coefficient * (r_chosen + r_rejected)^2` when the optional [reward_model] table sets it (the
mean over pairs of both is TRL's two means). The config's pad_token_id is the tokenizer's pad (else its EOS),
as TRL sets it, since the score is read at the last token that is not it.
Metrics per step and at evaluation (`eval_` prefixed): loss, accuracy (r_chosen > r_rejected), margin, and the
mean chosen / rejected rewards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from kiln.data import read_records
from kiln.data.hfdata import source_sha256
from kiln.data.reward import encode_reward_pairs
from kiln.errors import ConfigError, KilnError
from kiln.models.common.decoder import Decoder
from kiln.models.common.kept_grad import keep_embedding_gradient
from kiln.models.common.wrapped import unwrap
from kiln.models.decoder_seqcls import DecoderForSequenceClassification
from kiln.models.tasks import REWARD_MODEL, SEQUENCE_CLASSIFICATION
from kiln.parallel.world import World
from kiln.train.config import NonNegative, RunConfig, Section
from kiln.train.packing import Layout, lay_out, settle_pack
from kiln.train.preference import Signal, differing_pairs
from kiln.train.recipes.base import Extension, RunParts, build_model, check_text_model
from kiln.train.recipes.finetune import FineTune
from kiln.train.recipes.pairwise import PackedData, ScoredRun

STATS = ("pairs", "tokens", "loss", "accuracy", "margin", "rewards/chosen", "rewards/rejected")


class RewardData(PackedData):
    """[data] of a reward-model run: preference rows; a pair with a side longer than max_length is dropped."""


class RewardSection(Section):
    """[reward_model]: TRL's RewardConfig options of the loss."""
    center_rewards_coefficient: NonNegative | None = None  # pushes the rewards toward mean zero (Eisenstein et al.)



def pair_batch(batch: Mapping[str, torch.Tensor], pad_id: int, pack: bool = False) -> Layout:
    """The B chosen sequences then the B rejected, padded with `pad_id` (the head reads each row at its last
    non-pad token, as TRL's collator pads) or packed (each read at its last token; kiln.train.packing)."""
    ids = [batch[f"{side}_ids"][i, :n] for side in ("chosen", "rejected")
           for i, n in enumerate(batch[f"{side}_len"].tolist())]
    return lay_out(ids, {}, pack, pad_id)


def read_positions(layout: Layout, pad_id: int) -> torch.Tensor:
    """(2, n) the (row, column) each sequence's score is read at: its last token that is not `pad_id`, the rule
    transformers' head applies to a padded row (a tokenizer without a pad token pads with its EOS, which ends every
    side: the score is then read before it), for padded and packed rows alike; a sequence of pads alone is read
    at its first token (a padded row's position 0)."""
    cols = torch.arange(layout.input_ids.shape[1], device=layout.seq.device).expand_as(layout.seq)
    real = layout.seq >= 0
    seq, col = layout.seq[real], cols[real]
    read = col.masked_fill(layout.input_ids[real] == pad_id, -1)
    last = torch.full((layout.n,), -1, dtype=torch.long, device=col.device).scatter_reduce(0, seq, read, "amax")
    first = layout.last[1] - layout.per_sequence(real.long()) + 1
    return torch.stack([layout.last[0], torch.where(last >= 0, last, first)])


def bradley_terry(chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None,
                  center: float | None) -> torch.Tensor:
    """(B,) per-pair losses whose mean is TRL 1.16's RewardTrainer loss."""
    delta = chosen - rejected if margin is None else chosen - rejected - margin
    losses = -F.logsigmoid(delta)
    if center is not None:
        losses = losses + center * (chosen + rejected) ** 2
    return losses


class RewardRun(ScoredRun):
    """The step, the evaluation and the per-step metrics of one reward-model run."""
    STATS = STATS

    def __init__(self, cfg: RewardSection, pad_id: int, evals: list[dict[str, torch.Tensor]] | None,
                 pack: bool = False):
        super().__init__(evals, pack, Signal("pairs", "chosen = rejected in every pair"))
        self.cfg, self.pad_id = cfg, pad_id
        self.started = False

    def pair_losses(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                          torch.Tensor, int]:
        """(losses (B,), chosen rewards (B,), rejected rewards (B,), real tokens): one forward over both sides."""
        layout = pair_batch(batch, self.pad_id, self.pack)
        if layout.packed or isinstance(unwrap(model), DecoderForSequenceClassification):
            # a decoder runs its last layer only at these positions where it can (kiln.models.common.scored_tail)
            out = model(input_ids=layout.input_ids, attention_mask=layout.attention_mask,
                        position_ids=layout.position_ids, read_at=read_positions(layout, self.pad_id))
        else:  # an encoder's head reads its own pooled token
            out = model(input_ids=layout.input_ids, attention_mask=layout.attention_mask)
        rewards = out.logits.squeeze(-1).float()  # (2B,)
        n = layout.n // 2
        chosen, rejected = rewards[:n], rewards[n:]
        losses = bradley_terry(chosen, rejected, batch.get("margin"), self.cfg.center_rewards_coefficient)
        return losses, chosen.detach(), rejected.detach(), layout.tokens()

    @staticmethod
    def _stats(losses, chosen, rejected, tokens: float, weight: torch.Tensor) -> torch.Tensor:
        w = weight.double()
        parts = [w.sum(), torch.tensor(float(tokens), dtype=torch.float64, device=w.device)]
        parts += [(x.double() * w).sum() for x in (losses.detach(), (chosen > rejected), chosen - rejected,
                                                   chosen, rejected)]
        return torch.stack(parts).cpu()

    def step(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        if not self.started:
            self.started = True
            assert self.trainer is not None, "wrap_engine gave this callback its trainer"
            # one process, nothing wrapping or sharding the weights: the (vocab x hidden) embedding gradient is
            # summed into a kept buffer, not a new matrix per backward (kiln.models.common.kept_grad)
            if isinstance(model, DecoderForSequenceClassification) and isinstance(model.model, Decoder) \
                    and not self.trainer.sharded and not self.trainer.world.active:
                keep_embedding_gradient(model.model.embed_tokens)
        losses, chosen, rejected, tokens = self.pair_losses(model, batch)
        self.signal.add(differing_pairs(batch))
        self.sums += self._stats(losses, chosen, rejected, tokens, torch.ones_like(chosen))
        return losses.sum(), losses.shape[0]

    def eval_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        losses, chosen, rejected, _ = self.pair_losses(model, batch)
        w = batch["weight"]
        tokens = float((torch.cat([batch["chosen_len"], batch["rejected_len"]]).double() * w.repeat(2)).sum())
        return self._stats(losses, chosen, rejected, tokens, w)


def pad_id_of(model: nn.Module) -> int:
    """The pad id the score is read past: the tokenizer's pad token, else its EOS (TRL's choice), set on the config."""
    tok = model.tokenizer
    pad = tok.token_id("pad_token")
    pad = pad if pad is not None else tok.token_id("eos_token")
    if pad is None:
        raise KilnError(f"{getattr(tok, 'source', 'the tokenizer')}: a reward model reads each row at its last "
                        "non-pad token, but the tokenizer names neither a pad_token nor an eos_token")
    return pad


class RewardModelRecipe(FineTune):
    name = REWARD_MODEL
    summary = "a Bradley-Terry reward model on chosen/rejected pairs, exported as a one-label sequence classifier"
    when = f"model.task = {REWARD_MODEL!r}"
    data_schema = RewardData

    def matches(self, task: str, data: Mapping[str, Any]) -> bool:
        return task == REWARD_MODEL

    def fingerprint(self, cfg: RunConfig, labels: list[str] | None) -> dict[str, Any]:
        d = cfg.data
        return {"train": str(d.train), "train_sha256": source_sha256(d.train), "max_length": d.max_length,
                "eval_sha256": source_sha256(d.eval) if d.eval else None}

    def build(self, cfg: RunConfig, on_model: Callable[[nn.Module], None], world: World) -> RunParts:
        d = cfg.data
        assert isinstance(d, RewardData), f"reward-model builds from its own [data] schema, got {type(d).__name__}"
        train_records = read_records(d.train, d.format)
        eval_records = read_records(d.eval, d.format) if d.eval else None
        if cfg.model.num_labels not in (None, 1) or (cfg.model.labels is not None and len(cfg.model.labels) != 1):
            raise ConfigError("model.task = 'reward-model' has one output (the reward); remove model.num_labels / "
                              "model.labels or set num_labels = 1")
        if cfg.lora is not None:  # LoRA freezes every non-adapter weight and saves adapters only: the fresh
            # score head would neither train nor reach the export (no modules_to_save yet)
            raise ConfigError("model.task = 'reward-model' trains full weights for now: under [lora] its new score "
                              "head would stay frozen and be left out of the saved adapter; remove [lora]")
        head_cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"task": SEQUENCE_CLASSIFICATION})})
        model = build_model(head_cfg, ["LABEL_0"])
        on_model(model)
        settle_pack(d, model, cfg.model.path or cfg.model.family, lambda m: print(m) if world.main else None)
        check_text_model(cfg, model, d.max_length)
        model.config.pad_token_id = pad_id_of(model)
        train, stats = encode_reward_pairs(train_records, model.tokenizer, d.max_length)
        evals = None
        if eval_records is not None:  # checked before any training work, like the train rows
            evals, estats = encode_reward_pairs(eval_records, model.tokenizer, d.max_length)
        if world.main:
            print(f"reward-model: data.train {d.train}: {stats.line()}")
            if eval_records is not None:
                print(f"reward-model: data.eval {d.eval}: {estats.line()}")
        if not train:
            raise KilnError(f"data.train {d.train}: no pair left within data.max_length = {d.max_length}")
        section = getattr(cfg, "reward_model", None) or RewardSection()
        run = RewardRun(section, model.config.pad_token_id, evals, d.pack)
        return RunParts(model, train, eval_data=evals, step=run.step, evaluate=run.evaluate if evals else None,
                        callbacks=[run], fingerprint=self.fingerprint(cfg, None))


class RewardExtension(Extension):
    """[reward_model]: read by the reward-model recipe when it builds; refused on any other run."""
    section = "reward_model"
    schema = RewardSection
    summary = "the reward-model loss's options (center_rewards_coefficient)"
    recipes = (REWARD_MODEL,)

    def extend(self, cfg: RunConfig, parts: RunParts) -> None:
        # the recipe built its step from this table; what is left is to check the run is the recipe's own
        if not any(isinstance(c, RewardRun) for c in parts.callbacks):
            raise ConfigError("[reward_model] belongs to model.task = 'reward-model' runs")


RECIPE = RewardModelRecipe()
EXTENSION = RewardExtension()
