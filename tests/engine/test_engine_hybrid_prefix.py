"""Prefix reuse for the families with recurrent state (kiln.engine.prefix_state): a request whose prompt starts as an
earlier one's did takes the kept state and the remembered blocks and prefills only the rest, with the tokens and
log-probs of a fresh engine bit for bit (Gated DeltaNet hybrids, Mamba, the image-text model, whose keys hold the
images' digests); the counters show the reuse; snapshots stay within their bound, and nothing leaks."""

from __future__ import annotations

import pytest
import torch

from kiln.engine import Engine, SamplingParams, prefix_state
from tests.engine.test_engine_vision import image, marked, vision_model
from tests.engine.tiny import prompts, tiny_model

STATEFUL = ["qwen3_next", "qwen3_5_text", "mamba"]


def params(seed: int = 0, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=5, temperature=1.0, seed=seed, logprobs=True, n=n)


def results(done) -> list[tuple[list[int], list[float]]]:
    return [(c.token_ids, c.logprobs) for c in done]


def fresh(model, prompt, sp, inputs=None):
    engine = Engine(model, block_size=4, step_tokens=16)
    return results(engine.generate([prompt], sp, [inputs])[0]), engine


@pytest.mark.parametrize("family", STATEFUL)
def test_shared_prefix_reused_and_bit_equal(family):
    model = tiny_model(family)
    system = prompts(1, 21, 22, seed=4)[0]  # 21 tokens: 5 full blocks of 4
    a, b = system + prompts(1, 5, 6, seed=5)[0], system + prompts(1, 7, 8, seed=6)[0]
    engine = Engine(model, block_size=4, step_tokens=16)
    prefix_state.enable(engine.pool, every=2)  # a snapshot every 2 blocks (8 tokens)
    first = results(engine.generate([a], params(1))[0])
    fed = engine.tokens_fed
    second = results(engine.generate([b], params(2))[0])
    snaps = engine.pool.snapshots
    # b's first 16 tokens (the boundary at 16 is the deepest kept one inside the 21 shared) come from a's run
    assert snaps.hits == 1 and snaps.reused_tokens == 16
    assert engine.tokens_fed - fed == len(b) - 16 + 4  # the rest of the prompt, then 4 fed samples
    assert second == fresh(model, b, params(2))[0]
    assert first == fresh(model, a, params(1))[0]
    # the same prompt again (a GRPO group sent as separate requests): all but the last block-aligned rest reused
    again = results(engine.generate([b], params(2))[0])
    assert again == second and snaps.hits == 2 and snaps.reused_tokens == 16 + (len(b) - 1) // 4 * 4
    # the control: a state that is not the prefix's (zeroed) gives other numbers, so the equality above can fail
    engine.pool.snapshots.layers = [[torch.zeros_like(t) for t in layer] for layer in snaps.layers]
    assert results(engine.generate([b], params(2))[0]) != second


def test_n_completions_and_repeats_share_one_prefill():
    model = tiny_model("qwen3_next")
    p = prompts(1, 18, 19, seed=8)[0]
    engine = Engine(model, block_size=4, step_tokens=64)
    group = results(engine.generate([p], params(3, n=4))[0])
    assert engine.tokens_fed == len(p) + 4 * 4  # one prefill for the 4 completions
    assert group == fresh(model, p, params(3, n=4))[0]
    fed = engine.tokens_fed
    assert results(engine.generate([p, p], [params(3, n=4), params(3, n=4)])[0]) == group
    # two more groups of the same prompt in one step: both start from the kept state at token 16
    assert engine.tokens_fed - fed == 2 * (len(p) - 16 + 4 * 4)


def test_image_digests_key_the_state():
    model = vision_model()
    one, two = image(model, 2, 4, seed=1), image(model, 2, 4, seed=2)
    text = prompts(1, 3, 4, seed=9, vocab=90)[0]
    p = text + marked(one)[0] + prompts(1, 13, 14, seed=10, vocab=90)[0]  # the image in block 1, 24 tokens
    engine = Engine(model, block_size=4, step_tokens=16)
    prefix_state.enable(engine.pool, every=1)
    engine.generate([p], params(4), [one])
    snaps = engine.pool.snapshots
    other = results(engine.generate([p], params(4), [two])[0])  # the same tokens, another image
    # only block 0 (text and the vision start, before the placeholders) is the same content
    assert snaps.hits == 1 and snaps.reused_tokens == 4
    assert other == fresh(model, p, params(4), two)[0]
    same = results(engine.generate([p], params(4), [one])[0])
    assert snaps.hits == 2 and snaps.reused_tokens == 4 + (len(p) - 1) // 4 * 4
    assert same == fresh(model, p, params(4), one)[0] != other


def test_bounded_and_no_leak_over_many_requests():
    model = tiny_model("qwen3_5_text")
    heads = prompts(6, 9, 14, seed=12)
    engine = Engine(model, block_size=4, kv_blocks=40, max_seqs=4, step_tokens=24)
    prefix_state.enable(engine.pool, count=5, every=1)
    snaps = engine.pool.snapshots
    g = torch.Generator().manual_seed(3)
    for k in range(16):
        ps = [heads[int(torch.randint(6, (1,), generator=g))] + prompts(1, 1, 6, seed=100 + 4 * k + i)[0]
              for i in range(3)]
        engine.generate(ps, [SamplingParams(max_tokens=2, n=1 + i % 2, seed=k) for i in range(3)])
    assert snaps.hits > 0 and snaps.saved > snaps.count  # reuse happened, and more was saved than the bound holds
    assert len(snaps.kept) + len(snaps.free) == snaps.count and not snaps.pending
    assert engine.pool.num_free == engine.pool.num_blocks and not any(engine.pool.refs)
    assert len(engine.pool.free_states) == 4
    engine.forget_prefixes()
    assert not snaps.kept and len(snaps.free) == snaps.count and not engine.pool.known


def test_only_runners_that_keep_their_state_get_snapshots():
    assert Engine(tiny_model("qwen3")).pool.snapshots is None  # no state: the blocks are the prefix
    assert Engine(tiny_model("deepseek_v4")).pool.snapshots is None  # its own state path (kiln.engine.v4)
    snaps = Engine(tiny_model("mamba"), max_seqs=3).pool.snapshots
    assert snaps is not None and snaps.count == 12  # 4 per seat (tiny states: far under the byte bound)
