"""The engine on DeepSeek-V4 (kiln.engine.v4), as tests/engine/test_engine_families.py checks every other family:
batch invariance with a control that fails, engine log-probs = the scoring forward bit for bit and the model's
own forward to fp32 rounding, shared prompts equal unshared, greedy = the old loop, no block or state slot left
after preemption and cancel; and what V4 adds: sequences past the sliding window and many compression windows,
the cache's layout (no window key in a block, entries cut in per-token pieces equal to the model's own entries).

The tiny config has a sliding layer, a CSA layer (entries every 2 tokens, an indexer keeping 3) and an HCA layer
(every 4), a window of 4 keys, 3 residual streams, hash then top-k MoE and YaRN on the compress rope."""

from __future__ import annotations

import math

import pytest
import torch

from kiln.engine import Engine, SamplingParams, token_logps
from kiln.engine.v4 import Call, Seq
from kiln.models.common import compressor
from tests.engine.tiny import (
    generate_and_score,
    greedy_is_the_forwards_argmax,
    preempt_cancel_and_count,
    prompts,
    tiny_model,
    train_logps,
)

# The tiny indexer has 2 heads: an entry whose q . k is negative on both scores exactly 0 (relu), so a query often
# has equal scores at its k-th place, where the model's torch.topk picks in no stated order (the engine: the earlier
# entry). Comparisons with the model's own forward use 8 index heads, and `no_boundary_ties` checks no tie occurs.
NO_TIES = {"index_n_heads": 8}
# The model's forward and the engine sum in different orders (a whole-batch product against a fixed-tile one,
# SDPA-free softmaxes over other groupings): each dot product of length <= 64 differs by at most ~64 ulp relative
# (64 * 6e-8 = 4e-6), through 3 layers (each: a hyper-connection read, attention, MoE, a merge) with logits of a
# few units and a 99-way log-softmax, a few 1e-5 at the very worst; what is seen is ~2e-6. 1e-4 leaves room.
TRAIN_BOUND = 1e-4


def v4(**overrides):
    return tiny_model("deepseek_v4", **overrides)


def no_boundary_ties(model, seq: list[int]) -> bool:
    """Whether no query of `seq` has equal index scores at its k-th and (k+1)-th visible entries (the model's
    own forward, every CSA layer)."""
    seen, forward = [], compressor.IndexerScorer.forward

    def keep(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        seen.append(out[0])
        return out

    compressor.IndexerScorer.forward = keep
    try:
        with torch.no_grad():
            model(torch.tensor([seq]))
    finally:
        compressor.IndexerScorer.forward = forward
    ok = True
    for layer, scores in zip([la for la in model.model.layers if la.self_attn.compressor is not None
                              and hasattr(la.self_attn.compressor, "indexer")], seen):
        ix = layer.self_attn.compressor.indexer
        for p in range(scores.shape[0]):
            visible = scores[p, :(p + 1) // ix.rate].sort(descending=True).values
            if visible.shape[0] > ix.topk and visible[ix.topk - 1] == visible[ix.topk]:
                ok = False
    return ok


def mixed(count: int) -> list[SamplingParams]:
    kinds = [{"temperature": 0.0}, {"temperature": 0.9, "top_k": 20}, {"temperature": 1.0, "top_p": 0.9}]
    return [SamplingParams(max_tokens=2 + i % 4, logprobs=True, seed=100 + i, **kinds[i % len(kinds)])
            for i in range(count)]


def results(completions) -> list[tuple[list[int], list[float]]]:
    return [(c.token_ids, c.logprobs) for c in completions]


def test_alone_equals_among_31_others():
    model = v4()
    ps, params = prompts(32, 1, 16, seed=2), mixed(32)
    crowd = Engine(model, block_size=4, max_seqs=32, step_tokens=48).generate(ps, params)
    for i in (4, 13):
        assert results(Engine(model, block_size=4).generate([ps[i]], params[i])[0]) == results(crowd[i]), i
    other = SamplingParams(**{**params[4].__dict__, "seed": 7})  # the control: the comparison can fail
    assert results(Engine(model, block_size=4).generate([ps[4]], other)[0]) != results(crowd[4])


@pytest.mark.parametrize("ties", [True, False])
def test_engine_logps_equal_scoring_forward_and_near_the_models(ties):
    model = v4(**({} if ties else NO_TIES))
    for p, c, s in generate_and_score(model, prompts(4, 2, 24, seed=3), mixed(4)):
        engine = torch.tensor(c.logprobs)
        assert float((engine - s.detach()).abs().max()) == 0.0
        if ties:
            continue  # the model's own choice among equal scores is not stated (NO_TIES)
        assert no_boundary_ties(model, p + c.token_ids)
        assert float((engine - train_logps(model, p, c.token_ids)).abs().max()) < TRAIN_BOUND


def test_past_the_window_and_many_compression_windows():
    """A 29-token prompt and 20 new tokens (49 positions: 12 windows of the sliding window's 4 keys, 24 CSA and
    12 HCA entries), prefilled in chunks of 5 that cut windows anywhere: the scoring forward's bits, the same bits
    with blocks of 8 (V4's sums never follow the block size), chunks of 7, and the model's forward near."""
    model = v4(**NO_TIES)
    p = prompts(1, 29, 30, seed=17)[0]
    params = SamplingParams(max_tokens=20, temperature=1.0, seed=3, logprobs=True, ignore_eos=True)
    out = Engine(model, block_size=4, step_tokens=5).generate([p], params)[0][0]
    assert len(p) + len(out.token_ids) == 49
    engine = torch.tensor(out.logprobs)
    assert torch.equal(engine, token_logps(model, [p + out.token_ids], [len(p)], block_size=4)[0])
    other = Engine(model, block_size=8, step_tokens=7).generate([p], params)[0][0]
    assert results([other]) == results([out])
    assert no_boundary_ties(model, p + out.token_ids)
    assert float((engine - train_logps(model, p, out.token_ids)).abs().max()) < TRAIN_BOUND


def test_shared_prompt_equals_unshared():
    model = v4()
    prompt = prompts(1, 11, 12, seed=6)[0]  # 11 tokens: the last block of 4 is copied per completion
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=5, n=3, logprobs=True, ignore_eos=True)
    engine = Engine(model, block_size=4)
    out = engine.generate([prompt], params)[0]
    assert engine.tokens_fed == 11 + 3 * (5 - 1)  # the prompt once
    single = Engine(model, block_size=4).generate([prompt], SamplingParams(**{**params.__dict__, "n": 1}))[0][0]
    assert results([single]) == results(out[:1])
    scored = token_logps(model, [prompt + c.token_ids for c in out], [11] * 3, block_size=4)
    for c, s in zip(out, scored):
        assert torch.equal(torch.tensor(c.logprobs), s)
    assert engine.pool.num_free == engine.pool.num_blocks and len(engine.pool.free_states) == engine.scheduler.max_seqs


def test_greedy_is_the_forwards_argmax():
    """Greedy tokens = the argmax of the model's own forward (tiny.greedy_is_the_forwards_argmax)."""
    greedy_is_the_forwards_argmax(v4(**NO_TIES), prompts(6, 3, 16, seed=8), 10, no_boundary_ties)


def test_preemption_cancel_and_no_leak():
    """A pool too small for everyone (preemptions recompute the same bits), a cancel mid-stream, n = 3: every
    block and every state slot comes back."""
    assert preempt_cancel_and_count(v4()).pool.has_states


def test_a_forked_request_is_preempted_and_recomputes(monkeypatch):
    """n = 3 completions preempted after the fork (each with its own state): each recomputes its whole sequence
    and gives what it gives alone."""
    from kiln.engine.scheduler import Scheduler

    victims = []
    preempt = Scheduler.preempt
    monkeypatch.setattr(Scheduler, "preempt", lambda self, r: (victims.append(r.forked), preempt(self, r))[1])
    model = v4()
    a, b = prompts(2, 6, 9, seed=21)
    pa = SamplingParams(max_tokens=20, temperature=0.0, logprobs=True)
    pb = SamplingParams(max_tokens=12, temperature=1.0, seed=4, n=3, logprobs=True)
    engine = Engine(model, block_size=4, kv_blocks=15, max_seqs=4, step_tokens=64)
    out = engine.generate([a, b], [pa, pb])
    assert victims == [True]
    assert len(engine.pool.free_states) == 4 and engine.pool.num_free == 15
    monkeypatch.setattr(Scheduler, "preempt", preempt)
    assert results(out[1]) == results(Engine(model, block_size=4).generate([b], pb)[0])


def test_the_cache_holds_the_window_ring_and_entry_pieces_equal_to_the_models_entries():
    """No block holds a window key (a sliding layer's slots are empty); a compressed layer's slot is
    ceil(head_dim / rate) numbers (the indexer's beside it on CSA); the state holds window - 1 keys. After a
    prompt, the entries read back from the pieces (and the state's last one) are the model's own cache's."""
    model = v4(**NO_TIES)
    c = model.config
    engine = Engine(model, block_size=4, max_seqs=2, step_tokens=64)
    D, rates = c.head_dim, c.rates()
    r_csa, r_hca = rates["compressed_sparse_attention"], rates["heavily_compressed_attention"]
    assert [tuple(k.shape[2:]) for k in engine.pool.keys] == [(0,), (1, math.ceil(D / r_csa)), (1, math.ceil(D / r_hca))]
    assert [tuple(v.shape[2:]) for v in engine.pool.values] == [(0,), (1, math.ceil(c.index_head_dim / r_csa)), (0,)]
    assert engine.pool.states[0][0].shape == (2, c.sliding_window - 1, D)
    prompt = prompts(1, 23, 24, seed=19)[0]
    engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.0))
    engine.step()  # the whole prompt in one chunk; the sequence runs on
    s = engine.scheduler.running[0].seqs[0]
    cache = model.model.new_cache()
    with torch.no_grad():
        model(torch.tensor([prompt]), cache=cache)
    runner = engine.runner
    for i in (1, 2):
        for k, wp in enumerate(runner.series[i]):
            expect = cache.states[i]["compressor" if k == 0 else "indexer"].entries[0]  # (n, d)
            past = Call(runner, [Seq(0, 1, len(prompt), s.table, s.state)], engine.pool).past(i, k, Seq(
                0, 1, len(prompt), s.table, s.state), wp)
            got = torch.cat([past, engine.pool.states[i][5 if wp.overlap else 3][s.state][None]]
                            if k == 0 else [past, engine.pool.states[i][-1][s.state][None]])
            assert got.shape == expect.shape == (len(prompt) // wp.rate, wp.head_dim)
            assert float((got - expect).abs().max()) < 1e-5  # pooled sums in another order: fp32 rounding
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free == engine.pool.num_blocks


def test_the_indexer_choice_and_the_window_matter():
    """Controls: with index_topk past every entry the CSA layer reads all it may (log-probs change, but not for
    rows with no more than topk visible entries); with a window past every sequence they change again."""
    model = v4()
    seq = prompts(1, 30, 31, seed=13)[0]
    sparse = token_logps(model, [seq], [1], block_size=4)[0]
    ix = model.model.layers[1].self_attn.compressor.indexer
    topk, ix.topk = ix.topk, 64
    dense = token_logps(model, [seq], [1], block_size=4)[0]
    ix.topk = topk
    assert not torch.equal(sparse, dense)
    rows = (ix.topk + 1) * ix.rate - 1  # positions 0 .. rows - 1 see at most topk entries
    assert torch.equal(sparse[:rows - 1], dense[:rows - 1])
    wide = v4(sliding_window=64)
    assert not torch.equal(sparse, token_logps(wide, [seq], [1], block_size=4)[0])


def test_scoring_forward_is_differentiable_and_refuses_nothing_it_runs():
    model = v4()
    lp = token_logps(model, [prompts(1, 12, 13, seed=5)[0]], [4])[0]
    lp.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert all(torch.isfinite(g).all() for g in grads.values())
    for part in ("attn_hc.fn", "sinks", "compressor.kv_proj", "compressor.position_bias", "hc_head.hc_fn"):
        assert any(part in n and float(g.abs().max()) > 0 for n, g in grads.items()), part


def test_under_lora_the_adapters_are_read():
    """LoRA on the query, key = value and output projections, the compressors' and the shared expert's: engine =
    scoring forward, near the model's forward, and not what the bare model gives (the control)."""
    from kiln.models.common.lora import LoraConfig, apply_lora

    model = v4(**NO_TIES)
    apply_lora(model, LoraConfig(r=4, alpha=8, targets=["q_b_proj", "kv_proj", "o_b_proj", "gate_proj", "up_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    model.eval()
    p = prompts(1, 9, 10, seed=12)[0]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, logprobs=True)
    out = Engine(model, block_size=4).generate([p], greedy)[0][0]
    assert torch.equal(torch.tensor(out.logprobs), token_logps(model, [p + out.token_ids], [len(p)], block_size=4)[0])
    assert no_boundary_ties(model, p + out.token_ids)
    assert float((torch.tensor(out.logprobs) - train_logps(model, p, out.token_ids)).abs().max()) < TRAIN_BOUND
    bare = Engine(v4(**NO_TIES), block_size=4).generate([p], greedy)[0][0]
    assert bare.logprobs != out.logprobs
