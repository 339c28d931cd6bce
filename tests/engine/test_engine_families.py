"""The engine on every decoder kind past the attention decoders (tests/engine/test_engine.py has those): per
family, batch invariance with a control that fails, engine log-probs = the scoring forward bit for bit (and the
model's own forward to fp32 rounding), shared prompts equal unshared, greedy = the old loop, no block leak."""

from __future__ import annotations

import pytest
import torch

from kiln.engine import Engine, SamplingParams, token_logps
from kiln.models.common.lora import LoraConfig, apply_lora
from tests.engine.tiny import (
    generate_and_score,
    greedy_is_the_forwards_argmax,
    preempt_cancel_and_count,
    prompts,
    tiny_model,
    train_logps,
)

FAMILIES = ["deepseek_v3", "deepseek_v32", "glm_moe_dsa", "qwen3_next", "qwen3_5_text", "mamba"]
STATEFUL = ["qwen3_next", "qwen3_5_text", "mamba"]
# The sparse families' tiny indexers have 2 heads: a key whose q . k is negative on both scores exactly 0 (relu),
# so a query often has equal scores at its k-th place, where the model's torch.topk picks in no stated order
# (the engine: the earlier key). The comparisons with the model's own forward use 8 index heads (such ties then
# need 8 negative products, and `no_boundary_ties` checks none occurs); the engine's own checks keep the ties.
NO_TIES = {"deepseek_v32": {"index_n_heads": 8}, "glm_moe_dsa": {"index_n_heads": 8}}


def no_boundary_ties(model, seq: list[int]) -> bool:
    """Whether no query of `seq` has equal index scores at its k-th and (k+1)-th keys (in any indexer layer)."""
    from kiln.models.common import dsa

    seen, scores = [], dsa.Indexer.scores

    def keep(self, *args, **kwargs):
        out = scores(self, *args, **kwargs)
        seen.append((out[0], self.topk))
        return out

    dsa.Indexer.scores = keep
    try:
        with torch.no_grad():
            model(torch.tensor([seq]))
    finally:
        dsa.Indexer.scores = scores
    return all(bool((s.sort(-1, descending=True).values[k:, k - 1] != s.sort(-1, descending=True).values[k:, k]
                     ).all()) for s, k in seen if s.shape[-1] > k)


def mixed(count: int) -> list[SamplingParams]:
    kinds = [{"temperature": 0.0}, {"temperature": 0.9, "top_k": 20}, {"temperature": 1.0, "top_p": 0.9}]
    return [SamplingParams(max_tokens=2 + i % 4, logprobs=True, seed=100 + i, **kinds[i % len(kinds)])
            for i in range(count)]


def results(completions) -> list[tuple[list[int], list[float]]]:
    return [(c.token_ids, c.logprobs) for c in completions]


@pytest.mark.parametrize("family", FAMILIES)
def test_alone_equals_among_31_others(family):
    model = tiny_model(family)
    ps, params = prompts(32, 1, 16, seed=2), mixed(32)
    crowd = Engine(model, block_size=4, max_seqs=32, step_tokens=48).generate(ps, params)
    for i in (4, 13):
        assert results(Engine(model, block_size=4).generate([ps[i]], params[i])[0]) == results(crowd[i]), i
    other = SamplingParams(**{**params[4].__dict__, "seed": 7})  # the control: the comparison can fail
    assert results(Engine(model, block_size=4).generate([ps[4]], other)[0]) != results(crowd[4])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("ties", [True, False])
def test_engine_logps_equal_scoring_forward_and_near_the_models(family, ties):
    if not ties and family not in NO_TIES:
        pytest.skip("no indexer: nothing to tie")
    model = tiny_model(family, **({} if ties else NO_TIES[family]))
    for p, c, s in generate_and_score(model, prompts(4, 2, 24, seed=3), mixed(4)):
        engine = torch.tensor(c.logprobs)
        assert float((engine - s.detach()).abs().max()) == 0.0
        if ties and family in NO_TIES:
            continue  # the model's own choice among equal scores is not stated (NO_TIES)
        assert no_boundary_ties(model, p + c.token_ids)
        # the model's forward sums in another order: fp32 rounding through 2 layers of width 32, a 99-way softmax
        assert float((engine - train_logps(model, p, c.token_ids)).abs().max()) < 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_shared_prompt_equals_unshared(family):
    model = tiny_model(family)
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
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_is_the_forwards_argmax(family):
    """Greedy tokens = the argmax of the model's own forward (tiny.greedy_is_the_forwards_argmax)."""
    greedy_is_the_forwards_argmax(tiny_model(family, **NO_TIES.get(family, {})), prompts(5, 3, 16, seed=8), 8,
                                  no_boundary_ties)


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_cancel_and_no_leak(family):
    """A pool too small for everyone (preemptions recompute the same bits), a cancel mid-stream, n = 3: every
    block (and every recurrent-state slot) comes back."""
    model = tiny_model(family)
    preempt_cancel_and_count(model)


def test_latent_cache_holds_latent_and_rope_key_per_token():
    """deepseek_v3: each layer's slot is kv_lora_rank + qk_rope_head_dim numbers, not per-head keys/values."""
    model = tiny_model("deepseek_v3")
    c = model.config
    engine = Engine(model, block_size=4, kv_blocks=3)
    assert engine.pool.keys[0].shape == (3, 4, 1, c.kv_lora_rank)
    assert engine.pool.values[0].shape == (3, 4, 1, c.qk_rope_head_dim)
    per_head = 2 * c.num_attention_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim)
    assert engine.pool.bytes_per_block() == c.num_hidden_layers * 4 * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    assert c.kv_lora_rank + c.qk_rope_head_dim < per_head


def test_latent_attention_under_lora_on_kv_b_proj():
    """A LoRA-wrapped kv_b_proj (its effective weight read through the identity): engine = scoring forward, and
    near the model's forward with the adapter's update nonzero."""
    model = tiny_model("deepseek_v3")
    apply_lora(model, LoraConfig(r=4, alpha=8, targets=["kv_b_proj", "o_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    model.eval()
    p = prompts(1, 9, 10, seed=12)[0]
    out = Engine(model, block_size=4).generate([p], SamplingParams(max_tokens=6, temperature=0.0, logprobs=True))[0][0]
    scored = token_logps(model, [p + out.token_ids], [len(p)], block_size=4)[0]
    assert torch.equal(torch.tensor(out.logprobs), scored.detach())
    assert float((torch.tensor(out.logprobs) - train_logps(model, p, out.token_ids)).abs().max()) < 1e-4
    bare = Engine(tiny_model("deepseek_v3"), block_size=4).generate(
        [p], SamplingParams(max_tokens=6, temperature=0.0, logprobs=True))[0][0]
    assert bare.logprobs != out.logprobs  # the adapter is read (the control)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_sparse_attention_caches_index_keys_and_its_choice_matters(family):
    """An indexer layer's slot holds the rope key and the indexer's key; a GLM-5 shared layer's the rope key
    alone. The control: with index_topk past every sequence (dense attention) the log-probs change."""
    model = tiny_model(family)
    c = model.config
    engine = Engine(model, block_size=4, kv_blocks=2)
    kinds = [c.sparse_attention(i) for i in range(c.num_hidden_layers)]
    assert [tuple(v.shape[2:]) for v in engine.pool.values] == [
        (1, c.qk_rope_head_dim + (c.index_head_dim if k == "full" else 0)) for k in kinds]
    seq = prompts(1, 20, 21, seed=13)[0]
    sparse = token_logps(model, [seq], [1], block_size=4)[0]
    for layer in model.model.layers:
        if layer.self_attn.sparse == "full":
            layer.self_attn.indexer.topk = 64
    dense = token_logps(model, [seq], [1], block_size=4)[0]
    assert not torch.equal(sparse, dense)
    assert torch.equal(sparse[:c.index_topk], dense[:c.index_topk])  # rows with <= topk keys: all kept


def test_top_keys_breaks_ties_toward_the_earlier_key_whatever_the_padding():
    from kiln.engine.exact import top_keys

    scores = torch.tensor([[0.0, 2.0, 0.0, 0.0, 1.0, 0.0, 5.0, float("nan")]])
    pos = torch.tensor([5])
    assert top_keys(scores, pos, 3).tolist() == [[True, True, False, False, True, False, False, False]]
    assert torch.equal(top_keys(scores[:, :6], pos, 3), top_keys(scores, pos, 3)[:, :6])
    assert top_keys(scores, torch.tensor([1]), 3)[0, :2].all()  # fewer keys than k: every one kept


@pytest.mark.parametrize("family", STATEFUL)
def test_recurrent_state_slots_and_prefix_reuse(family):
    """A Gated DeltaNet or Mamba layer's state lives in a slot per sequence: lent at the start, one per
    completion after the fork, all back at the end. A later prompt with the same start starts from the state
    kept at the earlier prompt's last full block (engfeat) and gives what it gives alone."""
    model = tiny_model(family)
    engine = Engine(model, block_size=4, max_seqs=4)
    layer = model.model.layers[0]
    if hasattr(layer, "linear_attn"):
        m = layer.linear_attn
        shape = (m.num_v_heads, m.head_k_dim, m.head_v_dim)
    else:
        shape = layer.mixer.dims[:2]  # (intermediate, state_size)
    assert engine.pool.states[0][1].shape == (4, *shape) and engine.pool.states[0][1].dtype == torch.float32
    assert engine.pool.keys[0].numel() == 0  # nothing per token in a recurrent layer
    system = prompts(1, 13, 14, seed=15)[0]
    engine.add_request(system + [5, 6], SamplingParams(max_tokens=4, temperature=1.0, seed=2, n=3))
    engine.step()
    assert len(engine.pool.free_states) == 1  # the three completions hold one slot each
    while engine.has_unfinished():
        engine.step()
    assert len(engine.pool.free_states) == 4
    fed = engine.tokens_fed
    b = system + [7, 8, 9]
    out = engine.generate([b], SamplingParams(max_tokens=5, temperature=0.0, logprobs=True))[0]
    # engfeat: the first prompt's state at its last full block (token 12) was kept (kiln.engine.prefix_state)
    assert engine.tokens_fed - fed == len(b) - 12 + 5 - 1
    assert results(out) == results(Engine(model, block_size=4).generate(
        [b], SamplingParams(max_tokens=5, temperature=0.0, logprobs=True))[0])


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_5_text", "mamba"])
def test_scoring_forward_is_differentiable(family):
    model = tiny_model(family)
    lp = token_logps(model, [prompts(1, 12, 13, seed=5)[0]], [4])[0]
    lp.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads) and any(float(g.abs().max()) > 0 for g in grads)


@pytest.mark.parametrize("family", STATEFUL)
def test_a_forked_request_with_state_is_preempted_and_recomputes(family, monkeypatch):
    """n = 3 completions preempted after the fork (each holds its own state): each recomputes its whole sequence
    from the first token in blocks and a state slot of its own, and gives what it gives alone."""
    from kiln.engine.scheduler import Scheduler

    victims = []
    preempt = Scheduler.preempt
    monkeypatch.setattr(Scheduler, "preempt", lambda self, r: (victims.append(r.forked), preempt(self, r))[1])
    model = tiny_model(family)
    a, b = prompts(2, 6, 9, seed=21)
    pa = SamplingParams(max_tokens=20, temperature=0.0, logprobs=True)
    pb = SamplingParams(max_tokens=12, temperature=1.0, seed=4, n=3, logprobs=True)
    engine = Engine(model, block_size=4, kv_blocks=15, max_seqs=4, step_tokens=64)
    out = engine.generate([a, b], [pa, pb])
    assert victims == [True]  # the n = 3 request, after its fork
    assert len(engine.pool.free_states) == 4 and engine.pool.num_free == 15
    monkeypatch.setattr(Scheduler, "preempt", preempt)
    assert results(out[1]) == results(Engine(model, block_size=4).generate([b], pb)[0])


@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe"])
def test_the_other_hybrids_score_exactly(family):
    """The hybrid runner's other families (Qwen3.5-MoE text; the image-text Qwen3.5 models on text prompts, their
    multimodal rotary at text positions): engine = scoring forward, and the model's forward to fp32 rounding."""
    model = tiny_model(family)
    for p, c, s in generate_and_score(model, prompts(2, 3, 14, seed=16), mixed(2)):
        engine = torch.tensor(c.logprobs)
        assert torch.equal(engine, s.detach())
        assert float((engine - train_logps(model, p, c.token_ids)).abs().max()) < 1e-4
