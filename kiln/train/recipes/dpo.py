"""dpo: preference optimization of a causal LM (DPO, IPO, hinge, SimPO, ORPO), on when the run config
has a [dpo] table.

[data] names preference rows (kiln.data.preference: `{"prompt", "chosen", "rejected"}` strings or
message lists, JSONL or an HF datasets source), tokenized as TRL 1.16's DPOTrainer. [dpo] picks the
loss (kiln.train.preference) and the reference the log-ratios are taken against:
- by default the starting weights: under [lora] the same model with its adapters switched off (no
  second copy); otherwise a frozen copy made before training starts (under FSDP sharded as the policy is);
- `reference = "path"`: another HF directory (placed, and sharded, as the copy is);
- `precompute_reference = true`: the reference's log-probs of every train and eval pair, computed once
  at the run's first step (each process a share), written beside the checkpoints
  (`reference_logps.safetensors`) and checked by its SHA-256 (kept in every checkpoint) on resume;
  no reference model stays in memory.
SimPO and ORPO need no reference. Log-probs come chunk by chunk through the LM head (kiln.train.logps).
Runs on one process or under `kiln launch` with DDP or FSDP2 ([parallel] fsdp); TP / EP / PP / CP /
compile / activation checkpointing are refused for now.
Each step returns its summed pair losses and pair count to the step engine; the Trainer updates once.
Metrics per step and at evaluation (`eval_` prefixed): loss, rewards/chosen, rewards/rejected,
rewards/margins, rewards/accuracy, logps/chosen, logps/rejected.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from pydantic import ConfigDict, Field, model_validator
from torch import nn

from kiln.data import read_records
from kiln.data.hfdata import source_sha256
from kiln.data.loader import pad_collate
from kiln.data.preference import Example, encode_preferences
from kiln.errors import ConfigError, KilnError
from kiln.hub.config import read_config
from kiln.hub.files import file_sha256, write_atomic
from kiln.hub.resolve import resolve_model_dir
from kiln.models.auto import load_pretrained
from kiln.models.common.lora import LoraLinear
from kiln.models.common.lora_experts import ExpertLora
from kiln.models.common.tied_grad import coalesce_tied_gradient
from kiln.models.common.wrapped import unwrap
from kiln.models.tasks import CAUSAL_LM
from kiln.parallel.world import World, all_reduce_sum, barrier
from kiln.train.config import NonNegative, Positive, RunConfig, Section, finite
from kiln.train.packing import Layout, lay_out, layout_logps, settle_pack
from kiln.train.plans import place_frozen
from kiln.train.preference import (
    LEARNS_CHOSEN,
    REFERENCE_FREE,
    LossType,
    PairLosses,
    Signal,
    differing_pairs,
    preference_losses,
)
from kiln.train.recipes.base import Extension, RunParts, add_lora, build_model, check_text_model
from kiln.train.recipes.finetune import FineTune
from kiln.train.recipes.pairwise import PackedData, ScoredRun, evaluating
from kiln.train.trainer import Trainer

CACHE = "reference_logps.safetensors"
STATS = ("pairs", "tokens", "loss", "rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margins",
         "logps/chosen", "logps/rejected")


class PreferenceData(PackedData):
    """[data] of a dpo run: preference rows; max_length caps each prompt + reply (the start is kept)."""


class DPOSection(Section):
    """[dpo]: the preference loss and its reference."""
    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_by_name=True,
                              serialize_by_alias=True)
    loss_type: LossType = "sigmoid"
    beta: Positive = 0.1                  # sigmoid / hinge / ipo / simpo temperature
    label_smoothing: finite(ge=0, lt=0.5) = 0.0       # sigmoid and simpo: the chance a label is flipped (conservative DPO)
    gamma: NonNegative = 0.5                 # simpo: the target margin (TRL's simpo_gamma)
    lambda_: NonNegative = Field(0.1, alias="lambda")  # orpo: weight of the odds-ratio term (TRL's ORPO beta)
    reference: str | None = None       # an HF directory; default: the starting weights
    precompute_reference: bool = False  # reference log-probs computed once, cached with the run

    @model_validator(mode="after")
    def _check(self) -> DPOSection:
        if not self.beta > 0:
            raise ValueError(f"dpo.beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing must lie in [0, 0.5), got {self.label_smoothing}")
        if self.loss_type in REFERENCE_FREE and (self.reference is not None or self.precompute_reference):
            raise ValueError(f"dpo.loss_type {self.loss_type!r} uses no reference; remove dpo.reference and "
                             "dpo.precompute_reference")
        return self


def pair_layout(batch: Mapping[str, torch.Tensor], pack: bool, whole: bool = False) -> Layout:
    """The B chosen sequences, then the B rejected, padded or packed (kiln.train.packing); mask "comp" scores
    their completions, and with `whole` mask "whole" every token (ORPO's NLL reads the prompt too)."""
    ids, comp = [], []
    for side in ("chosen", "rejected"):
        for i, n in enumerate(batch[f"{side}_len"].tolist()):
            ids.append(batch[f"{side}_ids"][i, :n])
            comp.append(batch[f"{side}_mask"][i, :n])
    masks = {"comp": comp}
    if whole:
        masks["whole"] = [torch.ones_like(c) for c in comp]
    return lay_out(ids, masks, pack)


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The LoRA model as its base: each adapter's output scaled by 0 (base + 0 is the base exactly)."""
    saved = [(m, m.scaling) for m in model.modules() if isinstance(m, (LoraLinear, ExpertLora))]
    try:
        for m, _ in saved:
            m.scaling = 0.0
        yield
    finally:
        for m, s in saved:
            m.scaling = s


class DPORun(ScoredRun):
    """The step, the evaluation, the reference and the per-step reward metrics of one dpo run."""
    STATS = STATS

    def __init__(self, cfg: DPOSection, train: list[Example], evals: list[Example] | None,
                 starting_copy: nn.Module | None, pack: bool = False):
        super().__init__(evals, pack, Signal("pairs", "chosen = rejected in every pair"))
        self.cfg, self.train = cfg, train
        self.placed = False
        self.started = False  # the first step's one-time setup done
        self.ref_model = starting_copy  # the frozen copy of the starting weights (full weights), placed by ready()
        self.cache: dict[str, torch.Tensor] | None = None  # split -> (pairs, 2) reference summed log-probs
        self.cache_sha: str | None = None

    # ---- the reference ------------------------------------------------------------------------
    def ready(self) -> None:
        """Once, at the run's first step or evaluation (the plans are applied by then): the reference model
        placed beside the policy (sharded as it is under FSDP), or the reference log-probs cached."""
        t, c = self.trainer, self.cfg
        assert t is not None, "wrap_engine gave this callback its trainer"
        if c.loss_type in REFERENCE_FREE or self.placed:
            return
        self.placed = True
        if c.precompute_reference and self.cache is not None:  # resumed: read in load_state_dict
            return
        if c.precompute_reference and t.step > 0:  # resumed from a checkpoint that recorded no cache
            self._read_cache(t.out_dir / CACHE)
            return
        if c.reference is not None:
            self.ref_model = load_pretrained(c.reference, task=CAUSAL_LM)
        if self.ref_model is not None:
            self.ref_model = place_frozen(self.ref_model, t.device, t.plan, t.parallel, not t.args.exact)
        if c.precompute_reference:  # a fresh run: the policy (or dpo.reference) holds the reference weights now
            self._write_cache(t.out_dir / CACHE)
            self.ref_model = None  # cached: no reference stays in memory

    def _reference_model(self, model: nn.Module) -> tuple[nn.Module, contextlib.AbstractContextManager]:
        if self.ref_model is not None:
            return self.ref_model, contextlib.nullcontext()
        return model, adapters_off(model)

    @torch.no_grad()
    def _live_reference(self, model: nn.Module, layout: Layout) -> torch.Tensor:
        """(2B,) the reference's summed completion log-probs."""
        ref, off = self._reference_model(model)
        with off, evaluating(ref):
            return layout.per_sequence(layout_logps(ref, layout, "comp"))

    def _write_cache(self, path: Path) -> None:
        from safetensors.torch import save_file

        t = self.trainer
        world, shards, rank = t.world, t.data_shards, t.data_rank
        out: dict[str, torch.Tensor] = {}
        for split, examples in (("train", self.train), ("eval", self.evals or [])):
            values = torch.zeros(len(examples), 2, dtype=torch.float64, device=t.device)
            for idx, batch in self._share(examples, rank, shards):
                layout = pair_layout(batch, self.pack)
                n = layout.n // 2
                with t.autocast():
                    ref = self._live_reference(t.model, layout)
                values[idx] = torch.stack([ref[:n], ref[n:]], dim=1).double()
            out[split] = all_reduce_sum(values, world).float().cpu()
        if world.main:
            pairs = json.dumps({k: len(v) for k, v in out.items()})
            write_atomic(path, lambda tmp: save_file(out, str(tmp), metadata={"pairs": pairs}), umask_mode=True)
        barrier(world)
        self.cache, self.cache_sha = out, file_sha256(path)
        if world.main:
            print(f"dpo: reference log-probs of {len(self.train)} train and {len(self.evals or [])} eval pairs "
                  f"cached in {path} (sha256 {self.cache_sha[:12]})")

    def _read_cache(self, path: Path) -> None:
        from safetensors.torch import load_file

        if not path.is_file():
            raise KilnError(f"{path}: the precomputed reference log-probs of this run are missing; "
                            "they are written when the run starts and a resume needs them")
        self.cache, self.cache_sha = load_file(str(path)), file_sha256(path)
        for split, examples in (("train", self.train), ("eval", self.evals or [])):
            have = len(self.cache.get(split, ()))
            if have != len(examples):
                raise KilnError(f"{path}: cached reference log-probs of {have} {split} pairs, but the data has "
                                f"{len(examples)}; the data changed since the run started")

    def state_dict(self, trainer: Trainer) -> dict[str, Any] | None:
        return {"reference_sha256": self.cache_sha} if self.cache_sha else None

    def load_state_dict(self, trainer: Trainer, state: dict[str, Any]) -> None:
        want = state.get("reference_sha256")
        if want and self.cfg.precompute_reference:
            self._read_cache(trainer.out_dir / CACHE)
        if want and want != self.cache_sha:
            raise KilnError(f"{trainer.out_dir / CACHE}: sha256 {self.cache_sha} differs from the {want} recorded "
                            "in the checkpoint; the cached reference log-probs changed since it was saved")

    def _reference(self, model: nn.Module, batch: Mapping[str, torch.Tensor], split: str,
                   layout: Layout) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.cfg.loss_type in REFERENCE_FREE:
            return None, None
        if self.cache is not None:
            values = self.cache[split].to(layout.input_ids.device)[batch["index"]]  # (B, 2)
            return values[:, 0], values[:, 1]
        ref = self._live_reference(model, layout)
        n = layout.n // 2
        return ref[:n], ref[n:]

    # ---- the step -----------------------------------------------------------------------------
    def pair_losses(self, model: nn.Module, batch: Mapping[str, torch.Tensor], split: str) -> tuple[PairLosses, int]:
        """The micro-batch's per-pair losses (through the policy's one forward over chosen + rejected)."""
        c = self.cfg
        orpo = c.loss_type == "orpo"
        layout = pair_layout(batch, self.pack, whole=orpo)
        n = layout.n // 2
        ref_chosen, ref_rejected = self._reference(model, batch, split, layout)  # before the policy:
        # under DDP the forward that builds the graph must be the last one before backward
        logps = layout_logps(model, layout, "whole" if orpo else "comp")  # (R, W); ORPO's NLL reads the prompt
        sums, counts = layout.per_sequence(logps * layout.scored["comp"]), layout.count("comp")
        nll = None
        if orpo:  # the mean over the chosen sequences' tokens (as TRL's)
            nll = -layout.per_sequence(logps)[:n].sum() / layout.count("whole")[:n].sum().clamp(min=1)
        pl = preference_losses(c.loss_type, sums[:n], sums[n:], counts[:n], counts[n:], ref_chosen=ref_chosen,
                               ref_rejected=ref_rejected, beta=c.beta, label_smoothing=c.label_smoothing,
                               gamma=c.gamma, lam=c.lambda_, chosen_nll=nll)
        return pl, layout.tokens()

    def step(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
        if not self.started:  # a tied embedding's gradient without its dense transient (unsharded weights),
            self.started = True  # and the head's made after the backbone's backward freed its activations
            assert self.trainer is not None, "wrap_engine gave this callback its trainer"
            if not self.trainer.sharded:
                coalesce_tied_gradient(unwrap(model), defer_head_grad=True)
        self.ready()
        pl, tokens = self.pair_losses(model, batch, "train")
        learns_chosen = self.cfg.loss_type in LEARNS_CHOSEN  # its NLL term learns the chosen side of any pair
        self.signal.add(differing_pairs(batch) | learns_chosen)
        self.sums += self._stats(pl, tokens, torch.ones_like(pl.losses))
        return pl.losses.sum(), pl.losses.shape[0]

    @staticmethod
    def _stats(pl: PairLosses, tokens: int, weight: torch.Tensor) -> torch.Tensor:
        w = weight.double()
        margins = pl.chosen_rewards - pl.rejected_rewards
        parts = [w.sum(), torch.tensor(float(tokens), dtype=torch.float64, device=w.device),
                 (pl.losses.detach().double() * w).sum()]
        parts += [(x.double() * w).sum() for x in (pl.chosen_rewards, pl.rejected_rewards, (margins > 0).double(),
                                                    margins, pl.chosen_logps, pl.rejected_logps)]
        return torch.stack(parts).cpu()

    # ---- evaluation ---------------------------------------------------------------------------
    def _share(self, examples: list[Example], rank: int, shards: int,
               limit: int | None = None) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor]]]:
        """(indices, batch) over this rank's share: ranks get equally many batches (sharded weights
        gather in every forward), the short ones repeating an example whose `weight` is 0."""
        t = self.trainer
        size, total = t.args.batch_size, len(examples)
        per_rank = math.ceil(total / shards)
        mine = list(range(rank, total, shards))
        weights = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))
        mine += [mine[-1] if mine else 0] * (per_rank - len(mine))
        for b, s in enumerate(range(0, per_rank, size)):
            if limit is not None and b >= limit:
                return
            idx = mine[s:s + size]
            batch = pad_collate([examples[i] for i in idx])
            batch["weight"] = torch.tensor(weights[s:s + size], dtype=torch.float64)
            yield torch.tensor(idx, device=t.device), {k: v.to(t.device) for k, v in batch.items()}

    def eval_batches(self, trainer: Trainer) -> Iterator[dict[str, torch.Tensor]]:
        return (batch for _, batch in self._share(self.evals or [], trainer.data_rank, trainer.data_shards,
                                                  trainer.args.eval_batches))

    def eval_sums(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        pl, _ = self.pair_losses(model, batch, "eval")
        weight = batch["weight"]
        tokens = int((torch.cat([batch["chosen_len"], batch["rejected_len"]]).double() * weight.repeat(2)).sum())
        return self._stats(pl, tokens, weight)


class DPO(FineTune):
    name = "dpo"
    summary = "preference optimization of a causal LM (DPO, IPO, hinge, SimPO, ORPO) on chosen/rejected pairs"
    when = "a [dpo] table"
    data_schema = PreferenceData

    def matches(self, task: str, data: Mapping[str, Any]) -> bool:
        return False  # chosen by its table ([dpo]), never by the data alone

    def fingerprint(self, cfg: RunConfig, labels: list[str] | None) -> dict[str, Any]:
        d = cfg.data
        return {"train": str(d.train), "train_sha256": source_sha256(d.train), "max_length": d.max_length,
                "eval_sha256": source_sha256(d.eval) if d.eval else None}

    def build(self, cfg: RunConfig, on_model: Callable[[nn.Module], None], world: World) -> RunParts:
        d = cfg.data
        assert isinstance(d, PreferenceData), f"dpo builds from its own [data] schema, got {type(d).__name__}"
        if cfg.model.task != CAUSAL_LM:
            raise ConfigError(f"[dpo] trains a causal LM: set model.task = {CAUSAL_LM!r} (got {cfg.model.task!r})")
        train_records = read_records(d.train, d.format)
        eval_records = read_records(d.eval, d.format) if d.eval else None
        model = build_model(cfg, None)
        on_model(model)
        settle_pack(d, model, cfg.model.path or cfg.model.family, lambda m: print(m) if world.main else None)
        check_text_model(cfg, model, d.max_length)
        add_lora(cfg, model)
        train, stats = encode_preferences(train_records, model.tokenizer, d.max_length)
        if world.main:
            print(f"dpo: data.train {d.train}: {stats.line()}")
        if not train:
            raise KilnError(f"data.train {d.train}: no preference pair left within data.max_length = {d.max_length}")
        check_signal(cfg, stats, world)
        evals = None
        if eval_records is not None:
            evals, estats = encode_preferences(eval_records, model.tokenizer, d.max_length)
            if world.main:
                print(f"dpo: data.eval {d.eval}: {estats.line()}")
        return RunParts(model, train, eval_data=evals, fingerprint=self.fingerprint(cfg, None))


class DPOExtension(Extension):
    section = "dpo"
    schema = DPOSection
    summary = "preference optimization: the loss ([dpo] loss_type, beta, ...) and its reference"
    recipes = ("dpo",)
    recipe = "dpo"  # the recipe this table selects (kiln.train.recipes picks it when [dpo] is present)
    # no named flags: `--set dpo.KEY=VALUE` sets any key (a flag would need kiln.cli.recipe_flags' mirror table)

    def check(self, cfg: RunConfig, recipe: Any) -> None:
        super().check(cfg, recipe)
        p = cfg.parallel
        if p is not None and (p.compile or p.activation_checkpointing != "none"
                              or any(getattr(p, k, 1) > 1 for k in ("tp", "ep", "pp", "cp"))):
            raise ConfigError("[dpo] runs on one process, under DDP or under FSDP ([parallel] dp and fsdp); "
                              "parallel.tp, ep, pp, cp, compile and activation_checkpointing are not supported with "
                              "it yet")

    def extend(self, cfg: RunConfig, parts: RunParts) -> None:
        c, evals = cfg.dpo, parts.eval_data
        if c.reference is not None and c.loss_type not in REFERENCE_FREE:
            check_reference_vocab(c.reference, parts.model)
        copy_needed = c.loss_type not in REFERENCE_FREE and c.reference is None and cfg.lora is None \
            and not c.precompute_reference
        if copy_needed and getattr(parts.model, "deferred_read", None) is not None:
            raise ConfigError("[dpo] with the weights read sharded (fsdp / tp / pp from model.path): the default "
                              "reference is a whole copy of the starting weights, which no process holds; use [lora] "
                              "(the reference is the base), dpo.reference or dpo.precompute_reference")
        # the starting weights (a resume loads its own later): frozen, sharded beside the policy at the first step
        starting = copy.deepcopy(parts.model) if copy_needed else None
        run = DPORun(c, list(parts.data), list(evals) if evals is not None else None, starting, cfg.data.pack)
        parts.step = run.step
        parts.evaluate = run.evaluate if evals else None
        parts.callbacks.append(run)


def check_signal(cfg: RunConfig, stats: Any, world: World) -> None:
    """A pair whose chosen and rejected tokens are the same carries no preference: its loss has no gradient
    (only ORPO's NLL on the chosen reply still learns from it). All such: refused; some: said once, counted."""
    n, same = stats.pairs, stats.identical
    if not same:
        return
    learns_chosen = cfg.dpo.loss_type in LEARNS_CHOSEN
    if same == n and not learns_chosen:
        raise KilnError(f"data.train {cfg.data.train}: every one of its {n} preference pairs has chosen = rejected "
                        f"(once tokenized and cut to data.max_length = {cfg.data.max_length}), so dpo.loss_type "
                        f"{cfg.dpo.loss_type!r} has nothing to learn from them")
    if world.main:
        print(f"warning: data.train {cfg.data.train}: {same} of {n} preference pairs have chosen = rejected and carry "
              f"no preference signal{' (only the chosen reply is learned from them)' if learns_chosen else ''}; "
              f"{n - same} carry signal", file=sys.stderr)


def check_reference_vocab(reference: str, model: nn.Module, key: str = "dpo.reference") -> None:
    """A reference (`key`: dpo.reference, kto.reference) scores the tokenizer's ids: its vocabulary must hold them
    all (read from its config.json now, so a smaller one is refused naming both sizes, not an IndexError at the
    first step)."""
    try:
        config = read_config(resolve_model_dir(reference))
    except ConfigError as e:
        raise ConfigError(f"{key}: {e}") from None
    vocab = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    tok = getattr(model, "tokenizer", None)
    if isinstance(vocab, int) and tok is not None and tok.vocab_size > vocab:
        raise ConfigError(f"{key} {reference}: its vocab_size is {vocab} but the tokenizer has "
                          f"{tok.vocab_size} tokens; ids {vocab}..{tok.vocab_size - 1} would index past the "
                          "reference's embedding table. Use a reference with the policy's vocabulary")


RECIPE = DPO()
EXTENSION = DPOExtension()
