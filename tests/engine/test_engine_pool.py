"""The engine's KV-cache accounting on tiny decoders: admission, forks, the add-time bound, cancel, stale blocks."""

from __future__ import annotations

import pytest
import torch

from kiln.engine import Engine, SamplingParams
from kiln.errors import KilnError
from tests.engine.tiny import prompts, tiny_model


def drain(engine: Engine) -> dict[tuple[str, int], list]:
    """Step to the end; per (request, index): the tokens and the finish reasons seen."""
    seen: dict[tuple[str, int], list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            tokens, reasons = seen.setdefault((o.request_id, o.index), ([], []))
            tokens += o.token_ids
            if o.finished:
                reasons.append(o.finish_reason)
    return seen


@pytest.mark.parametrize("cancel", [False, True])
def test_admission_counts_what_it_admitted_and_the_fork_copies(cancel):
    """block_size 4, 7 blocks, one request running, then two n=3 requests with 7-token prompts (each fork copies
    the prompt's partly filled last block twice): everything completes (deferred or preempted, never an 'out of
    blocks' after a half-made fork), each completion equals itself alone, and no block is left held."""
    model = tiny_model()
    engine = Engine(model, block_size=4, kv_blocks=7, max_seqs=8)
    first = prompts(1, 5, 6, seed=20)[0]
    engine.add_request(first, SamplingParams(max_tokens=8, temperature=0.0))
    early = engine.step()
    assert len(early) == 1
    ps = prompts(2, 7, 8, seed=21)
    params = [SamplingParams(max_tokens=5, temperature=1.0, seed=s, n=3, ignore_eos=True) for s in (1, 2)]
    ids = [engine.add_request(p, sp) for p, sp in zip(ps, params)]
    if cancel:
        engine.step()
        engine.cancel(ids[0])
    seen = drain(engine)
    for o in early:
        seen[(o.request_id, o.index)][0][:0] = o.token_ids
    assert engine.pool.held() == 0 and not any(engine.pool.refs)
    for rid, p, sp in zip(ids, ps, params):
        alone = Engine(model, block_size=4).generate([p], sp)[0]
        for c in alone:
            tokens, reasons = seen[(rid, c.index)]
            if cancel and rid == ids[0]:
                assert reasons == ["cancelled"]
            else:
                assert reasons == ["length"] and tokens == c.token_ids


def test_a_request_that_can_never_fit_is_refused_at_add_and_one_that_fits_completes():
    """The add-time bound is the true peak: the prompt's full blocks once, then each completion's own blocks
    (the copied last prompt block included) up to its last fed token. n=4, a 4-token prompt, max_tokens=28,
    block_size 4: 1 + 4 * (ceil(31 / 4) - 1) = 29 blocks."""
    model = tiny_model()
    params = SamplingParams(max_tokens=28, n=4, temperature=1.0, seed=1, ignore_eos=True)
    with pytest.raises(KilnError, match=r"29 KV blocks.*1 shared prompt block.*4 completions x 7.*has 12"):
        Engine(model, block_size=4, kv_blocks=12).add_request([5, 6, 7, 8], params)
    for prompt in ([5, 6, 7, 8], [5, 6, 7, 8, 9, 10]):  # the last prompt block full, and partly filled (copied)
        full = len(prompt) // 4
        peak = full + 4 * ((len(prompt) + 28 - 1 + 3) // 4 - full)
        engine = Engine(model, block_size=4, kv_blocks=peak)
        with pytest.raises(KilnError, match=f"{peak + 16} KV blocks"):
            engine.add_request(prompt, SamplingParams(**{**params.__dict__, "max_tokens": 28 + 16}))
        engine.add_request(prompt, params)
        most, allocate = [0], engine.pool.allocate

        def counted() -> int:  # the peak is inside a step: the last keys are fed, then the completions finish
            b = allocate()
            most[0] = max(most[0], engine.pool.held())
            return b

        engine.pool.allocate = counted
        drain(engine)
        assert most[0] == peak and engine.pool.held() == 0


def test_a_dry_sequence_does_not_stop_the_plan():
    """With one request running and no block left for its first completion, the ones after it still run (the
    plan goes on past a dry sequence). Completion 1 is handed a block ahead, so only completion 0 is dry."""
    model = tiny_model()
    engine = Engine(model, block_size=4, kv_blocks=8)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=3, ignore_eos=True))
    engine.step()  # prefill and fork: each completion's own copy of the 3-token block
    engine.step()  # the 4th key fills that block
    seqs = engine.requests["req-0"].seqs
    hog = [engine.pool.allocate() for _ in range(engine.pool.num_free)]  # the pool is dry now
    seqs[1].table.append(hog.pop())  # completion 1 holds the block its 5th key goes to; completion 0 has none
    outs = engine.step()
    assert [o.index for o in outs] == [1] and len(seqs[0].table) == 1
    engine.pool.release(hog)
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.held() == 0


def test_cancel_emits_a_finish_only_for_completions_still_running():
    """A request with n=2 whose completion 0 stopped already: cancel finishes completion 1 alone (one finish per
    completion in all)."""
    model = tiny_model()
    prompt = prompts(1, 5, 6, seed=22)[0]
    base = SamplingParams(max_tokens=6, n=2, temperature=1.0, ignore_eos=True)
    for seed in range(50):  # a seed whose completion 0 draws, first, a token completion 1 never draws
        a, b = Engine(model, block_size=4).generate([prompt], SamplingParams(**{**base.__dict__, "seed": seed}))[0]
        if a.token_ids[0] not in b.token_ids:
            break
    else:
        pytest.fail("no seed in 0..49 separates the two completions' first tokens")
    engine = Engine(model, block_size=4)
    rid = engine.add_request(prompt, SamplingParams(**{**base.__dict__, "seed": seed,
                                                      "stop_token_ids": (a.token_ids[0],)}))
    finishes = [(o.index, o.finish_reason) for o in engine.step() if o.finished]
    assert finishes == [(0, "stop")]
    engine.cancel(rid)
    finishes += [(o.index, o.finish_reason) for o in drain_outputs(engine) if o.finished]
    assert finishes == [(0, "stop"), (1, "cancelled")]
    assert engine.pool.held() == 0


def drain_outputs(engine: Engine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def test_stale_inf_and_nan_in_freed_blocks_never_reach_a_row():
    """Freed blocks keep what they held and the decode tables are padded to the longest: poison every free
    block with NaN and inf (keys and values), then run requests of mixed lengths beside each other: the same
    tokens and bit-equal, finite log-probs as on a clean engine."""
    model = tiny_model()
    ps, params = prompts(6, 1, 20, seed=23), [SamplingParams(max_tokens=8, temperature=1.0, seed=s, n=1 + s % 2,
                                                                logprobs=True, ignore_eos=True) for s in range(6)]
    clean = Engine(model, block_size=4, max_seqs=16).generate(ps, params)
    engine = Engine(model, block_size=4, max_seqs=16)
    engine.generate(prompts(3, 5, 30, seed=24), SamplingParams(max_tokens=5, temperature=1.0, seed=9))
    engine.forget_prefixes()  # remembered blocks are content to keep; the others are only stale
    free = torch.tensor(list(engine.pool.free))
    assert len(free) == engine.pool.num_blocks
    for layer, pool in enumerate((*engine.pool.keys, *engine.pool.values)):
        pool[free] = float("nan") if layer % 2 else float("inf")
        pool[free[::3], 1::2] = -float("inf")
    poisoned = engine.generate(ps, params)
    for c, d in zip(clean, poisoned):
        assert [(x.token_ids, x.logprobs) for x in c] == [(x.token_ids, x.logprobs) for x in d]
        assert all(torch.isfinite(torch.tensor(x.logprobs)).all() for x in d)


def test_a_preempted_fork_recomputes_its_prompt_once():
    """A forked n=3 request in a pool of exactly its peak (12 blocks) is preempted by an older request's growth;
    when it runs again its completions wait for the first to recompute the prompt's full blocks and share them
    (n private copies of the prompt would exceed the peak and leave every completion waiting for a block).
    It completes with what it gives alone, and no block is left held."""
    model = tiny_model()
    engine = Engine(model, block_size=4, kv_blocks=12, step_tokens=64)
    pa, pb = prompts(1, 6, 7, seed=40)[0], prompts(1, 12, 13, seed=30)[0]
    sa = SamplingParams(max_tokens=40, temperature=1.0, seed=0, ignore_eos=True)
    sb = SamplingParams(max_tokens=10, n=3, temperature=1.0, seed=0, ignore_eos=True)
    a = engine.add_request(pa, sa)
    early = engine.step()
    b = engine.add_request(pb, sb)
    seen = drain(engine)
    assert engine.scheduler.preemptions > 0 and engine.pool.held() == 0
    assert early[0].token_ids + seen[(a, 0)][0] == Engine(model, block_size=4).generate([pa], sa)[0][0].token_ids
    for c in Engine(model, block_size=4).generate([pb], sb)[0]:
        assert seen[(b, c.index)] == (c.token_ids, ["length"])
