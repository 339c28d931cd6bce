"""The engine on tiny decoders: batch invariance, exact log-probs, shared prompts, cancel, growth, no leaks."""

from __future__ import annotations

import pytest
import torch

from kiln.engine import Engine, SamplingParams, token_logps
from kiln.errors import KilnError
from tests.engine.tiny import generate_and_score, prompts, tiny_model, train_logps

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, logprobs=True)


def mixed_params(count: int) -> list[SamplingParams]:
    """Greedy, sampled with top-k / top-p / min-p and penalties, each sampled one with its own seed."""
    kinds = [{"temperature": 0.0}, {"temperature": 0.8, "top_k": 20}, {"temperature": 1.0, "top_p": 0.9},
             {"temperature": 1.2, "min_p": 0.05, "repetition_penalty": 1.3}, {"temperature": 0.7, "presence_penalty": 0.5}]
    return [SamplingParams(max_tokens=4 + i % 9, logprobs=True, seed=100 + i, **kinds[i % len(kinds)])
            for i in range(count)]


def results(completions) -> list[tuple[list[int], list[float]]]:
    return [(c.token_ids, c.logprobs) for c in completions]


@pytest.mark.parametrize("model_type", ["qwen3", "llama", "qwen2", "qwen3_moe"])
def test_alone_equals_among_31_others(model_type):
    """A request alone and inside 31 others (chunked prefills interleaved with decodes, other rows in its
    tiles): the same tokens and bit-equal log-probs."""
    model = tiny_model(model_type)
    ps, params = prompts(32, 1, 40, seed=2), mixed_params(32)
    crowd = Engine(model, block_size=4, max_seqs=32, step_tokens=48).generate(ps, params)
    checked = [0, 7, 13, 31] if model_type == "qwen3" else [3, 13]
    for i in checked:
        alone = Engine(model, block_size=4).generate([ps[i]], params[i])[0]
        assert results(alone) == results(crowd[i]), f"request {i} ({params[i]})"
    # the control: a different seed changes a sampled request, so the comparison can fail
    other = SamplingParams(**{**params[1].__dict__, "seed": 7})
    assert results(Engine(model, block_size=4).generate([ps[1]], other)[0]) != results(crowd[1])


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_engine_logps_equal_scoring_forward_and_near_training_forward(model_type):
    """Engine log-probs = kiln.engine.token_logps on the finished sequences (max abs diff 0); the training
    forward (ForCausalLM.token_logps, batched SDPA) agrees to fp32 rounding."""
    model = tiny_model(model_type)
    rows = generate_and_score(model, prompts(6, 2, 30, seed=3), mixed_params(6))
    for p, c, s in rows:
        engine = torch.tensor(c.logprobs)
        assert float((engine - s.detach()).abs().max()) == 0.0
        # fp32 rounding through 2 layers of width 32 and a 99-way softmax: a few 1e-7 relative per op
        assert float((engine - train_logps(model, p, c.token_ids)).abs().max()) < 1e-4
    p, c, s = rows[0]
    other = token_logps(model, [p + c.token_ids], [len(p)], block_size=8)[0]
    assert float((s - other).detach().abs().max()) < 1e-4


def test_block_size_must_match_for_bits():
    """The control for the exactness test: the summation order depends on the block size, so the check can
    fail (the scores at another block size are not all bit-equal on a long sequence)."""
    model = tiny_model()
    seq = prompts(1, 50, 51, seed=4)[0]
    a, b = token_logps(model, [seq], [1], block_size=4)[0], token_logps(model, [seq], [1], block_size=32)[0]
    assert not torch.equal(a, b)


def test_scoring_forward_is_differentiable():
    model = tiny_model()
    seq = prompts(1, 12, 13, seed=5)[0]
    lp = token_logps(model, [seq], [4])[0]
    lp.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(float(g.abs().max()) > 0 for g in grads)


def test_shared_prompt_prefilled_once_and_equal_to_unshared():
    """n completions share the prompt's blocks: its prefill runs once, and each completion equals what it is
    unshared (completion 0 = an n=1 request with the same seed; every completion's log-probs = the scoring
    forward, which shares nothing)."""
    model = tiny_model()
    for plen in (8, 11):  # the prompt's last block full (no copy), and partly filled (copied per completion)
        prompt = prompts(1, plen, plen + 1, seed=6)[0]
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=5, n=4, logprobs=True, ignore_eos=True)
        engine = Engine(model, block_size=4)
        out = engine.generate([prompt], params)[0]
        assert engine.tokens_fed == plen + 4 * (6 - 1)  # the prompt once, then one token per completion per step
        assert len({tuple(c.token_ids) for c in out}) > 1  # the completions draw from their own generators
        single = Engine(model, block_size=4).generate([prompt], SamplingParams(**{**params.__dict__, "n": 1}))[0][0]
        assert results([single]) == results(out[:1])
        scored = token_logps(model, [prompt + c.token_ids for c in out], [plen] * 4, block_size=4)
        for c, s in zip(out, scored):
            assert torch.equal(torch.tensor(c.logprobs), s)
        assert engine.pool.num_free == engine.pool.num_blocks


def test_prompt_blocks_are_shared_while_running():
    model = tiny_model()
    engine = Engine(model, block_size=4)
    engine.add_request(list(range(4, 14)), SamplingParams(max_tokens=5, temperature=1.0, seed=1, n=3))
    engine.step()  # the prompt's prefill and the first token of each completion
    seqs = engine.requests["req-0"].seqs
    assert len(seqs) == 3
    shared = seqs[0].table[:2]  # 10 prompt tokens: two full blocks shared, the third copied
    assert all(s.table[:2] == shared for s in seqs) and len({s.table[2] for s in seqs}) == 3
    assert [engine.pool.refs[b] for b in shared] == [3, 3]


def test_greedy_is_the_forwards_argmax():
    """Greedy tokens are the argmax of the model's own training forward (batched SDPA, another summation order):
    the prompts are chosen so every step's top two logits are far apart compared with fp32 rounding."""
    model = tiny_model()
    ps = prompts(4, 3, 20, seed=8)
    outs = Engine(model).generate(ps, SamplingParams(max_tokens=12, temperature=0.0))
    for p, c in zip(ps, outs):
        with torch.no_grad():
            ids = torch.tensor([p + c[0].token_ids])
            logits = model(ids).logits[0, len(p) - 1:-1].float()
        top2 = logits.topk(2, -1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > 1e-3  # no near tie: the comparison is meaningful
        assert logits.argmax(-1).tolist() == c[0].token_ids


def test_cancel_mid_stream_frees_and_leaves_others_alone():
    model = tiny_model()
    ps = prompts(3, 5, 15, seed=9)
    engine = Engine(model, block_size=4)
    ids = [engine.add_request(p, GREEDY) for p in ps]
    seen: dict[str, list[int]] = {i: [] for i in ids}
    for _ in range(3):
        for o in engine.step():
            seen[o.request_id] += o.token_ids
    held = engine.pool.held()
    engine.cancel(ids[1])
    assert engine.pool.held() < held
    outs = engine.step()
    cancelled = [o for o in outs if o.request_id == ids[1]]
    assert len(cancelled) == 1 and cancelled[0].finished and cancelled[0].finish_reason == "cancelled"
    for o in outs:
        if o.request_id != ids[1]:
            seen[o.request_id] += o.token_ids
    while engine.has_unfinished():
        for o in engine.step():
            assert o.request_id != ids[1]
            seen[o.request_id] += o.token_ids
    assert 0 < len(seen[ids[1]]) < 10
    for i in (0, 2):
        assert seen[ids[i]] == Engine(model, block_size=4).generate([ps[i]], GREEDY)[0][0].token_ids
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.cancel(ids[1])  # cancelling twice (or a finished request) is a no-op


def test_a_sequence_outgrows_its_blocks():
    model = tiny_model()
    prompt = prompts(1, 3, 4, seed=10)[0]
    engine = Engine(model, block_size=2)
    engine.add_request(prompt, SamplingParams(max_tokens=20, temperature=0.0, logprobs=True))
    sizes = []
    while engine.has_unfinished():
        engine.step()
        seqs = [s for r in engine.scheduler.running for s in r.seqs]
        if seqs:
            sizes.append(len(seqs[0].table))
    assert sizes[0] == 2 and max(sizes) == 11  # 3 + 19 keys in blocks of 2 (the last token is never fed)
    assert engine.pool.num_free == engine.pool.num_blocks


def test_preemption_recomputes_the_same_bits():
    """A pool too small for everyone: the youngest requests are preempted, recompute, and still give what
    they give alone."""
    model = tiny_model()
    ps, params = prompts(6, 10, 20, seed=11), mixed_params(6)
    engine = Engine(model, block_size=4, kv_blocks=9, max_seqs=6, step_tokens=64)  # 2 preemptions
    crowd = engine.generate(ps, params)
    assert engine.scheduler.preemptions > 0  # the pool was too small: what this test is about happened
    for i in range(6):
        assert results(Engine(model, block_size=4).generate([ps[i]], params[i])[0]) == results(crowd[i])
    assert engine.pool.num_free == engine.pool.num_blocks


def test_no_leak_over_1000_requests():
    model = tiny_model()
    engine = Engine(model, block_size=2, kv_blocks=160, max_seqs=64, step_tokens=256)
    g = torch.Generator().manual_seed(12)
    ids = []
    for i in range(1000):
        n = int(torch.randint(1, 4, (), generator=g))
        prompt = torch.randint(4, 99, (int(torch.randint(1, 6, (), generator=g)),), generator=g).tolist()
        ids.append(engine.add_request(prompt, SamplingParams(max_tokens=int(torch.randint(1, 4, (), generator=g)),
                                                             temperature=1.0, seed=i, n=n)))
        if i % 20 == 0:  # requests arrive while others run
            engine.step()
        if i % 11 == 0:
            engine.cancel(ids[int(torch.randint(0, len(ids), (), generator=g))])
    while engine.has_unfinished():
        engine.step()
    assert engine.pool.num_free == engine.pool.num_blocks and not any(engine.pool.refs)
    assert not engine.requests and not engine.scheduler.running and not engine.scheduler.waiting


def test_stops_on_eos_and_stop_token_ids():
    model = tiny_model()
    prompt = prompts(1, 5, 6, seed=13)[0]
    free = Engine(model).generate([prompt], GREEDY)[0][0]
    stop_at = free.token_ids[3]
    first = free.token_ids.index(stop_at)
    out = Engine(model).generate([prompt], SamplingParams(max_tokens=10, temperature=0.0,
                                                          stop_token_ids=(stop_at,)))[0][0]
    assert out.token_ids == free.token_ids[:first + 1] and out.finish_reason == "stop"
    eos = Engine(model, eos_token_ids=[stop_at]).generate([prompt], GREEDY)[0][0]
    assert eos.token_ids == out.token_ids and eos.finish_reason == "stop"
    ignore = Engine(model, eos_token_ids=[stop_at]).generate(
        [prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0][0]
    assert ignore.token_ids == free.token_ids and ignore.finish_reason == "length"


def test_bad_requests_are_refused_by_name():
    model = tiny_model()
    engine = Engine(model)
    with pytest.raises(KilnError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(KilnError, match="outside the vocabulary"):
        engine.add_request([5, 99], GREEDY)
    with pytest.raises(KilnError, match="64 positions"):
        engine.add_request(list(range(4, 68)), GREEDY)
    with pytest.raises(KilnError, match="tokenizer"):
        engine.add_request([5], SamplingParams(stop=("x",)))
    with pytest.raises(KilnError, match="image-text"):
        engine.add_request([5], GREEDY, prompt_inputs={"pixel_values": torch.zeros(1)})
    engine.add_request([5], GREEDY, request_id="a")
    with pytest.raises(KilnError, match="already running"):
        engine.add_request([6], GREEDY, request_id="a")
    with pytest.raises(KilnError, match="max_seqs"):
        Engine(model, max_seqs=0)


def test_unreached_families_are_refused_by_name():
    # engv4: every family has a runner now (DeepSeek-V4: kiln.engine.v4); a model of no registered kind (an
    # attention class no runner knows) is refused by its family's name
    from kiln.models.common.decoder import Attention

    model = tiny_model("qwen3")
    model.model.layers[0].self_attn.__class__ = type("OtherAttention", (Attention,), {})
    with pytest.raises(KilnError, match="'qwen3'"):
        Engine(model)


def _bpe():
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=300, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the cat sat on the mat, naïve café, 猫 🎉"] * 20, trainer)
    return tok


def test_text_stop_strings_and_top_logprobs():
    """Streamed text deltas add up to the completion's text; a stop string cuts the text before it and ends the
    completion; top_logprobs are the row's most likely tokens, the greedy choice first."""
    tok = _bpe()
    model = tiny_model(vocab_size=tok.get_vocab_size())
    prompt = tok.encode("the cat").ids
    engine = Engine(model, tok)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=24, temperature=0.0, logprobs=True, top_logprobs=3))
    deltas, outs = [], []
    while engine.has_unfinished():
        for o in engine.step():
            deltas.append(o.text)
            outs.append(o)
    text = "".join(deltas)
    tokens = [t for o in outs for t in o.token_ids]
    assert text == tok.decode(tokens) and len(text) > 6
    for o in outs:
        (top,) = o.top_logprobs
        assert top[0] == (o.token_ids[0], o.logprobs[0]) and len(top) == 3
        assert top[0][1] >= top[1][1] >= top[2][1]
    stop = text[3:6]
    out = Engine(model, tok).generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, stop=(stop,)))[0][0]
    assert out.text == text[:text.index(stop)] and out.finish_reason == "stop"
    assert out.token_ids == tokens[:len(out.token_ids)]
    assert rid == "req-0"


def test_a_long_prompt_is_prefilled_in_chunks_beside_running_decodes():
    """step_tokens = 8: a 40-token prompt takes several steps of chunks, and the running request still gets a
    token at every one of them (the budget serves decodes first)."""
    model = tiny_model()
    engine = Engine(model, block_size=4, step_tokens=8)
    a = engine.add_request([5, 6, 7], SamplingParams(max_tokens=12, temperature=0.0))
    engine.step()
    b = engine.add_request(prompts(1, 40, 41, seed=14)[0], SamplingParams(max_tokens=2, temperature=0.0))
    steps_until_b = 0
    while True:
        outs = engine.step()
        steps_until_b += 1
        assert [o.request_id for o in outs if o.request_id == a] == [a]  # a decodes at every step
        if any(o.request_id == b for o in outs):
            break
    assert steps_until_b == 6  # 40 prompt tokens, 7 a step beside a's decode token: 6 steps


def test_a_common_prompt_prefix_is_computed_once():
    """A later request whose prompt starts with an earlier one's (a system prompt) takes its full blocks: only
    the rest is fed, and its tokens and log-probs are those it gets alone. After forget_prefixes, all is fed."""
    model = tiny_model()
    system = prompts(1, 13, 14, seed=15)[0]  # 13 tokens: 3 full blocks of 4
    a, b = system + [5, 6], system + [7, 8, 9]
    engine = Engine(model, block_size=4)
    engine.generate([a], GREEDY)
    fed = engine.tokens_fed
    out = engine.generate([b], GREEDY)[0]
    assert engine.tokens_fed - fed == len(b) - 12 + (10 - 1)  # the 12 tokens of the 3 full blocks were not fed
    assert results(out) == results(Engine(model, block_size=4).generate([b], GREEDY)[0])
    engine.forget_prefixes()
    fed = engine.tokens_fed
    engine.generate([b], GREEDY)
    assert engine.tokens_fed - fed == len(b) + 10 - 1
    assert engine.pool.num_free == engine.pool.num_blocks
