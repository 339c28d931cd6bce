"""[grpo] async = true: off-policy steps. A background worker samples the next rollouts from a copy of the policy
while the current rollout trains; the loss corrects for the lag by importance sampling against the rollout's
log-probs.

The schedule is fixed, so a run is the same every time and resumes exactly: rollout r (first trained at step
r * num_iterations) is sampled from the weights after max(0, r * num_iterations - max_staleness) optimizer steps.
After each step (`AsyncCallback.on_step`, before any checkpoint of that step is written) every rollout due at the
new weights is launched: its prompt rows drawn from the loader (the same rows, in the same order, a synchronous run
draws), the weights cloned (the snapshot), the job queued. The worker (one thread) loads each job's snapshot into
its own copy of the model and samples it as the synchronous run samples (kiln.train.recipes.grpo.sample_rollout:
the same seeds, the engine or `generate`, episodes under env / tools), scoring it with its own reward guard. The
rollout's `staleness` (steps between its weights and the step that first trains on it) is at most max_staleness
(checked at every rollout, logged as `staleness`); later iterations of one rollout (num_iterations > 1) are
off-policy by their iteration as in synchronous runs, which the PPO ratio handles.

The loss: the old log-probs are the trainer's own at the rollout's first update (the proximal policy, as
`sampler = "exact"`), and the IS ratio exp(old - sampler) of each token (or sequence) corrects from the policy
that sampled the rollout, truncated or masked as [grpo] importance_sampling_mode / _clip_min / _clip_max say
(TRL 1.16's vllm_importance_sampling_* keys, kiln.train.grpo_loss.is_correction). Logged every step:
`mismatch/kl` (the mean over the policy's tokens of the k3 estimate (w - 1) - log w of KL(sampler || trainer),
w = exp(old - sampler)), `mismatch/max_ratio` (the largest w, before truncation), `staleness`. `logprob_gap` is
the same gap's largest |log w|; its alarm is off here (the gap is by design).

Checkpoints: besides the rollout being worked on, each launched rollout not yet trained: one sampled from older
weights than the checkpoint's is waited for and saved whole; one launched at the checkpoint's own weights (in
flight) is saved as its rows and regenerated from its seeds on resume. So a run killed at any point and resumed
from its last checkpoint takes the same steps as one never stopped.

On CPU the worker and the trainer share the same cores (torch's intra-op threads in each): the overlap pays only
where a step leaves cores idle (user code in environments and rewards, Python between kernels, a GPU trainer).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, cast

import torch
from torch import nn

from kiln.errors import ConfigError, KilnError
from kiln.parallel.world import all_reduce_sum, gather_objects
from kiln.train.agent_rollout import Episode
from kiln.train.engine import StepContext, StepEngine
from kiln.train.grpo_engine import EngineRollouts
from kiln.train.grpo_rollout import GRPORun, core_of
from kiln.train.recipes.grpo import ASYNC_CALLBACK, GRPOCallback, GRPOEngine, _pack, _unpack, sample_rollout
from kiln.train.rewards import RewardGuard
from kiln.train.trainer import Trainer

Sampled = tuple[list[dict[str, Any]], list[list[int]], list[Any]]  # sample_rollout's: micros, rows, episodes


@dataclass
class Job:
    """One rollout for the worker: which, from which weights, on which prompt rows."""
    index: int
    version: int                        # optimizer steps the weights had when it was launched
    rows: list[list[int]]               # each micro-batch's prompt rows
    weights: dict[str, torch.Tensor] | None = None  # the snapshot, dropped once loaded
    done: threading.Event = field(default_factory=threading.Event)
    result: Sampled | None = None
    failed: tuple[int, int] = (0, 0)    # the reward guard's (errors, timeouts) while scoring it
    error: BaseException | None = None


def snapshot(core: nn.Module) -> dict[str, torch.Tensor]:
    """The weights (and buffers) as they are now, cloned: the trainer goes on updating its own in place."""
    return {k: v.detach().clone() for k, v in core.state_dict().items()}


class Worker:
    """One daemon thread sampling its jobs in order from its own copy of the policy."""

    def __init__(self, run: GRPORun, core: nn.Module, ctx: StepContext):
        self.run = copy.copy(run)  # its own engine, guard and episodes list: nothing the main thread touches
        self.run.rollouts = EngineRollouts(run.g) if run.rollouts is not None else None
        self.run.refusals, self.run.last_episodes = {}, []
        self.run.guard = RewardGuard(run.g.reward_timeout, run.g.reward_max_failures)
        tokenizer = getattr(core, "tokenizer", None)
        memo = {} if tokenizer is None else {id(tokenizer): tokenizer}  # shared, not copied
        self.model = copy.deepcopy(core, memo).requires_grad_(False)
        for p in self.model.parameters():
            p.grad = None
        self.ctx, self.threads = ctx, torch.get_num_threads()
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="kiln-grpo-async", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def wait(self, job: Job) -> Sampled:
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def close(self) -> None:
        self.jobs.put(None)  # the thread ends after the jobs before it (a daemon: it never holds the process)

    def _loop(self) -> None:
        torch.set_num_threads(self.threads)  # the main thread's setting (a new thread may start with another)
        while (job := self.jobs.get()) is not None:
            try:
                assert job.weights is not None
                with torch.no_grad():
                    for k, v in self.model.state_dict().items():
                        v.copy_(job.weights[k])
                job.weights = None
                if self.run.rollouts is not None:  # blocks remembered under the previous weights
                    self.run.rollouts.forget()
                job.result = sample_rollout(self.run, self.model, self.ctx, job.index, job.rows)
                job.failed = self.run.guard.take()
            except BaseException as e:  # noqa: BLE001  (raised again on the main thread, by `wait`)
                job.error = e
            finally:
                job.done.set()


# ---- a sampled rollout in a checkpoint (trainer.json) ----
_EPISODE_FIELDS = [f.name for f in dataclasses.fields(Episode) if f.name not in ("env", "tools")]


def _plain(x: Any) -> Any:
    """JSON-safe (an environment's messages may hold anything; rollouts.jsonl writes them the same way)."""
    return json.loads(json.dumps(x, default=str))


def pack_sampled(s: Sampled) -> dict[str, Any]:
    micros, rows, episodes = s
    return {"micros": [{k: _pack(v) for k, v in m.items()} for m in micros], "rows": rows,
            "episodes": [None if eps is None else [_plain({f: getattr(e, f) for f in _EPISODE_FIELDS}) for e in eps]
                         for eps in episodes]}


def unpack_sampled(d: dict[str, Any], device: torch.device) -> Sampled:
    micros = [{k: _unpack(v, device) for k, v in m.items()} for m in d["micros"]]
    episodes = [None if eps is None else [Episode(**e) for e in eps] for eps in d["episodes"]]
    return micros, [list(r) for r in d["rows"]], episodes


class AsyncGRPOEngine(GRPOEngine):
    """GRPOEngine whose rollouts come from the worker, on the schedule the module docstring gives."""

    def __init__(self, inner: StepEngine, run: GRPORun, pack: bool = False):
        super().__init__(inner, run, pack)
        self.worker: Worker | None = None
        self.jobs: dict[int, Job] = {}     # launched, not yet trained on
        self.next_index = 0                # the next rollout to launch
        self.restored: dict[str, Any] | None = None
        self.staleness = 0
        self.launched: list[tuple[int, int]] = []  # (rollout, version) of each launch, in order
        self.alarms.warned.add("logprob_gap")  # the sampler's policy lags by design: reported as mismatch/*

    def due(self, index: int, run: StepContext) -> bool:
        """Whether rollout `index` is launched at the current weights (and is trained at all)."""
        g = self.run.g
        first = index * g.num_iterations
        return first < run.total_steps and max(0, first - g.max_staleness) <= run.step

    def launch(self, run: StepContext) -> None:
        """Every rollout due at the weights as they are now: rows drawn, weights cloned, queued."""
        assert self.worker is not None
        weights = None
        while self.due(self.next_index, run):
            rows = [run.next_batch()["row"].tolist() for _ in range(run.args.grad_accum)]
            weights = weights or snapshot(core_of(run.model))
            self._submit(Job(self.next_index, run.step, rows, weights))
            self.next_index += 1
        # the prompt batches' padding (the loader's pad_fraction): drawn ahead of their step, and not on a resume
        # that regenerates in-flight rows, it would be logged on other steps than a synchronous run's: not logged
        getattr(run.loader, "take_pad_fraction", lambda: None)()

    def _submit(self, job: Job) -> None:
        assert self.worker is not None
        self.jobs[job.index] = job
        self.launched.append((job.index, job.version))
        self.worker.submit(job)

    def _start(self, run: StepContext) -> None:
        if run.sharded:
            raise ConfigError("[grpo] async = true runs on one process or DDP: its worker samples from a whole copy "
                              "of the weights, which sharded runs (FSDP2, tensor parallel) do not hold")
        self.worker = Worker(self.run, core_of(run.model), run)
        if self.restored is None:
            self.next_index = run.step // self.run.g.num_iterations
        else:
            self.next_index = int(self.restored["next"])
            for entry in self.restored["jobs"]:
                job = Job(int(entry["index"]), int(entry["version"]), [list(r) for r in entry["rows"]])
                if entry.get("sampled") is not None:  # sampled from older weights: as saved
                    job.result = unpack_sampled(entry["sampled"], run.device)
                    job.failed = (int(entry["failed"][0]), int(entry["failed"][1]))
                    job.done.set()
                    self.jobs[job.index] = job
                    continue
                if job.version != run.step:
                    raise KilnError(f"this checkpoint's rollout {job.index} was in flight at step {job.version}, "
                                    f"not at its own step {run.step}: it cannot be regenerated")
                job.weights = snapshot(core_of(run.model))  # in flight at the checkpoint's own weights: again
                self._submit(job)
            self.restored = None
        self.launch(run)

    def sampled(self, run: StepContext, index: int) -> Sampled:
        if self.worker is None:
            self._start(run)
        assert self.worker is not None
        job = self.jobs.pop(index, None)
        if job is None:
            raise KilnError(f"[grpo] async: rollout {index} was never launched (step {run.step})")
        result = self.worker.wait(job)
        self.staleness = run.step - job.version
        if not 0 <= self.staleness <= self.run.g.max_staleness:
            raise KilnError(f"[grpo] async: rollout {index} sampled at step {job.version} is {self.staleness} steps "
                            f"old at step {run.step}, over grpo.max_staleness = {self.run.g.max_staleness}")
        self.run.guard.errors += job.failed[0]  # counted where the synchronous run counts them: this rollout's
        self.run.guard.timeouts += job.failed[1]
        return result

    def rollout(self, run: StepContext) -> None:
        super().rollout(run)
        self.stats.update(self.mismatch(run))
        self.stats["staleness"] = float(self.staleness)

    def mismatch(self, run: StepContext) -> dict[str, float]:
        """mismatch/kl and mismatch/max_ratio over every rank's policy tokens of the rollout just finished."""
        assert self.buffer is not None
        sums = torch.zeros(2, dtype=torch.float64)  # k3 sum, tokens
        top = torch.zeros(1, dtype=torch.float64)
        for micro in self.buffer:
            on = micro["loss_mask"].bool()
            d = (micro["old_logps"] - micro["sampler_logps"])[on].double()
            d = d[~torch.isnan(d)]
            if d.numel():
                w = d.exp()
                sums += torch.stack([(w - 1 - d).sum(), torch.tensor(float(d.numel()), dtype=torch.float64)])
                top = torch.maximum(top, w.max().reshape(1))
        sums = all_reduce_sum(sums.to(run.device), run.world).cpu()
        top = top.to(run.device)
        if run.world.active:
            torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX)
        return {"mismatch/kl": float(sums[0] / sums[1].clamp(min=1)), "mismatch/max_ratio": float(top.cpu()[0])}

    # -- resume: besides the rollout being worked on, the launched ones --
    def state_dict(self, run: StepContext) -> dict[str, Any] | None:
        state = super().state_dict(run) or {}
        entries = []
        for index in sorted(self.jobs):
            job = self.jobs[index]
            entry: dict[str, Any] = {"index": index, "version": job.version, "rows": job.rows}
            if job.version < run.step:  # older weights than the checkpoint's: the rollout itself
                assert self.worker is not None
                entry["sampled"] = pack_sampled(self.worker.wait(job))
                entry["failed"] = list(job.failed)
            entries.append(entry)
        state["async"] = gather_objects({"next": self.next_index, "jobs": entries}, run.world)
        return state

    def load_state_dict(self, run: StepContext, state: dict[str, Any]) -> None:
        super().load_state_dict(run, state)
        ranks = state.get("async")
        if ranks is None:
            raise KilnError("this checkpoint was written by a run with grpo.async = false: resume it so (its "
                            "next rollouts were never launched)")
        self.restored = ranks[run.world.rank]

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()


class AsyncCallback(GRPOCallback):
    """Installs the async engine; after each optimizer update, launches the rollouts due at the new weights."""
    engine: AsyncGRPOEngine | None = None

    def wrap_engine(self, trainer: Trainer, engine: StepEngine) -> StepEngine:
        self.engine = AsyncGRPOEngine(engine, self.run, self.pack)
        return self.engine

    def on_step(self, trainer: Trainer, record: dict[str, Any]) -> None:
        super().on_step(trainer, record)
        if self.engine is not None and self.engine.worker is not None:
            self.engine.launch(cast(StepContext, trainer))  # the Trainer is the engines' StepContext

    def on_end(self, trainer: Trainer) -> None:
        if self.engine is not None:
            self.engine.close()


ASYNC_CALLBACK[:] = [AsyncCallback]
