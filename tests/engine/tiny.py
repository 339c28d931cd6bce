"""Tiny causal LMs built from a family's tiny config in memory, and prompts, for the engine tests (not a test module)."""

from __future__ import annotations

import torch

from kiln.models.auto import REGISTRY
from kiln.models.tasks import CAUSAL_LM


def tiny_model(model_type: str = "qwen3", seed: int = 0, **overrides):
    """The family's tiny causal LM with seeded random weights, in eval mode, EOS off unless overridden (random
    tiny models emit the EOS id early, which would end the streams these tests compare)."""
    fam = REGISTRY[model_type]
    raw = dict(fam.tiny.config)
    raw.update(overrides)
    config = fam.config_cls.from_dict(raw, source=f"{model_type} tiny config")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = fam.build(config, CAUSAL_LM)
        model.init_weights()
    if "eos_token_id" not in overrides:
        model.config.eos_token_id = None
    return model.eval()


def prompts(count: int, low: int, high: int, seed: int = 1, vocab: int = 99) -> list[list[int]]:
    """`count` prompts of random lengths in [low, high) over ids 4..vocab-1."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g)
    return [torch.randint(4, vocab, (int(n),), generator=g).tolist() for n in lengths]


def generate_and_score(model, ps: list[list[int]], params) -> list[tuple[list[int], object, torch.Tensor]]:
    """Each prompt through the engine (blocks of 4, chunks of 16) and its first completion through the scoring
    forward: (prompt, completion, scored log-probs)."""
    from kiln.engine import Engine, token_logps

    outs = Engine(model, block_size=4, step_tokens=16).generate(ps, params)
    scored = token_logps(model, [p + c[0].token_ids for p, c in zip(ps, outs)], [len(p) for p in ps], block_size=4)
    return [(p, c[0], s) for p, c, s in zip(ps, outs, scored)]


def train_logps(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The model's own forward (ForCausalLM.token_logps, batched SDPA) on prompt + tokens: the tokens' log-probs."""
    ids = torch.tensor([prompt + tokens])
    targets = torch.full_like(ids, -100)
    targets[0, len(prompt) - 1:-1] = ids[0, len(prompt):]
    with torch.no_grad():
        return model.token_logps(ids, None, targets)[0, len(prompt) - 1:-1]


def run_streams(engine, cancel_at: int | None = None, cancel: str | None = None) -> dict[tuple[str, int], list[int]]:
    """Step `engine` until nothing is left (cancelling request `cancel` after step `cancel_at`): the tokens each
    (request id, completion index) streamed. (engvis)"""
    seen: dict[tuple[str, int], list[int]] = {}
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            seen.setdefault((o.request_id, o.index), []).extend(o.token_ids)
        steps += 1
        if steps == cancel_at and cancel is not None:
            engine.cancel(cancel)
    return seen


def preempt_cancel_and_count(model):
    """A pool too small for everyone (preemptions recompute the same bits), a cancel mid-stream, n = 3: every
    block, and each recurrent-state slot where the family keeps them, comes back; the finished requests stream
    what each alone gives. Returns the engine."""
    from kiln.engine import Engine, SamplingParams

    ps = prompts(8, 8, 16, seed=11)
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=i, n=3 if i == 6 else 1) for i in range(8)]
    engine = Engine(model, block_size=4, kv_blocks=16, max_seqs=8, step_tokens=64)
    ids = [engine.add_request(p, sp) for p, sp in zip(ps, params)]
    seen = run_streams(engine, cancel_at=3, cancel=ids[2])
    assert engine.scheduler.preemptions > 0
    assert engine.pool.num_free == engine.pool.num_blocks and not any(engine.pool.refs)
    assert len(engine.pool.free_states) == (8 if engine.pool.has_states else 0)
    for i in (0, 6, 7):
        for c in Engine(model, block_size=4).generate([ps[i]], params[i])[0]:
            assert seen[(ids[i], c.index)] == c.token_ids, (i, c.index)
    return engine


def greedy_is_the_forwards_argmax(model, ps: list[list[int]], max_tokens: int, no_ties=None, *, images=None,
                                  min_gap=None, block_size: int | None = None) -> None:
    """The engine's greedy tokens are the argmax of the model's own training forward over the same tokens, on
    two prompts whose top two logits stay far apart at every step compared with the two orders' fp32 rounding
    (`min_gap(logits)`, default 1e-4 against ~1e-6; a near tie, or a top-k tie `no_ties(model, seq)` finds, lets
    either order pick either token). `images[i]`: prompt i's image inputs (the engine's and the forward's). The
    model's `generate` runs on the engine now, so the forward is the independent side."""
    import torch

    from kiln.engine import Engine, SamplingParams

    engine_kw = {} if block_size is None else {"block_size": block_size}
    checked = 0
    for i, p in enumerate(ps):
        x = None if images is None else images[i]
        extra = () if x is None else ([x],)
        out = Engine(model, **engine_kw).generate([p], SamplingParams(max_tokens=max_tokens, temperature=0.0),
                                                  *extra)[0][0]
        with torch.no_grad():
            logits = model(torch.tensor([p + out.token_ids]), **(x or {})).logits[0, len(p) - 1:-1].float()
        top2 = logits.topk(2, -1).values
        gap = 1e-4 if min_gap is None else min_gap(logits)
        if float((top2[:, 0] - top2[:, 1]).min()) < gap or (no_ties is not None and not no_ties(model, p + out.token_ids)):
            continue
        assert logits.argmax(-1).tolist() == out.token_ids
        checked += 1
        if checked == 2:
            break
    assert checked == 2
