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
number of processes, but not the completions kiln's earlier loop drew from one generator shared by the whole
micro-batch (that loop, and `[grpo] rollout = "generate"`, were removed: benchmarks/old_loop.py keeps a copy).

The engine runs a model it supports whole on one process (kiln.engine.runner.unsupported names what it does not);
families it refuses, and tensor-parallel weights, are refused naming what the engine lacks.

Under FSDP2 the engine runs the sharded model (kiln.parallel.fsdp): a rollout all-gathers every unit's weights
once (`gathered`: one collective per unit, all ranks together), then each rank generates its own prompts with no
collective at all (ranks finish when they finish; a per-layer gather would have every rank step in lockstep,
each step one all-gather per layer, padded with empty steps to the slowest rank's count), and frees the gathered
copy after. The cost is memory: the whole model in the forward's dtype beside the shards (`gathered_bytes`)
for the rollout's length, when the gradients are freed and no activations are held; `fits` checks it against
the memory free on every rank before each rollout, and where it does not fit on some rank the run stops with
the figures (the engine has no per-layer gather: every rank would step in lockstep). The
runner registry accepts a model by the exact classes of its modules, so the engine sees the units as built
(`own_classes`).

`exact_logps`: the trainer's log-probs of a micro-batch's completions through `kiln.engine.score.token_logps`,
all rows in one packed pass, so they equal the engine's bit for bit at the rollout's weights (logprob_gap 0).
Under FSDP2 that pass runs as the training forward does, one unit at a time: the whole call as the root's forward
(embedding, final norm and head gathered), each layer as its block's forward (`unit_forward`: gathered before,
freed after, its gradients reduce-scattered into the shards in the backward), so its memory is the training
forward's, not the rollout's. The runner's per-layer calls are what is wrapped, so this holds for the runners
whose forward is one call per layer (attention decoders, MLA, sparse attention); the recurrent families' runners
run their layers their own way, and their scoring under FSDP2 takes the training forward (`exact_refusal`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from kiln.engine import Engine, SamplingParams
from kiln.engine.runner import DecoderRunner, runner_class, unsupported
from kiln.engine.score import release_packed, runner_for, tempered, token_logps
from kiln.parallel.fsdp import gathered, gathered_bytes, own_classes, unit_forward, units

BLOCK = 16  # the engine's KV block size (it fixes the attention's summation order: token_logps is told the same)


class TemperedRunner:
    """The engine's DecoderRunner with each step's float32 logits divided by `temperature` (1: unchanged)."""

    def __init__(self, runner: Any):
        self.runner, self.temperature = runner, 1.0

    def step(self, pieces: list, pool: Any, limit: int = 64) -> torch.Tensor:
        return tempered(self.runner.step(pieces, pool, limit), self.temperature)

    def __getattr__(self, name: str) -> Any:  # everything else is the runner's (new_pool, device, max_positions)
        return getattr(self.runner, name)


def is_fsdp(core: nn.Module) -> bool:
    """Whether `core` is an FSDP2 root whose sharded weights are all FSDP's (a 1-D mesh: no tensor parallelism)."""
    return isinstance(core, FSDPModule) and all(p.device_mesh.ndim == 1 for p in core.parameters()
                                                if isinstance(p, DTensor))


def as_built(core: nn.Module) -> Any:
    """The context in which the engine sees `core`: its FSDP2 units as the classes they were built with."""
    return own_classes(core) if is_fsdp(core) else nullcontext(core)


def refusal(core: nn.Module) -> str | None:
    """Why GRPO's rollouts cannot run on the engine for this model, or None."""
    if any(isinstance(p, DTensor) for p in core.parameters()) and not is_fsdp(core):
        return ("its weights are tensor parallel: the engine calls the model's submodules directly, and a "
                "sharded projection's output would be one rank's piece")
    with as_built(core):
        return unsupported(core)


def exact_refusal(core: nn.Module) -> str | None:
    """Why the trainer's log-probs of `core` cannot come through the engine's kernels (with the gradients
    reduce-scattered as FSDP2's), or None."""
    if not is_fsdp(core):
        return None
    with own_classes(core):
        cls = runner_class(core)
    if cls is not None and cls._run is not DecoderRunner._run:
        return (f"under FSDP2 the engine's scoring forward wraps each layer's call as its block's forward, and "
                f"{cls.__name__} runs its layers its own way: the trainer's log-probs take the training forward")
    return None


def available_bytes(device: torch.device) -> int | None:
    """Memory this process may still take on `device`: a GPU's free memory plus what torch's allocator holds
    unused; on the CPU the host's MemAvailable shared by the processes on it (LOCAL_WORLD_SIZE). None: unknown."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        except (OSError, StopIteration, ValueError):
            return None
        return kib * 1024 // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    return None


def fits(core: nn.Module) -> str | None:
    """Under FSDP2: why the whole model cannot be gathered for a rollout on some rank, or None. Collective (the
    ranks must agree: the gather is). The need is `gathered_bytes` with a tenth of headroom; the KV pool comes on
    top of it (its size follows the rollout's prompts; EngineRollouts makes it twice one micro-batch's need)."""
    need = gathered_bytes(core)
    device = next(iter(core.parameters())).device
    free = available_bytes(device)
    short = torch.tensor([0.0 if free is None else max(0.0, need * 1.1 - free)], dtype=torch.float64,
                         device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(short, op=torch.distributed.ReduceOp.MAX)
    if float(short) > 0:
        return (f"gathering the whole FSDP2-sharded model for the engine takes {need / 2**30:.2f} GiB a rank and "
                f"some rank is {float(short) / 2**30:.2f} GiB short of that with a tenth of headroom")
    return None


class EngineRollouts:
    """One engine per policy model, kept across rollouts (its pool grown when a batch needs more)."""

    def __init__(self, g: Any):
        self.g = g
        self.engine: Engine | None = None
        self.core: nn.Module | None = None
        self.held: nn.Module | None = None  # the FSDP2 model whose weights `weights` holds gathered now

    @contextmanager
    def weights(self, core: nn.Module) -> Iterator[None]:
        """`core`'s weights whole on this process for the duration: under FSDP2 all-gathered (collective: every
        rank enters together; reentrant, so an evaluation holds one gather over all its batches), else as they
        are."""
        if self.held is core or not is_fsdp(core):
            yield
            return
        with torch.no_grad(), gathered(core):
            self.held = core
            try:
                yield
            finally:
                self.held = None
                if self.engine is not None:  # the packed head copies the gathered weight: freed with the gather
                    self.engine.runner.forget_weights()

    def forget(self, core: nn.Module | None = None) -> None:
        """After an optimizer update: the remembered prompt blocks hold the old weights' keys, the packed LM head
        copies (the engine's, and `core`'s scoring runner's) the old weights."""
        if self.engine is not None:
            self.engine.forget_prefixes()
        if core is not None:
            release_packed(core)

    def release_head(self) -> None:
        """After a rollout: the engine's packed LM head copy is not needed until the next rollout (after an
        update, when it would be stale): freed so it does not sit beside the update's activations."""
        if self.engine is not None:
            self.engine.runner.forget_weights()

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
        seeds: list[int | None] = [None] * len(prompts) if gen is None else \
            torch.randint(0, 2**62, (len(prompts),), generator=gen, device=gen.device).tolist()
        with self.weights(core), as_built(core):  # FSDP2: gathered first (the engine's runner in their dtype)
            engine = self._engine(core, blocks, sum(ns))
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
    """What a rollout samples through: the model (`.model`) and the engine's rollouts."""

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
    if is_fsdp(core):
        lps = sharded_token_logps(core, seqs, starts, temperature)
    else:
        lps = token_logps(core, seqs, starts, block_size=BLOCK, temperature=temperature)
    return torch.stack([F.pad(lp, (0, width - lp.numel())) for lp in lps]).to(ids.device)


def sharded_token_logps(core: nn.Module, seqs: list[list[int]], starts: list[int], temperature: float
                        ) -> list[torch.Tensor]:
    """kiln.engine.score.token_logps of an FSDP2 model, run as its training forward is: the whole call as the
    root's forward, each layer's call as its block's (module docstring). The same bits as on gathered weights."""
    unit_ids = {id(u) for u in units(core)}
    layers = [layer if id(layer) in unit_ids else None for layer in core.model.layers]
    sizes = [len(s) - b for s, b in zip(seqs, starts)]

    def whole() -> torch.Tensor:
        runner = runner_for(core)  # made here, the root's weights gathered: in the dtype the rollout's runner has
        plain = runner._layer

        def own(*args: Any) -> torch.Tensor:  # a layer's output is a tile's slice: a copy of it, not a view,
            y = plain(*args)                 # is what FSDP's pre-backward hook may go on
            return y.clone() if y._base is not None else y

        def layer(i: int, x: torch.Tensor, *rest: Any) -> torch.Tensor:
            unit = layers[i] if i < len(layers) else None
            return plain(i, x, *rest) if unit is None else unit_forward(unit, own, i, x, *rest)

        runner._layer = layer  # this call's (an instance attribute over the class's method)
        try:  # one tensor out (FSDP's pre-backward hook goes on it; the split pieces would be views)
            return torch.cat(token_logps(core, seqs, starts, block_size=BLOCK, temperature=temperature))
        finally:
            del runner._layer

    with own_classes(core):
        flat = unit_forward(core, whole)
    return list(flat.split(sizes))
