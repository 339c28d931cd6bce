"""GRPO's rollouts on the generation engine (kiln.engine), and the trainer's log-probs through its kernels.

A rollout sends one request per prompt with n = num_generations: the group's prompt is prefilled once and its
blocks shared by the n completions (copy-on-write). [grpo]'s sampling settings become SamplingParams
(temperature, top_k, top_p, min_p, repetition_penalty, max_new_tokens as max_tokens); the model's end tokens are
the requests' stop tokens. Log-probs at the sampling temperature: the engine's log-probs are log_softmax of the
float32 logits it samples from, so the engine here runs on its runner with the logits divided by the temperature
(`TemperedRunner`, the same elementwise op `kiln.engine.score.token_logps(temperature=T)` applies) and samples
at temperature 1 from them: softmax((x / T)) is the temperature-T distribution, the penalties and filters act on
it as they would on x at temperature T (a repetition penalty divides or multiplies a seen token's logit, which
commutes with the division by T up to rounding), and the log-probs are log_softmax(x / T), TRL's formula.

Sampling seeds: completion j of request i draws from its own generator (kiln.engine.sampling.request_generator),
seeded from the micro-batch's generator (itself seeded by the rollout's place in the run,
kiln.train.grpo_rollout.rollout_seed). The same [train] seed therefore gives the same run every time, with any
number of processes, but not the completions kiln's earlier loop (`[grpo] rollout = "generate"`) drew from one
generator shared by the whole micro-batch: that loop is kept, and gives the runs it gave before.

The engine runs a model it supports whole on one process (kiln.engine.runner.unsupported names what it does not);
under sharded weights (FSDP2, tensor parallel) the runner's direct calls of the submodules would bypass the
gathers, and FSDP2's wrapped layer classes are not the decoder layers the runner accepts: such runs, and families
the engine refuses, roll out on `generate`, said once in a log line.

`exact_logps`: the trainer's log-probs of a micro-batch's completions through `kiln.engine.score.token_logps`,
all rows in one packed pass, so they equal the engine's bit for bit at the rollout's weights (logprob_gap 0).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from kiln.engine import Engine, SamplingParams
from kiln.engine.runner import unsupported
from kiln.engine.score import tempered, token_logps

BLOCK = 16  # the engine's KV block size (it fixes the attention's summation order: token_logps is told the same)


class TemperedRunner:
    """The engine's DecoderRunner with each step's float32 logits divided by `temperature` (1: unchanged)."""

    def __init__(self, runner: Any):
        self.runner, self.temperature = runner, 1.0

    def step(self, pieces: list, pool: Any, limit: int = 64) -> torch.Tensor:
        return tempered(self.runner.step(pieces, pool, limit), self.temperature)

    def __getattr__(self, name: str) -> Any:  # everything else is the runner's (new_pool, device, max_positions)
        return getattr(self.runner, name)


def refusal(core: nn.Module) -> str | None:
    """Why GRPO's rollouts cannot run on the engine for this model, or None."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for p in core.parameters()):
        return ("its weights are sharded (FSDP2 / tensor parallel): the engine calls the model's submodules "
                "directly, past the gathers")
    return unsupported(core)


class EngineRollouts:
    """One engine per policy model, kept across rollouts (its pool grown when a batch needs more)."""

    def __init__(self, g: Any):
        self.g = g
        self.engine: Engine | None = None
        self.core: nn.Module | None = None

    def forget(self) -> None:
        """After an optimizer update: the remembered prompt blocks hold the old weights' keys."""
        if self.engine is not None:
            self.engine.forget_prefixes()

    def _engine(self, core: nn.Module, blocks: int, seqs: int) -> Engine:
        e = self.engine
        if e is None or self.core is not core or e.pool.num_blocks < blocks or e.scheduler.max_seqs < seqs:
            # twice the need: an episode's later turns (longer histories) then fit in the pool that holds the
            # earlier turns' blocks, which a new pool would not have
            e = Engine(core, None, block_size=BLOCK, kv_blocks=2 * blocks, max_seqs=seqs,
                       step_tokens=max(512, 4 * seqs), eos_token_ids=[])
            e.runner = TemperedRunner(e.runner)
            self.engine, self.core = e, core
        return e

    def params(self, max_tokens: int, n: int, seed: int | None, eos: list[int]) -> SamplingParams:
        g = self.g
        return SamplingParams(max_tokens=max_tokens, temperature=0.0 if seed is None else 1.0, top_k=g.top_k,
                              top_p=g.top_p, min_p=g.min_p, repetition_penalty=g.repetition_penalty, seed=seed,
                              stop_token_ids=tuple(eos), logprobs=True, n=n)

    def run(self, core: nn.Module, prompts: list[list[int]], max_tokens: list[int], n: int | list[int],
            gen: torch.Generator | None, eos: list[int], grows: int = 0
            ) -> list[list[tuple[list[int], list[float], bool]]]:
        """Each prompt's n (or n[i]) completions as (tokens, log-probs at the temperature, ended on an end
        token); greedy when `gen` is None, else request i seeded by the i-th draw from `gen`. `grows`: how many
        more tokens a later request over the same history may hold (an episode's budget), for the pool's size."""
        if not prompts:
            return []
        ns = [n] * len(prompts) if isinstance(n, int) else list(n)
        blocks = sum(k * (math.ceil((len(p) + max(m, grows)) / BLOCK) + 1) for p, m, k in zip(prompts, max_tokens, ns))
        engine = self._engine(core, blocks, sum(ns))
        seeds: list[int | None] = [None] * len(prompts) if gen is None else \
            torch.randint(0, 2**62, (len(prompts),), generator=gen, device=gen.device).tolist()
        engine.runner.temperature = float(self.g.temperature)  # greedy: the argmax of the same scaled logits
        out = engine.generate(prompts, [self.params(m, k, s, eos) for m, k, s in zip(max_tokens, ns, seeds)])
        return [[(c.token_ids, c.logprobs, c.finish_reason == "stop") for c in group] for group in out]

    def turns(self, core: nn.Module, contexts: list[list[int]], budgets: list[int], gen: torch.Generator | None,
              eos: list[int], grows: int) -> list[tuple[list[int], list[float], bool]]:
        """One completion per context, in order; contexts equal in tokens and budget (a group's episodes at their
        first turn) go as one request with n = their count, so their prompt is prefilled once."""
        same: dict[tuple[tuple[int, ...], int], list[int]] = {}
        for i, (c, b) in enumerate(zip(contexts, budgets)):
            same.setdefault((tuple(c), b), []).append(i)
        keys = list(same)
        groups = self.run(core, [list(c) for c, _ in keys], [b for _, b in keys], [len(same[k]) for k in keys], gen,
                          eos, grows)
        out: list[tuple[list[int], list[float], bool]] = [([], [], False)] * len(contexts)
        for key, group in zip(keys, groups):
            for i, completion in zip(same[key], group):
                out[i] = completion
        return out


class EngineDecoder:
    """What a rollout samples through when the engine runs it: the model (`.model`) and the engine's rollouts."""
    sharded = False

    def __init__(self, rollouts: EngineRollouts, core: nn.Module):
        self.rollouts, self.model = rollouts, core


def exact_logps(core: nn.Module, micro: dict[str, Any], temperature: float) -> torch.Tensor:
    """(N, C) log-probs of a micro-batch's tokens after its prompts (C = completion_mask's width; 0 past each
    row's end) under logits / temperature, through the engine's kernels: every row in one packed pass
    (kiln.engine.score.token_logps). Differentiable."""
    ids, attn, width = micro["input_ids"], micro["attention_mask"], micro["completion_mask"].size(1)
    p = micro["prompt_len"]
    seqs = [ids[i][attn[i].bool()].tolist() for i in range(ids.size(0))]
    starts = attn[:, :p].sum(1).tolist()
    lps = token_logps(core, seqs, starts, block_size=BLOCK, temperature=temperature)
    return torch.stack([F.pad(lp, (0, width - lp.numel())) for lp in lps]).to(ids.device)
