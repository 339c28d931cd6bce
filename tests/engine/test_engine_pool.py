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

