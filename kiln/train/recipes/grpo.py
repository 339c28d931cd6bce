"""[grpo]: RL with verifiable rewards, the GRPO family (grpo, dr_grpo, dapo, bnpo), on a causal LM (full or [lora]).

data.train is a prompts file (JSONL, CSV or HF datasets): `prompt` (grpo.prompt_field) a string or a message
list (rendered with the chat template and its generation prompt); every other column goes to the reward
functions. A step's rollout: `grad_accum` batches of `train.batch_size` prompts, each prompt sampled
`num_generations` times on the generation engine (kiln.train.grpo_engine: one request per prompt, its prefill
shared by the group; a model it does not run is refused: engfsdp) on the weights being trained, in
place; the completions scored (kiln.train.rewards), advantages taken within each prompt's group
(kiln.train.grpo_loss), then `num_iterations` optimizer steps on that rollout, each through the Trainer's one
`update`. Log-probs are those of logits / temperature (as TRL's): after engine rollouts with `exact_logprobs`,
through the engine's kernels in one packed pass (the sampler's bits); else chunked through the LM head of the
training forward (kiln.train.logps). The training forward packs each micro-batch's prompt + completion sequences
into rows, attention and positions per sequence (`data.pack`, on by default where the model keeps samples apart:
kiln.train.packing.completion_logps), equal to its padded rows within fp32 rounding.

`sampler = "fast"` (default) takes the sampler's log-probs from the decode itself (no extra forward) as the old
policy's; `"exact"` recomputes them with the trainer's own forward on the same micro-batches, so they equal the
first update's bit for bit. `logprob_gap` is the largest |sampler - trainer| log-prob of a completion token at
the rollout's first update: 0 on the engine's kernels and on the exact path, the rounding between two
computations otherwise. With beta > 0
the KL is to the starting weights: under [lora] the base with the adapters off (no copy), else a frozen copy.

Each rollout's sampling seed derives from (train.seed, rollout, the micro-batch's place in the global batch: one
process with grad_accum k samples what k processes do), and the rollout being worked on is saved with each
checkpoint: a run resumed mid-rollout continues exactly. Metrics: reward,
reward/<function>, reward_std, completion_length, clip_ratio, kl (beta > 0), logprob_gap, groups_with_signal
(prompt groups whose rewards differ; none: warned once), reward_errors and
reward_timeouts (users' reward calls that raised or hung, when any did); with data.eval,
eval_reward and eval_reward/<function> of greedy completions.

[grpo] env / tools (multi-turn episodes, kiln.train.agent_rollout) run on one process, DDP or FSDP2: under FSDP2
the whole model is gathered once for a rollout and every rank runs its own episodes turn by turn on it, with no
collective between turns (ranks' episodes end after different numbers of turns).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kiln.data import read_records
from kiln.data.hfdata import source_sha256
from kiln.errors import ConfigError, KilnError
from kiln.models.common.tied_grad import coalesce_tied_gradient
from kiln.parallel.world import World, all_reduce_sum, gather_objects
from kiln.train import grpo_alarms
from kiln.train.agent_rollout import Dialect, EpisodeRunner, env_reward, episode_record
from kiln.train.config import DataSection, RunConfig
from kiln.train.engine import (
    DataParallel,
    StepContext,
    StepEngine,
    StepOutcome,
    Window,
    gradient_sync,
    mean_gradients,
)
from kiln.train.envs import resolve_env
from kiln.train.grpo_alarms import named
from kiln.train.grpo_config import GRPOSection
from kiln.train.grpo_loss import (
    advantages,
    clipped,
    combine_rewards,
    is_correction,
    loss_parts,
    rloo_advantages,
    token_loss,
)
from kiln.train.grpo_rollout import GRPORun, Prompts, check_prompt_kinds, core_of, rollout_seed
from kiln.train.packing import completion_logps, settle_pack
from kiln.train.plans import place_frozen
from kiln.train.preference import Signal
from kiln.train.recipes.base import Extension, Recipe, RunParts, add_lora, build_model, check_text_model
from kiln.train.recipes.dpo import adapters_off
from kiln.train.recipes.finetune import RecordsData
from kiln.train.rewards import Reward, check_columns, resolve_rewards
from kiln.train.trainer import Callback, Trainer


def _pack(t: torch.Tensor | int | None) -> Any:
    """A tensor as JSON (checkpoints keep the engine's state in trainer.json); float32 values round-trip exactly."""
    if not isinstance(t, torch.Tensor):
        return t
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "data": t.flatten().tolist()}


def _unpack(v: Any, device: torch.device) -> Any:
    if not isinstance(v, dict):
        return v
    return torch.tensor(v["data"], dtype=getattr(torch, v["dtype"])).reshape(v["shape"]).to(device)


class GRPOEngine(StepEngine):
    """A step: (every num_iterations-th step) a new rollout, then forward and backward of its micro-batches."""

    def __init__(self, inner: StepEngine, run: GRPORun, pack: bool = False):
        if not isinstance(inner, DataParallel):
            raise ConfigError(f"[grpo] runs on the data-parallel engine (one process, DDP, FSDP2); this run's "
                              f"[parallel] settings make a {type(inner).__name__}")
        self.inner, self.run, self.pack = inner, run, pack
        self.placed = False  # the reference copy (full weights, beta > 0) is placed beside the policy on first use
        self.started = False  # the first step's one-time setup done
        self.keep_grads = inner.keep_grads
        self.buffer: list[dict[str, Any]] | None = None   # the rollout being worked on
        self.stats: dict[str, float] = {}                  # its reward metrics
        self.alarms = grpo_alarms.Alarms()
        self.signal = Signal("groups", "each prompt's completions rewarded alike, or not at all")
        self.none_streak = grpo_alarms.NoneStreak()  # sweep2: no reward at all from the start: refused

    # -- the rollout --
    def rollout(self, run: StepContext) -> None:
        r, g = self.run, self.run.g
        if r.reference is not None and not self.placed:  # beside the policy: on its device, sharded as it is
            r.reference = place_frozen(r.reference, run.device, run.plan, run.parallel, not run.args.exact)
            self.placed = True
        index = run.step // g.num_iterations
        self.finish_rollout(run, index, *self.sampled(run, index))  # agent3: split for async

    def sampled(self, run: StepContext, index: int) -> tuple[list[dict[str, Any]], list[list[int]], list[Any]]:
        """Rollout `index` sampled now from the policy (agent3: grpo_async's engine takes it from its worker)."""
        rows = [run.next_batch()["row"].tolist() for _ in range(run.args.grad_accum)]
        sampled = sample_rollout(self.run, core_of(run.model), run, index, rows)
        if self.run.rollouts is not None:
            self.run.rollouts.release_head()  # not beside the update's activations
        return sampled

    def finish_rollout(self, run: StepContext, index: int, micros: list[dict[str, Any]],  # agent3: split for async
                       row_lists: list[list[int]], episodes: list[Any]) -> None:
        """Rewards to advantages, the trainer's log-probs, the alarms and the metrics of a sampled rollout."""
        r, g = self.run, self.run.g
        per_func = torch.cat([m["per_func"] for m in micros])
        lengths = [m["completion_mask"].sum(1).double().cpu() for m in micros]  # beside the rewards (CPU)
        rewards = combine_rewards(per_func, r.weights)
        if g.advantage_estimator == "rloo":
            adv = rloo_advantages(rewards, g.num_generations)
            if g.normalize_advantages:  # over every rank's advantages, as TRL's gathered batch
                adv = rloo_advantages(rewards, g.num_generations, True,
                                      self._global_mean_std(run, adv) if run.world.active else None)
        else:
            batch_std = None
            if g.scale_rewards == "batch" and run.world.active:  # the std over every rank's rewards (TRL's batch)
                batch_std = self._global_mean_std(run, rewards)[1]
            adv = advantages(rewards, g.num_generations, g.scale_rewards, batch_std)
        alarm_counts = torch.zeros(9, dtype=torch.float64)
        start = 0
        for micro, eps in zip(micros, episodes):
            n = micro["input_ids"].size(0)
            alarm_counts += grpo_alarms.counts(micro, rewards[start: start + n], g.num_generations, eps)
            micro["advantages"] = adv[start: start + n].to(run.device)
            start += n
            if g.mask_truncated_completions:  # TRL's: a completion cut by the budget carries no loss
                micro["loss_mask"] = micro["loss_mask"] * (~micro["truncated"]).long()[:, None]
            with torch.no_grad(), run.autocast():
                if g.sampler == "exact" or g.async_:  # the trainer's forward: the first update's values (agent3: async)
                    micro["old_logps"] = self.logps(run.model, micro)
                else:
                    micro["old_logps"] = micro["sampler_logps"]
                if g.importance_sampling_correction:
                    micro["is_ratio"] = is_correction(micro["old_logps"], micro["sampler_logps"], micro["loss_mask"],
                                                      g.importance_sampling_mode, g.importance_sampling_clip_min,
                                                      g.importance_sampling_clip_max)
                if g.beta != 0.0:
                    micro["ref_logps"] = self.reference_logps(run.model, micro)
            del micro["per_func"]
        if g.log_rollouts_every and index % g.log_rollouts_every == 0:
            self._log_rollouts(run, index, micros, row_lists, episodes, per_func)
        self.buffer = micros
        self.stats = self._reward_stats(run, per_func, rewards, torch.cat(lengths))
        total = all_reduce_sum(alarm_counts.to(run.device), run.world).cpu()
        self.stats.update(grpo_alarms.metrics(total, g.multi_turn))
        self.signal.check(float(total[3] - total[4]), float(total[3]), run.step + 1, run.world.main)
        self.none_streak.check(total, [x.name for x in r.rewards], run.step + 1, run.step + 1 >= run.total_steps)  # sweep2
        if r.guarded:  # users' reward calls that failed this rollout, every rank's (named only when some did)
            failed = all_reduce_sum(torch.tensor(r.guard.take(), dtype=torch.float64).to(run.device), run.world)
            for name, count in zip(("reward_errors", "reward_timeouts"), failed.cpu().tolist()):
                if count:
                    self.stats[name] = count

    def logps(self, model: nn.Module, micro: dict[str, Any]) -> torch.Tensor:
        """(N, C) the completions' log-probs under `model`: the micro-batch's sequences packed (data.pack), or the
        rollout's own padded rows (and the engine's kernels with exact_logprobs)."""
        if self.pack and not self.run.exact(model):
            return completion_logps(model, micro, self.run.g.temperature)
        return self.run.logps(model, micro)

    @torch.no_grad()
    def reference_logps(self, model: nn.Module, micro: dict[str, Any]) -> torch.Tensor:
        """The reference's: the frozen copy, or under [lora] the policy with its adapters off."""
        if not self.pack:
            return self.run.reference_logps(model, micro)
        if self.run.reference is not None:
            return self.logps(self.run.reference, micro)
        with adapters_off(core_of(model)):
            return self.logps(core_of(model), micro)

    def _log_rollouts(self, run: StepContext, index: int, micros: list[dict[str, Any]], row_lists: list[list[int]],
                      episodes: list[Any], per_func: torch.Tensor) -> None:
        """RUN_DIR/rollouts.jsonl: every completion (or episode) of this rollout, from every rank."""
        r, g = self.run, self.run.g
        names = [f.name for f in r.rewards]
        records, start = [], 0
        for micro, rows, eps in zip(micros, row_lists, episodes):
            n = micro["input_ids"].size(0)
            if eps is not None:
                records += [episode_record(e, run.step + 1, named(per_func[start + i], names))
                            for i, e in enumerate(eps)]
            else:
                records += grpo_alarms.single_turn_records(micro, rows, g.num_generations, per_func[start: start + n],
                                                           names, r.tokenizer, run.step + 1)
            start += n
        everything = [rec for rank in gather_objects(records, run.world) for rec in rank]
        if run.world.main:
            grpo_alarms.append_records(Path(run.args.out_dir) / "rollouts.jsonl", everything)

    def _global_mean_std(self, run: StepContext, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The NaN-skipping mean and unbiased std of `x` over every rank's values."""
        ok = ~torch.isnan(x)
        s = all_reduce_sum(torch.stack([x[ok].double().sum(), (x[ok].double() ** 2).sum(),
                                        ok.sum().double()]).to(run.device), run.world).cpu()
        mean = s[0] / s[2]
        return mean.float(), ((s[1] - s[2] * mean ** 2) / (s[2] - 1)).clamp(min=0).sqrt().float()

    def _reward_stats(self, run: StepContext, per_func: torch.Tensor, rewards: torch.Tensor,
                      lengths: torch.Tensor) -> dict[str, float]:
        """reward, reward/<f>, reward_std, completion_length over every rank's completions of the rollout."""
        cols = [rewards, *per_func.T]
        parts = []
        for c in cols:
            ok = ~torch.isnan(c)
            parts += [c[ok].double().sum(), (c[ok].double() ** 2).sum(), ok.sum().double()]
        parts += [lengths.sum(), torch.tensor(float(lengths.numel()), dtype=torch.float64)]
        s = all_reduce_sum(torch.stack(parts).to(run.device), run.world).cpu()
        stats = {}
        for j, name in enumerate(["reward", *(f"reward/{f.name}" for f in self.run.rewards)]):
            total, sq, n = s[3 * j], s[3 * j + 1], s[3 * j + 2]
            stats[name] = float(total / n) if n > 0 else float("nan")
            if j == 0:
                var = (sq - n * (total / n) ** 2) / (n - 1) if n > 1 else torch.tensor(0.0)
                stats["reward_std"] = float(var.clamp(min=0).sqrt())
        stats["completion_length"] = float(s[-2] / s[-1])
        return stats

    # -- a step --
    def gradients(self, run: StepContext) -> StepOutcome:
        g = self.run.g
        if not self.started:  # a tied embedding's gradient without its dense transient (unsharded weights)
            self.started = True
            if not run.sharded:
                coalesce_tied_gradient(core_of(run.model))
        iteration = run.step % g.num_iterations
        if iteration == 0 or self.buffer is None:
            self.rollout(run)
        assert self.buffer is not None
        window = Window.on(run.device)
        spec = g.loss_spec()
        # clipped tokens, tokens, kl sum, largest |sampler - trainer| log-prob
        sums = torch.zeros(4, dtype=torch.float64)
        for m, micro in enumerate(self.buffer):
            last = m == len(self.buffer) - 1
            with gradient_sync(run, last), run.autocast():
                logps = self.logps(run.model, micro)
                lmask = micro.get("loss_mask", micro["completion_mask"])  # the policy's own tokens
                t = token_loss(logps, micro["old_logps"], micro["advantages"], spec, micro.get("ref_logps"), lmask,
                               micro.get("is_ratio"), micro["sampler_logps"])
                part, n = loss_parts(g.loss_type, t.loss, lmask, g.budget)
            (run.scaler.scale(part) if run.scaler else part).backward()
            window.loss_sum += part.detach().to(torch.float64)
            window.count += n.to(run.device)
            window.tokens += int(micro["attention_mask"].sum())
            with torch.no_grad():
                on = lmask.bool()
                held = clipped(t.ratio, micro["advantages"], spec.eps_low, spec.eps_high).expand_as(on)
                sums[0] += float(held[on].sum())
                sums[1] += float(on.sum())
                if t.kl is not None:
                    sums[2] += float(t.kl[on].double().sum())
                if iteration == 0 and on.any():
                    sampler = micro["old_logps"] if g.sampler == "exact" else micro["sampler_logps"]
                    sums[3] = max(float(sums[3]), float((sampler - logps.detach())[on].abs().max()))
        if self.run.exact(run.model) and isinstance(run.model, DistributedDataParallel):
            average_gradients(run.model, run.world.size)
        if run.plan is not None:
            run.plan.sync_gradients()
        loss = mean_gradients(run, window)
        gap = torch.tensor([float(sums[3])], device=run.device)
        sums = all_reduce_sum(sums[:3].to(run.device), run.world).cpu()
        if run.world.active:
            torch.distributed.all_reduce(gap, op=torch.distributed.ReduceOp.MAX)
        extra = dict(self.stats)
        extra["clip_ratio"] = float(sums[0] / sums[1].clamp(min=1))
        if g.beta != 0.0:
            extra["kl"] = float(sums[2] / sums[1].clamp(min=1))
        if iteration == 0:
            extra["logprob_gap"] = float(gap[0])
        self.alarms.check(extra, run.step + 1, run.world.main)
        samples = sum(m["input_ids"].size(0) for m in self.buffer) * run.data_shards
        return StepOutcome(loss, window.tokens * run.data_shards, samples, extra=extra)

    def clip(self, run: StepContext, max_norm: float) -> float:
        return self.inner.clip(run, max_norm)

    # -- resume: the rollout being worked on and its metrics, every rank's own --
    def state_dict(self, run: StepContext) -> dict[str, Any] | None:
        mine = None if self.buffer is None else {
            "micros": [{k: _pack(v) for k, v in m.items()} for m in self.buffer], "stats": self.stats}
        return {"ranks": gather_objects(mine, run.world)}

    def load_state_dict(self, run: StepContext, state: dict[str, Any]) -> None:
        ranks = state.get("ranks", [])
        if len(ranks) != run.world.size:
            raise KilnError(f"this checkpoint's [grpo] rollout was saved by {len(ranks)} processes; resume it on "
                            f"as many (this run has {run.world.size})")
        mine = ranks[run.world.rank]
        if mine is None:
            return
        self.buffer = [{k: _unpack(v, run.device) for k, v in m.items()} for m in mine["micros"]]
        self.stats = dict(mine["stats"])


def sample_rollout(r: GRPORun, core: nn.Module, run: StepContext, index: int, rows: list[list[int]]  # agent3
                   ) -> tuple[list[dict[str, Any]], list[list[int]], list[Any]]:
    """Rollout `index`'s micro-batches of prompt `rows` sampled from `core` (the policy, or under [grpo] async a
    copy of it at an earlier step): (micro-batches, their rows, their episodes or None each)."""
    micros, episodes = [], []
    decoder = r.decoder(core, run.sharded, run.world.main)  # serves every micro-batch of this rollout
    # under FSDP2 the whole model is gathered once for the rollout (collective: every rank enters together),
    # so each rank's episodes take as many turns as they take, with no collective between turns
    with decoder.rollouts.weights(core) if r.g.multi_turn else nullcontext():
        for m, batch in enumerate(rows):
            with torch.no_grad(), run.autocast():
                micros.append(r.sample(decoder, batch, r.prompts, r.g.num_generations,
                                       rollout_seed(r.seed, index, m * run.data_shards + run.data_rank), run.device))
            episodes.append(r.last_episodes if r.g.multi_turn else None)
    return micros, list(rows), episodes


def average_gradients(model: nn.Module, world_size: int) -> None:
    """DDP's gradient average, by hand: the engine's kernels call the module's submodules, not DDP's forward, so
    DDP's reducer is never armed for that backward (its hooks return at once) and each rank holds its own sum.
    Divided before the sum, as DDP divides."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return
    flat = _flatten_dense_tensors(grads).div_(world_size)
    torch.distributed.all_reduce(flat)
    for g, f in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(f)


class GRPOCallback(Callback):
    """Installs the GRPO engine; after each optimizer update, the generation engine forgets its prompt blocks."""

    def __init__(self, run: GRPORun, pack: bool = False):
        self.run, self.pack = run, pack

    def wrap_engine(self, trainer: Trainer, engine: StepEngine) -> StepEngine:
        return GRPOEngine(engine, self.run, self.pack)

    def on_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        if self.run.rollouts is not None:  # the weights changed: blocks remembered before hold stale keys
            self.run.rollouts.forget(core_of(trainer.model))


# agent3: the callback of [grpo] async = true (kiln.train.grpo_async's AsyncCallback, which subclasses the engine
# above: it registers itself here rather than be imported from here, which would make an import cycle)
ASYNC_CALLBACK: list[type[GRPOCallback]] = []


# ---- the recipe and its table -------------------------------------------------------------------
class PromptsData(RecordsData):
    """[data] of a grpo run: the prompts file."""
    pack: bool = True  # the update's sequences (prompt + completion) packed into rows, attention kept per sequence
                       # (where the model cannot keep them apart, one per row: kiln.train.packing)


class GRPORecipe(Recipe):
    name = "grpo"
    summary = "RL with verifiable rewards: sampled groups, reward functions, group-relative clipped policy loss"
    when = "a [grpo] table"
    data_schema: type[DataSection] = PromptsData   # data.train: the prompts; data.eval: held-out prompts

    def matches(self, task: str, data: Mapping[str, Any]) -> bool:
        return False  # chosen by its table ([grpo]), never by the data alone

    def build(self, cfg: RunConfig, on_model: Callable[[nn.Module], None], world: World) -> RunParts:
        g, d = cfg.grpo, cfg.data
        if cfg.train.epochs is not None and g.num_iterations > 1:
            raise ConfigError("[grpo] with num_iterations > 1 counts its length in train.steps: an epoch of prompts "
                              "takes num_iterations times the steps train.epochs would allow")
        search = [Path(d.train).resolve().parent]
        # before any model or data work: the rewards, the environment and tools
        env = resolve_env(g.env, g.tools, search, g.env_timeout)
        rewards = resolve_rewards(g.rewards, g.reward_weights, search, format_pattern=g.format_pattern,
                                  max_new_tokens=g.max_new_tokens, env=env is not None and env.factory is not None)
        if env is not None and env.factory is not None:
            rewards.append(Reward("env", env_reward, 1.0))
        train_records = read_records(d.train, d.format)
        eval_records = read_records(d.eval, d.format) if d.eval else None
        for records, source in ((train_records, f"data.train {d.train}"), (eval_records, f"data.eval {d.eval}")):
            if records:  # before the model is built: a file the rewards cannot score is refused now
                check_prompt_kinds(records, g.prompt_field, source)
                check_columns(rewards, records, source)
        model = build_model(cfg, None)
        on_model(model)
        check_text_model(cfg, model, None)
        if not hasattr(model, "new_cache"):
            raise ConfigError(f"[grpo] samples from a causal LM; {type(model).__name__} is not one")
        settle_pack(d, model, cfg.model.path or cfg.model.family, lambda m: print(m) if world.main else None)
        reference = None
        if g.beta != 0.0 and cfg.lora is None:  # the starting weights, frozen (under [lora]: the adapters off)
            reference = copy.deepcopy(model).eval().requires_grad_(False)
        add_lora(cfg, model)
        prompts = Prompts(train_records, model.tokenizer, g.prompt_field, d.max_length, f"data.train {d.train}")
        evals = (Prompts(eval_records, model.tokenizer, g.prompt_field, d.max_length, f"data.eval {d.eval}")
                 if eval_records else None)
        for p in (prompts, evals):  # sweep2: a budget past the model's positions is refused before any work
            if p is not None:
                grpo_alarms.check_positions(model.config, p.ids, p.where, g.max_new_tokens)
        runner = None
        if env is not None:  # the template checked (renders tools, a parser, prefix-preserving) before any work
            eos = model.config.eos_token_id
            eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
            runner = EpisodeRunner(env, Dialect(model.tokenizer, eos_ids).check(), g)
        run = GRPORun(cfg, prompts, evals, rewards, model.tokenizer, reference, runner)
        fingerprint = {"train": str(d.train), "train_sha256": source_sha256(d.train), "max_length": d.max_length,
                       "prompt_field": g.prompt_field}
        # agent3: [grpo] async = true's callback, registered by kiln.train.grpo_async (imported with the recipes)
        callback = (ASYNC_CALLBACK[0] if g.async_ else GRPOCallback)(run, d.pack)
        return RunParts(model, prompts.examples(), evaluate=run.evaluate if evals is not None else None,
                        callbacks=[callback], fingerprint=fingerprint)



class GRPO(Extension):
    section = "grpo"
    schema = GRPOSection
    summary = GRPORecipe.summary
    recipes = ("grpo",)
    recipe = "grpo"  # the recipe this table selects (kiln.train.recipes picks it when [grpo] is present)
    # no named flags: `--set grpo.KEY=VALUE` sets any key (a named flag would also need kiln/cli/recipe_flags.py's table)

    def extend(self, cfg: RunConfig, parts: RunParts) -> None:
        """Nothing to change: the grpo recipe built the parts from this table."""


RECIPE = GRPORecipe()
EXTENSION = GRPO()
