"""A GRPO rollout's parts ([grpo], kiln.train.recipes.grpo): prompts, sampling on the generation engine
(kiln.train.grpo_engine; a model the engine cannot run is refused naming what it lacks) with the sampler's
log-probs kept, scoring, the trainer's log-probs of the same tokens
(logits / temperature: through the engine's kernels after engine rollouts with `exact_logprobs`, else chunked
through the LM head of the training forward), the reference's (a frozen copy, or under [lora] the base with the
adapters off), and the held-out evaluation of greedy completions."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from kiln.data.records import Record
from kiln.errors import KilnError
from kiln.models.common.wrapped import unwrap
from kiln.parallel.world import all_reduce_sum
from kiln.train.config import RunConfig
from kiln.train.grpo_engine import (
    EngineDecoder,
    EngineRollouts,
    exact_logps,
    exact_refusal,
    fits,
    gathered_bytes,
    is_fsdp,
    refusal,
)
from kiln.train.grpo_loss import combine_rewards
from kiln.train.logps import token_logps
from kiln.train.recipes.dpo import adapters_off  # under [lora], the reference: the base with the adapters off
from kiln.train.rewards import Reward, RewardGuard, score
from kiln.train.trainer import Trainer


# ---- prompts ------------------------------------------------------------------------------------
def encode_prompt(prompt: Any, tokenizer: Any, where: str) -> list[int]:
    """A prompt's token ids as TRL 1.16 makes them: a string with the tokenizer's special tokens; a message list
    rendered by the chat template with the generation prompt, tokenized without added special tokens."""
    if isinstance(prompt, str):
        ids = tokenizer.backend.encode(prompt, add_special_tokens=True).ids
    elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                     and isinstance(m.get("content"), str) for m in prompt):
        text = tokenizer.chat().render(prompt, add_generation_prompt=True)
        ids = tokenizer.backend.encode(text, add_special_tokens=False).ids
    else:
        raise KilnError(f"{where}: the prompt must be a string or a non-empty list of {{role, content}} messages, "
                        f"got {type(prompt).__name__}")
    if not ids:
        raise KilnError(f"{where}: the prompt encodes to no tokens")
    return list(ids)


def check_prompt_kinds(records: list[Record], field: str, source: str) -> None:
    """One file, one kind: plain-text prompts (strings) or conversational ones (message lists), decided per row;
    a file mixing them is refused naming the first row of each (the rewards see completions in one shape)."""
    first: dict[bool, Record] = {}
    for r in records:
        first.setdefault(isinstance(r.get(field), list), r)
        if len(first) == 2:
            raise KilnError(f"{source} mixes plain-text prompts (first at {first[False].where}) and conversational "
                            f"message lists (first at {first[True].where}): a run's rewards see one kind of "
                            "completion; put each kind in its own file")


class Prompts:
    """A prompts file: each row's prompt as written, its token ids, its other columns and where it sits."""

    def __init__(self, records: list[Record], tokenizer: Any, field: str, max_length: int, source: str):
        if not records:
            raise KilnError(f"{source}: no prompts")
        check_prompt_kinds(records, field, source)
        self.prompts, self.ids, self.columns, self.where = [], [], [], []
        for r in records:
            prompt = r.get(field)
            ids = encode_prompt(prompt, tokenizer, r.where)
            if len(ids) > max_length:
                raise KilnError(f"{r.where}: the prompt is {len(ids)} tokens, over data.max_length = {max_length} "
                                "(raise data.max_length: prompts are never cut)")
            self.prompts.append(prompt)
            self.ids.append(ids)
            self.columns.append({k: v for k, v in r.fields.items() if k != field})
            self.where.append(r.where)
        self.conversational = isinstance(self.prompts[0], list)

    def __len__(self) -> int:
        return len(self.ids)

    def examples(self) -> list[dict[str, torch.Tensor]]:
        """What the Trainer's loader batches: the prompt ids (for lengths and token counts) and the row."""
        return [{"input_ids": torch.tensor(ids), "row": torch.tensor(i)} for i, ids in enumerate(self.ids)]

    def left_padded(self, rows: list[int], repeat: int, pad: int, device: torch.device
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, mask) (len(rows) * repeat, P) left-padded, each row repeated `repeat` times in a row."""
        width = max(len(self.ids[r]) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(self.ids[r])
            ids[i, width - n:], mask[i, width - n:] = torch.tensor(self.ids[r]), 1
        return ids.repeat_interleave(repeat, 0).to(device), mask.repeat_interleave(repeat, 0).to(device)

    def reward_inputs(self, rows: list[int], repeat: int) -> tuple[list, dict[str, list], list[str]]:
        """(prompts, columns, where) for len(rows) * repeat completions, TRL's layout (every column a list)."""
        expanded = [r for r in rows for _ in range(repeat)]
        keys = sorted({k for r in rows for k in self.columns[r]})
        columns = {k: [self.columns[r].get(k) for r in expanded] for k in keys}
        return [self.prompts[r] for r in expanded], columns, [self.where[r] for r in expanded]


# ---- the model's parts ---------------------------------------------------------------------------
def core_of(model: nn.Module) -> nn.Module:
    return unwrap(model)


def rollout_seed(seed: int, rollout: int, slot: int) -> int:
    """The sampling seed of one micro-batch of one rollout: a function of where the run is, so a resume redraws
    it. `slot` is the micro-batch's place in the rollout's global order (micro * data shards + data rank, the
    loader's layout), so a rollout samples the same completions however many processes share it."""
    digest = hashlib.sha256(f"kiln-grpo:{seed}:{rollout}:{slot}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


# ---- one rollout ---------------------------------------------------------------------------------
class GRPORun:
    """What the engine and the evaluation share: the settings, the prompts, the rewards, the reference."""

    def __init__(self, cfg: RunConfig, prompts: Prompts, eval_prompts: Prompts | None, rewards: list[Reward],
                 tokenizer: Any, reference: nn.Module | None, episodes: Any = None):
        self.g = cfg.grpo  # kiln.train.grpo_config.GRPOSection
        self.seed, self.lora = cfg.train.seed, cfg.lora is not None
        self.prompts, self.eval_prompts, self.rewards, self.tokenizer = prompts, eval_prompts, rewards, tokenizer
        self.guard = RewardGuard(self.g.reward_timeout, self.g.reward_max_failures)  # users' functions, guarded
        self.guarded = any(r.spec for r in rewards)
        self.reference = reference
        self.weights = torch.tensor([r.weight for r in rewards], dtype=torch.float32)
        self.episodes = episodes  # kiln.train.agent_rollout.EpisodeRunner under [grpo] env / tools, else None
        self.last_episodes: list[Any] = []  # the latest micro-batch's episodes (alarms, rollouts.jsonl)
        self.rollouts = EngineRollouts(self.g)
        self.refusals: dict[int, str | None] = {}  # id(model) -> why the engine cannot run it (None: it can)
        self.said: set[str] = set()  # log lines already said

    def on_engine(self, core: nn.Module) -> bool:
        """Whether the engine runs `core`."""
        if id(core) not in self.refusals:
            self.refusals[id(core)] = refusal(core)
        return self.refusals[id(core)] is None

    def say(self, line: str, main: bool) -> None:
        """A log line on the main process, once a run."""
        if line not in self.said:
            self.said.add(line)
            if main:
                print(line, flush=True)

    def decoder(self, core: nn.Module, sharded: bool, main: bool = True) -> EngineDecoder:
        """What a rollout samples through: the engine; a model it cannot run is refused naming what it lacks.
        Under FSDP2 collective (every rank asks together): the engine gathers the whole model, where every rank
        has the memory for it (kiln.train.grpo_engine.fits). `sharded` is the trainer's (kept for its callers)."""
        why = None if self.on_engine(core) else self.refusals[id(core)]
        if why is None and is_fsdp(core):
            why = fits(core)
            if why is None:
                self.say(f"[grpo] rollouts on the generation engine under FSDP2: the whole model gathered for each "
                         f"rollout ({gathered_bytes(core) / 2**20:.1f} MiB a rank), every rank generating its own "
                         "prompts", main)
        if why is not None:
            raise KilnError(f"[grpo] rollouts run on the generation engine, which cannot run this one: {why} "
                            "(kiln's earlier generate loop, which ran such rollouts, was removed: issue 39)")
        return EngineDecoder(self.rollouts, core)

    def exact(self, model: nn.Module) -> bool:
        """The trainer's log-probs under `model` come through the engine's kernels: equal to the engine's
        (logprob_gap 0) when its rollouts ran on the engine."""
        core = core_of(model)
        if not self.g.exact_logprobs:
            return False
        why = exact_refusal(core)
        if why is not None:
            self.say(f"[grpo] exact_logprobs: {why}", True)
        return why is None

    def eos_ids(self, core: nn.Module) -> list[int]:
        eos = core.config.eos_token_id
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    def pad_id(self, core: nn.Module) -> int:
        pad = core.config.pad_token_id
        eos = self.eos_ids(core)
        return pad if pad is not None else (eos[0] if eos else 0)

    def sample(self, decoder: EngineDecoder, rows: list[int], prompts: Prompts, repeat: int, seed: int | None,
               device: torch.device) -> dict[str, Any]:
        """Completions of `rows` (`repeat` each; greedy when `seed` is None) on the engine and the log-probs of
        the sampled tokens under logits / temperature (unfiltered, the trainer's formula)."""
        g, core = self.g, decoder.model
        if self.episodes is not None:
            return self.sample_episodes(decoder, rows, prompts, repeat, seed, device)
        ids, mask = prompts.left_padded(rows, repeat, self.pad_id(core), device)
        groups = decoder.rollouts.run(core, [prompts.ids[r] for r in rows], [g.max_new_tokens] * len(rows),
                                      repeat, None if seed is None else torch.Generator().manual_seed(seed),
                                      self.eos_ids(core))
        done = [c for group in groups for c in group]
        width = max(1, max(len(t) for t, _, _ in done))
        completions = torch.full((len(done), width), self.pad_id(core), dtype=torch.long)
        cmask = torch.zeros((len(done), width), dtype=torch.long)
        lps = torch.zeros((len(done), width), dtype=torch.float32)
        for i, (toks, lp, _) in enumerate(done):
            completions[i, :len(toks)], cmask[i, :len(toks)] = torch.tensor(toks, dtype=torch.long), 1
            if lp:
                lps[i, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
        return self._scored(rows, prompts, repeat, ids, mask, completions.to(device), cmask.to(device),
                            torch.tensor([not ended for _, _, ended in done], device=device), lps.to(device), core)

    def _scored(self, rows: list[int], prompts: Prompts, repeat: int, ids: torch.Tensor, mask: torch.Tensor,
                completions: torch.Tensor, cmask: torch.Tensor, truncated: torch.Tensor, logps: torch.Tensor,
                core: nn.Module) -> dict[str, Any]:
        """The micro-batch of sampled completions (N, C) (cmask: each one's tokens), with its rewards."""
        lists = [completions[i, : int(cmask[i].sum())].tolist() for i in range(completions.size(0))]
        texts = [self.tokenizer.decode(c, skip_special_tokens=True) for c in lists]
        decoded = [[{"role": "assistant", "content": t}] for t in texts] if prompts.conversational else texts
        p, columns, where = prompts.reward_inputs(rows, repeat)
        per_func = score(self.rewards, p, decoded, lists, columns, where, self.guard)
        return {"input_ids": torch.cat([ids, completions], 1), "attention_mask": torch.cat([mask, cmask], 1),
                "prompt_len": ids.size(1), "completion_mask": cmask, "loss_mask": cmask.clone(),
                "truncated": truncated, "per_func": per_func, "sampler_logps": logps}

    def sample_episodes(self, decoder: Any, rows: list[int], prompts: Prompts, repeat: int,
                        seed: int | None, device: torch.device) -> dict[str, Any]:
        """Multi-turn episodes of `rows` (`repeat` each; greedy when `seed` is None), scored: the reward functions
        see each episode's messages after its opening, TRL's `environments`, and the environment's own reward
        as the `env` function."""
        from kiln.train.agent_rollout import ENV_COLUMN, env_column, episode_seed, inner_envs, to_micro

        core = decoder.model
        pad, eos = self.pad_id(core), self.eos_ids(core)
        expanded = [r for r in rows for _ in range(repeat)]
        records = [{"prompt": prompts.prompts[r], **prompts.columns[r]} for r in expanded]
        base = 0 if seed is None else seed
        gen = None if seed is None else torch.Generator(device=device).manual_seed(seed)
        episodes = self.episodes.run(decoder, records, expanded, [prompts.ids[r] for r in expanded],
                                     [episode_seed(base, i) for i in range(len(expanded))], gen, pad, device)
        self.last_episodes = episodes
        micro = to_micro(episodes, pad, eos, device)
        p, columns, where = prompts.reward_inputs(rows, repeat)
        columns = {**columns, "environments": inner_envs(episodes), ENV_COLUMN: env_column(episodes)}
        completions = [e.messages[e.opening:] for e in episodes]
        micro["per_func"] = score(self.rewards, p, completions, [e.ids for e in episodes], columns, where,
                                  self.guard)
        for i, e in enumerate(episodes):  # a failed episode carries no reward (and no loss: to_micro)
            if e.end == "error":
                micro["per_func"][i] = float("nan")
        return micro

    def logps(self, model: nn.Module, micro: dict[str, Any]) -> torch.Tensor:
        """(N, C) log-probs of the completion tokens under `model` (through its wrapper), logits / temperature:
        through the engine's kernels (`exact`), else the training forward."""
        if self.exact(model):
            return exact_logps(core_of(model), micro, self.g.temperature)
        p, cmask = micro["prompt_len"], micro["completion_mask"]
        targets = torch.cat([torch.zeros_like(micro["input_ids"][:, :p]), cmask], 1)
        full = token_logps(model, micro["input_ids"], micro["attention_mask"], targets, temperature=self.g.temperature)
        return full[:, p - 1: p - 1 + cmask.size(1)]

    @torch.no_grad()
    def reference_logps(self, model: nn.Module, micro: dict[str, Any]) -> torch.Tensor:
        if self.reference is not None:
            return self.logps(self.reference, micro)
        with adapters_off(core_of(model)):
            return self.logps(core_of(model), micro)

    def evaluate(self, trainer: Trainer) -> dict[str, float]:
        """eval_reward (and per function) of one greedy completion per held-out prompt, over every rank."""
        assert self.eval_prompts is not None
        core, rank, shards = core_of(trainer.model), trainer.data_rank, trainer.data_shards
        decoder = self.decoder(core, trainer.sharded, trainer.world.main)  # the engine: each process its share
        mine = list(range(rank, len(self.eval_prompts), shards))
        sums = torch.zeros(2 + 2 * len(self.rewards), dtype=torch.float64)
        with decoder.rollouts.weights(core):  # FSDP2: one gather for every batch (ranks may run different counts)
            self._evaluate(decoder, mine, sums, trainer)
        sums = all_reduce_sum(sums.to(trainer.device), trainer.world).cpu()
        metrics = {"eval_reward": float(sums[0] / sums[1].clamp(min=1))}
        for j, r in enumerate(self.rewards):
            metrics[f"eval_reward/{r.name}"] = float(sums[2 + 2 * j] / sums[3 + 2 * j].clamp(min=1))
        return metrics

    def _evaluate(self, decoder: EngineDecoder, mine: list[int], sums: torch.Tensor, trainer: Trainer) -> None:
        """Adds the greedy completions' rewards of prompts `mine` into `sums` (total, count, then per function)."""
        assert self.eval_prompts is not None
        for s in range(0, len(mine), trainer.args.batch_size * self.g.num_generations):
            rows = mine[s: s + trainer.args.batch_size * self.g.num_generations]
            with torch.no_grad(), trainer.autocast():
                out = self.sample(decoder, rows, self.eval_prompts, 1, None, trainer.device)
            total = combine_rewards(out["per_func"], self.weights)
            sums[0] += float(torch.nansum(total))
            sums[1] += float((~torch.isnan(total)).sum())
            for j in range(len(self.rewards)):
                col = out["per_func"][:, j]
                sums[2 + 2 * j] += float(torch.nansum(col))
                sums[3 + 2 * j] += float((~torch.isnan(col)).sum())
