"""The generation engine: requests in, tokens out, one scheduler step at a time (single-threaded).

    engine = Engine(model, tokenizer)
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=32, n=4))
    while engine.has_unfinished():
        for out in engine.step(): ...          # RequestOutput: the new tokens of one completion

A step runs the scheduler's pieces (kiln.engine.scheduler) through the model (kiln.engine.runner), then samples
one token per sequence whose logits came. A request's n completions share the prompt: its prefill runs once,
and at its last token the sequence forks into n that share the prompt's full blocks (the partly filled last
block is copied per completion). Log-probs are log_softmax of the raw float32 logits, computed per row, the
same bits as kiln.engine.score.token_logps on the finished sequence.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from kiln.engine import prefix_state  # engfeat
from kiln.engine.cache import BLOCK_SIZE
from kiln.engine.exact import log_softmax_rows
from kiln.engine.params import MAX_TOP_LOGPROBS, SamplingParams
from kiln.engine.sampling import request_generator, sample
from kiln.engine.scheduler import Request, Scheduler, Sequence
from kiln.engine.score import runner_for
from kiln.engine.vision import ImageFeatures, prompt_images  # engvis
from kiln.errors import KilnError

_KV_BYTES_DEFAULT = 1 << 30  # the default pool holds at most 1 GiB of keys and values


@dataclass
class RequestOutput:
    """What one step produced for one completion."""
    request_id: str
    index: int
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "cancelled"


@dataclass
class Completion:
    request_id: str
    index: int
    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]
    text: str
    finish_reason: str


class Engine:
    def __init__(self, model, tokenizer=None, *, block_size: int = BLOCK_SIZE, kv_blocks: int | None = None,
                 max_seqs: int = 64, step_tokens: int = 512, eos_token_ids=None, seed: int = 0):
        if max_seqs < 1 or step_tokens < 1:
            raise KilnError(f"the engine needs max_seqs >= 1 and step_tokens >= 1, got max_seqs={max_seqs}, "
                            f"step_tokens={step_tokens}")
        config = model.config
        self.runner = runner_for(model)
        self.max_positions = self.runner.max_positions
        self.model, self.tokenizer, self.seed = model, tokenizer, seed
        self.vocab_size = int(config.vocab_size)
        if kv_blocks is None:
            per_seq = math.ceil(min(self.max_positions, 4096) / block_size)
            probe = self.runner.new_pool(1, block_size)
            per_block = max(1, probe.bytes_per_block())  # 0 for a stack of recurrent layers alone
            kv_blocks = max(per_seq + 1, min(max_seqs * per_seq, _KV_BYTES_DEFAULT // per_block))
        self.pool = self.runner.new_pool(kv_blocks, block_size, max_seqs)
        prefix_state.enable(self.pool, self.runner)  # engfeat: prefix reuse for the families with recurrent state
        self.scheduler = Scheduler(self.pool, max_seqs, step_tokens)
        eos = config.eos_token_id if eos_token_ids is None else eos_token_ids
        self.eos_ids = frozenset([] if eos is None else [eos] if isinstance(eos, int) else list(eos))
        self.requests: dict[str, Request] = {}
        self._cancelled: list[RequestOutput] = []
        self._count = itertools.count()
        self.tokens_fed = 0  # tokens run through the model so far (a shared prompt counts once)
        self.image_features = ImageFeatures()  # engvis: image features by image digest, for the engine's life

    # ---- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    prompt_inputs: dict | None = None) -> str:
        params.validate(self.vocab_size)
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise KilnError("prompt_ids is empty: a request needs at least one prompt token")
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise KilnError(f"prompt_ids holds {bad[0]}, outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) >= self.max_positions:
            raise KilnError(f"the prompt is {len(prompt)} tokens; the model has {self.max_positions} positions "
                            "and needs room for at least one new token")
        if params.n > self.scheduler.max_seqs:
            raise KilnError(f"n={params.n} completions exceed the engine's max_seqs={self.scheduler.max_seqs}")
        if params.stop and self.tokenizer is None:
            raise KilnError("stop strings need a tokenizer: Engine(model, tokenizer)")
        total = min(len(prompt) + params.max_tokens, self.max_positions)
        blocks = self.scheduler.peak_blocks(len(prompt), params.n, total)
        if blocks > self.pool.num_blocks:
            full = 0 if self.pool.has_states else len(prompt) // self.pool.block_size  # (scheduler.peak_blocks)
            raise KilnError(
                f"the request needs up to {blocks} KV blocks of {self.pool.block_size} tokens ({full} shared prompt "
                f"block{'s' * (full != 1)} + {params.n} completions x {(blocks - full) // params.n} "
                f"own blocks for {total - 1} fed tokens), the cache has {self.pool.num_blocks} "
                "(raise kv_blocks, or lower max_tokens or n)")
        # engvis: an image-text prompt's images, each through the vision tower once (kiln.engine.vision)
        images = prompt_images(self.model, prompt, prompt_inputs, self.image_features) if prompt_inputs else None
        number = next(self._count)
        rid = request_id if request_id is not None else f"req-{number}"
        if rid in self.requests:
            raise KilnError(f"request_id {rid!r} is already running")
        r = Request(rid, prompt, params, number)
        r.images = images  # engvis
        r.seqs.append(self._sequence(r, 0, list(prompt)))
        self.requests[rid] = r
        self.scheduler.waiting.append(r)
        return rid

    def _sequence(self, r: Request, index: int, tokens: list[int]) -> Sequence:
        p = r.params
        # without a seed of its own, a request's draws follow the engine's seed and its arrival number
        seed = p.seed if p.seed is not None else int.from_bytes(
            hashlib.blake2b(f"kiln-engine:{self.seed}:{r.order}".encode(), digest_size=8).digest(), "little") >> 1
        detok = None
        if self.tokenizer is not None:
            from kiln.engine.stops import Detokenizer

            detok = Detokenizer(self.tokenizer, r.prompt_ids, p.stop)
        return Sequence(r, index, tokens, request_generator(seed, index, self.runner.device), detok)

    def cancel(self, request_id: str) -> None:
        r = self.requests.pop(request_id, None)
        if r is None:
            return  # finished already (or never known): nothing to free
        s = self.scheduler
        # before the fork only the leader exists and stands for all n; after it, a completion that finished
        # already has had its finish
        running = [q.index for q in r.seqs if q.finish_reason is None] if r.forked else list(range(r.params.n))
        for q in r.seqs:
            if q.finish_reason is None:
                q.finish_reason = "cancelled"
                self.pool.release(q.table)
                q.table = []
                if q.state is not None:
                    self.pool.release_state(q.state)
                    q.state = None
        self.pool.release(r.copies)
        r.copies = []
        if r in s.waiting:
            s.waiting.remove(r)
        if r in s.running:
            s.running.remove(r)
        for j in running:
            self._cancelled.append(RequestOutput(r.request_id, j, [], [], [], "", True, "cancelled"))

    def forget_prefixes(self) -> None:
        """Call after changing the model's weights: prompts are no longer matched against blocks computed before."""
        self.pool.forget()
        self.runner.forget_weights()  # the packed LM head too (a change its version counter may not see)
        self.image_features.clear()  # engvis: the vision tower's weights may have changed too

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._cancelled)

    # ---- one step -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outs, self._cancelled = self._cancelled, []
        planned = self.scheduler.schedule()
        if not planned:
            if self.scheduler.running or self.scheduler.waiting:
                raise KilnError("the engine cannot make progress: the KV cache is too small for the waiting "
                                "request (raise kv_blocks)")
            return outs
        was = self.model.training
        if was:
            self.model.eval()  # no dropout (LoRA's included) while generating
        for s, piece in planned:
            piece.images = s.request.images  # engvis: an image-text prompt's features and rotary positions
        try:
            logits = self.runner.step([p for _, p in planned], self.pool, self.scheduler.max_seqs)
        except BaseException:
            if self.pool.snapshots is not None:  # engfeat: the slots reserved for this step's boundaries back
                self.pool.snapshots.drop_pending()
            raise
        finally:
            if was:
                self.model.train(was)
        self.tokens_fed += sum(len(p.ids) for _, p in planned)
        chosen: list[tuple[Sequence, int]] = []  # (sequence, its logits row): a fork's n share their leader's
        row = 0
        for s, piece in planned:
            s.computed += len(piece.ids)
            self.scheduler.remember(s)
            if piece.logits:
                chosen += [(q, row) for q in (self._fork(s) if not s.request.forked else [s])]
                row += 1
        if not chosen:
            return outs
        rows = [r for _, r in chosen]
        wanted = sorted({r for q, r in chosen if q.request.params.logprobs or q.request.params.top_logprobs})
        # the raw logits' log-probs (temperature 1, no filters), each row in its own call, for the rows that ask
        logp = dict(zip(wanted, log_softmax_rows(logits[wanted]))) if wanted else {}
        picked = sample(logits if rows == list(range(logits.shape[0])) else logits[rows],
                        [q.request.params for q, _ in chosen], [q.request.prompt_ids for q, _ in chosen],
                        [q.output for q, _ in chosen], [q.generator for q, _ in chosen],
                        logprobs=False).tokens.tolist()  # the log-probs are the per-row ones above
        for (q, r), token in zip(chosen, picked):
            outs.append(self._advance(q, int(token), logp.get(r)))
        return outs

    def _fork(self, leader: Sequence) -> list[Sequence]:
        """The prompt is in the cache: n completions sharing its blocks (the last, partly filled one copied into
        the blocks the scheduler lent for it with this step's piece: nothing here can run out of blocks)."""
        r = leader.request
        bs = self.pool.block_size
        partial = len(r.prompt_ids) % bs != 0
        if len(r.copies) != (r.params.n - 1 if partial else 0):
            raise KilnError(f"request {r.request_id}: the fork has {len(r.copies)} copy blocks lent, needs "
                            f"{r.params.n - 1 if partial else 0} (a scheduler slip)")
        copies, r.copies, r.forked = r.copies, [], True
        seqs = [leader]
        for j in range(1, r.params.n):
            table = list(leader.table)
            for b in table[:len(r.prompt_ids) // bs]:
                self.pool.share(b)
            if partial:
                self.pool.copy(table[-1], copies[j - 1])
                table[-1] = copies[j - 1]
            q = self._sequence(r, j, list(leader.tokens))
            q.table, q.computed, q.keys = table, leader.computed, list(leader.keys)
            if leader.state is not None:  # the recurrent state after the prompt, one copy per completion
                q.state = self.pool.allocate_state()
                self.pool.copy_state(leader.state, q.state)
            seqs.append(q)
        r.seqs = seqs
        return seqs

    def _advance(self, s: Sequence, token: int, logp: torch.Tensor | None) -> RequestOutput:
        """Record s's next token (with its log-probs row (V,) when the request asked for log-probs), check the
        stops."""
        p, r = s.request.params, s.request
        s.tokens.append(token)
        lp: list[float] = []
        tops: list[tuple[int, float]] = []
        if logp is not None:
            if p.logprobs:
                lp = [float(logp[token])]
                s.logprobs += lp
            if p.top_logprobs:
                # always the top MAX_TOP_LOGPROBS, then this request's count: ties keep one order for every count
                vals, idx = logp.topk(min(MAX_TOP_LOGPROBS, logp.shape[0]))
                tops = list(zip(idx[:p.top_logprobs].tolist(), vals[:p.top_logprobs].tolist()))
                s.top_logprobs.append(tops)
        delta, stopped = "", False
        if s.detok is not None:
            delta, stopped = s.detok.push(token)
            s.text = s.detok.text
        reason = None
        if stopped or (not p.ignore_eos and token in self.eos_ids) or token in p.stop_token_ids:
            reason = "stop"
        elif len(s.output) >= p.max_tokens or len(s.tokens) >= self.max_positions:
            reason = "length"
        if reason is not None:
            if s.detok is not None and not stopped:
                delta += s.detok.finish()  # the text held back for a stop string that never came
                s.text = s.detok.text
            self.scheduler.finish(s, reason)
            if all(q.finish_reason is not None for q in r.seqs) and r.forked:
                self.requests.pop(r.request_id, None)
        return RequestOutput(r.request_id, s.index, [token], lp, [tops] if p.top_logprobs else [], delta,
                             reason is not None, reason)

    # ---- run to completion ----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | Seq[SamplingParams],
                 prompt_inputs: Seq[dict | None] | None = None) -> list[list[Completion]]:  # engvis: images
        """Every prompt to the end; result[i][j] = completion j of prompt i. `prompt_inputs[i]`: prompt i's images
        (an image-text model's pixel_values and image_grid_thw), or None."""
        plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(plist) != len(prompts):
            raise KilnError(f"generate: {len(prompts)} prompts but {len(plist)} SamplingParams")
        inputs = [None] * len(prompts) if prompt_inputs is None else list(prompt_inputs)  # engvis
        if len(inputs) != len(prompts):  # engvis
            raise KilnError(f"generate: {len(prompts)} prompts but {len(inputs)} prompt_inputs")
        ids = [self.add_request(p, sp, prompt_inputs=x) for p, sp, x in zip(prompts, plist, inputs)]  # engvis
        reqs = [self.requests[i] for i in ids]
        while self.has_unfinished():
            self.step()
        return [[Completion(r.request_id, s.index, r.prompt_ids, s.output, s.logprobs, s.top_logprobs, s.text,
                            s.finish_reason or "length") for s in r.seqs] for r in reqs]

    def kv_usage(self) -> dict[str, int]:
        """Blocks and slots held by the pool, the tokens whose keys/values they hold, and the recurrent-state
        slots held (families with state)."""
        held = self.pool.held()
        tokens = sum(s.computed for r in self.scheduler.running for s in r.seqs if s.finish_reason is None)
        states = sum(s.state is not None for r in self.scheduler.running for s in r.seqs)  # recurrent state slots
        return {"blocks": held, "slots": held * self.pool.block_size, "tokens": tokens,
                "bytes": held * self.pool.bytes_per_block(), "states": states,
                "state_bytes": states * self.pool.bytes_per_state()}
