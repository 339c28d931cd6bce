"""Image-text prompts on the engine (kiln.engine.vision) with the tiny Qwen3.5 image-text model (a Gated DeltaNet
layer and a gated attention layer, a one-block vision tower; full rotary with all three multimodal sections in
use): engine log-probs = the scoring forward bit for bit and the model's own forward within an fp32 bound (with
controls that break the bound), a request alone = among others, shared = unshared, the vision tower once per
distinct image, chunk boundaries inside an image's placeholders, the cache freed, prefix keys by image content,
bad inputs by name, and `Continuer` (what `kiln chat` and `kiln generate` call) on the engine."""

from __future__ import annotations

import pytest
import torch

from kiln.engine import Engine, SamplingParams, vision
from kiln.engine.cache import BlockPool
from kiln.engine.continuer import Continuer
from kiln.engine.scheduler import Request, Scheduler, Sequence
from kiln.errors import KilnError
from kiln.models.qwen3_next import TINY_HYBRID, TINY_HYBRID_MOE
from tests.engine.tiny import greedy_is_the_forwards_argmax, prompts, run_streams, tiny_model

IMG, START, END = 95, 97, 98  # the tiny config's image placeholder and vision start / end ids
EPS = torch.finfo(torch.float32).eps


def vision_model(family: str = "qwen3_5", **text):
    """Rotary over every head dim with sections (2, 3, 3) of its 8 frequencies (time, height and width all
    turn something; the release's 0.25 would leave the tiny head's 2 frequencies to time and height), weights
    at std 0.1 so images and positions move the log-probs well past fp32 rounding."""
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0, "mrope_section": [2, 3, 3]}
    base = TINY_HYBRID_MOE if family == "qwen3_5_moe" else TINY_HYBRID
    return tiny_model(family, text_config=dict(base, initializer_range=0.1, rope_parameters=rope, **text))


def image(model, h: int, w: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor([[1, h, w]])
    return {"pixel_values": torch.randn(h * w, model.visual.config.patch_dim, generator=g), "image_grid_thw": grid}


def joined(*images: dict) -> dict:
    return {"pixel_values": torch.cat([i["pixel_values"] for i in images]),
            "image_grid_thw": torch.cat([i["image_grid_thw"] for i in images])}


def marked(inputs: dict) -> list[list[int]]:
    """Each image's tokens: vision start, one placeholder per merged patch, vision end."""
    return [[START] + [IMG] * (t * h * w // 4) + [END] for t, h, w in inputs["image_grid_thw"].tolist()]


def prompt_with(images: dict, seed: int) -> list[int]:
    """Random text, then each image followed by more random text."""
    parts = prompts(len(images["image_grid_thw"]) + 1, 2, 6, seed=seed, vocab=90)
    out = parts[0]
    for marks, text in zip(marked(images), parts[1:]):
        out += marks + text
    return out


def model_logps(model, ids: list[int], inputs: dict, start: int) -> tuple[torch.Tensor, float]:
    """The model's own (training) forward, in train mode with autograd on, on ids with the images: the log-probs
    of ids[start:] and the largest |logit|."""
    model.train()
    try:
        logits = model(torch.tensor([ids]), **inputs).logits[0].float()
    finally:
        model.eval()
    lp = logits.log_softmax(-1)[start - 1:-1].gather(1, torch.tensor(ids[start:])[:, None])[:, 0]
    return lp.detach(), float(logits.detach().abs().max())


def fp32_bound(max_logit: float) -> float:
    """The engine against the model's forward: the same maths, other summation orders (16-row tiles against whole
    products, the recurrent gated delta rule against the chunked one, the tower per image against per batch).
    Each dot product of length K <= 96 (the patch width; text widths are 32-37) is off by at most K * eps of its
    magnitude; about 12 dependent products (tower block and merger, two text layers' projections and mixers,
    the head) add up, norms keep every stage at unit scale, so a logit is off by <= 12 * 96 * eps * max|logit|
    and a log-prob (a logit minus a log-sum-exp) by twice that."""
    return 2 * 12 * 96 * EPS * max(1.0, max_logit)


def sample(i: int, n: int = 1) -> SamplingParams:
    kinds = [{"temperature": 0.0}, {"temperature": 0.9, "top_k": 20}, {"temperature": 1.0, "top_p": 0.9}]
    return SamplingParams(max_tokens=3 + i % 4, logprobs=True, seed=50 + i, n=n, ignore_eos=True, **kinds[i % 3])


def results(completions) -> list[tuple[list[int], list[float]]]:
    return [(c.token_ids, c.logprobs) for c in completions]


@pytest.fixture(scope="module")
def model():
    return vision_model()


def test_engine_logps_equal_the_scoring_forward_and_near_the_models(model, monkeypatch):
    a, b = image(model, 4, 4, 1), image(model, 4, 8, 2)
    cases = [a, joined(a, b), joined(b, a)]
    ps = [prompt_with(x, 10 + k) for k, x in enumerate(cases)]
    outs = Engine(model, block_size=4, step_tokens=16).generate(ps, [sample(k) for k in range(3)], cases)
    scored = vision.token_logps(model, [p + o[0].token_ids for p, o in zip(ps, outs)], [len(p) for p in ps], cases,
                                block_size=4)
    for p, x, o, s in zip(ps, cases, outs, scored):
        engine = torch.tensor(o[0].logprobs)
        assert IMG not in o[0].token_ids  # (the model's forward would read a generated placeholder as an image)
        assert torch.equal(engine, s.detach())
        own, top = model_logps(model, p + o[0].token_ids, x, len(p))
        assert float((engine - own).abs().max()) < fp32_bound(top)
    # controls, each past the bound: another image at the same placeholders; text positions for the image rows
    p, x, toks = ps[1], cases[1], outs[1][0].token_ids
    own, top = model_logps(model, p + toks, x, len(p))
    other = vision.token_logps(model, [p + toks], [len(p)], [joined(a, image(model, 4, 8, 3))], block_size=4)[0].detach()
    assert float((other - own).abs().max()) > 10 * fp32_bound(top)
    monkeypatch.setattr(vision.ImagePrompt, "rope", lambda self, s, e: torch.arange(s, e).expand(3, -1))
    flat = vision.token_logps(model, [p + toks], [len(p)], [x], block_size=4)[0].detach()
    assert float((flat - own).abs().max()) > 10 * fp32_bound(top)


def test_moe_image_prompts_score_exactly():
    """qwen3_5_moe (every layer's MLP routed, one row per call): engine = scoring forward with images, and the
    model's forward within the bound."""
    model = vision_model("qwen3_5_moe")
    x = joined(image(model, 4, 4, 5), image(model, 4, 8, 6))
    p = prompt_with(x, 7)
    out = Engine(model, block_size=4, step_tokens=8).generate([p], sample(1), [x])[0][0]
    scored = vision.token_logps(model, [p + out.token_ids], [len(p)], [x], block_size=4)[0].detach()
    assert torch.equal(torch.tensor(out.logprobs), scored)
    own, top = model_logps(model, p + out.token_ids, x, len(p))
    assert float((scored - own).abs().max()) < fp32_bound(top)


def test_greedy_tokens_are_the_models_argmax(model):
    """Greedy with images: each token is the model's own forward's argmax, on prompts whose top two logits stay
    far apart (compared with the bound) at every step."""
    images = [joined(image(model, 4, 4, 20 + seed), image(model, 8, 4, 40 + seed)) for seed in range(6)]
    greedy_is_the_forwards_argmax(model, [prompt_with(x, 30 + seed) for seed, x in enumerate(images)], 6,
                                  images=images, block_size=4,
                                  min_gap=lambda logits: 2 * fp32_bound(float(logits.abs().max())))


def test_alone_equals_among_others(model):
    """16 requests (image prompts with shared and distinct images, text prompts) in small chunks and blocks, against
    each alone: tokens and log-probs bit for bit; the control (another seed) differs."""
    imgs = [image(model, 4, 4, 60 + k) for k in range(3)] + [image(model, 4, 8, 70)]
    cases = [None if k % 5 == 4 else joined(imgs[k % 4], imgs[(k + 1) % 4]) if k % 3 == 0 else imgs[k % 4]
             for k in range(16)]
    ps = [prompt_with(x, 80 + k) if x is not None else prompts(1, 3, 12, seed=80 + k)[0] for k, x in enumerate(cases)]
    params = [sample(k) for k in range(16)]
    crowd = Engine(model, block_size=4, max_seqs=16, step_tokens=24).generate(ps, params, cases)
    for k in (0, 3, 7, 9):
        alone = Engine(model, block_size=4).generate([ps[k]], params[k], [cases[k]])[0]
        assert results(alone) == results(crowd[k]), k
    other = SamplingParams(**{**params[7].__dict__, "seed": 7})  # (7 samples at temperature 0.9)
    assert results(Engine(model, block_size=4).generate([ps[7]], other, [cases[7]])[0]) != results(crowd[7])


def test_shared_equals_unshared_and_the_tower_runs_once_per_image(model):
    a, b = image(model, 4, 4, 90), image(model, 4, 8, 91)
    twice = joined(a, b, a)  # image a twice in one prompt
    p = prompt_with(twice, 92)
    engine = Engine(model, block_size=4)
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=5, n=3, logprobs=True, ignore_eos=True)
    out = engine.generate([p], params, [twice])[0]
    assert engine.image_features.tower_calls == 2  # a and b; the n = 3 completions share the prompt's features
    assert engine.tokens_fed == len(p) + 3 * (5 - 1)  # the prompt once
    single = Engine(model, block_size=4).generate([p], SamplingParams(**{**params.__dict__, "n": 1}), [twice])[0][0]
    assert results([single]) == results(out[:1])
    scored = vision.token_logps(model, [p + c.token_ids for c in out], [len(p)] * 3, [twice] * 3, block_size=4)
    for c, s in zip(out, scored):
        assert torch.equal(torch.tensor(c.logprobs), s)
    # a later request (a chat's next turn) showing a and b again runs no tower; a new image runs it once
    q = prompt_with(joined(b, a), 93)
    engine.generate([q, prompt_with(a, 94)], SamplingParams(max_tokens=2), [joined(b, a), a])
    assert engine.image_features.tower_calls == 2
    engine.generate([prompt_with(image(model, 4, 4, 95), 96)], SamplingParams(max_tokens=2),
                    [image(model, 4, 4, 95)])
    assert engine.image_features.tower_calls == 3
    engine.forget_prefixes()  # new weights: the features are made again
    engine.generate([q], SamplingParams(max_tokens=2), [joined(b, a)])
    assert engine.image_features.tower_calls == 5
    assert engine.pool.num_free == engine.pool.num_blocks


def test_chunk_boundaries_inside_image_tokens(model):
    """Prefill in chunks of 3, 5 and 7 tokens (boundaries inside both images' placeholders) = one chunk."""
    x = joined(image(model, 8, 4, 100), image(model, 4, 4, 101))
    p = prompt_with(x, 102)
    runs = [i for i, t in enumerate(p) if t == IMG]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3, logprobs=True, ignore_eos=True)
    whole = Engine(model, block_size=4, step_tokens=64).generate([p], params, [x])[0]
    for chunk in (3, 5, 7):
        cuts = range(chunk, len(p), chunk)
        assert sum(c in runs and c - 1 in runs for c in cuts) >= 2  # at least two cuts between two placeholders
        assert results(Engine(model, block_size=4, step_tokens=chunk).generate([p], params, [x])[0]) == results(whole)


def test_preemption_cancel_and_no_leak(model):
    """A pool too small for everyone (preemptions recompute the same bits), a cancel mid-stream, n = 3, and a
    feature cache smaller than the images (evicted features are made again): every block, every state slot and
    nothing else held comes back."""
    imgs = [image(model, 4, 4, 110 + k) for k in range(4)]
    cases = [imgs[k % 4] if k % 3 else joined(imgs[k % 4], imgs[(k + 2) % 4]) for k in range(8)]
    ps = [prompt_with(x, 120 + k) for k, x in enumerate(cases)]
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=k, n=3 if k == 6 else 1) for k in range(8)]
    engine = Engine(model, block_size=4, kv_blocks=24, max_seqs=8, step_tokens=64)
    engine.image_features.max_bytes = 4 * 32 * 4 * 2  # two images' features
    ids = [engine.add_request(p, sp, prompt_inputs=x) for p, sp, x in zip(ps, params, cases)]
    seen = run_streams(engine, cancel_at=3, cancel=ids[2])
    assert engine.scheduler.preemptions > 0 and engine.image_features.tower_calls > 4
    assert len(engine.image_features) <= 2
    assert engine.pool.num_free == engine.pool.num_blocks and not any(engine.pool.refs)
    assert len(engine.pool.free_states) == 8 and not engine.requests and not engine.scheduler.running
    for k in (0, 6, 7):
        for c in Engine(model, block_size=4).generate([ps[k]], params[k], [cases[k]])[0]:
            assert seen[(ids[k], c.index)] == c.token_ids, (k, c.index)


def test_prefix_keys_hold_the_images():
    """The scheduler's content keys on a pool that remembers prefixes: the same tokens with another image share
    only the blocks before the image's placeholders; with the same image (its pixels equal, another tensor) all."""
    model = vision_model()
    pool = BlockPool(16, 4, [((1, 1), (1, 1))], torch.float32, torch.device("cpu"))
    sched = Scheduler(pool, 4, 64)
    a, b = image(model, 4, 4, 130), image(model, 4, 4, 131)
    tokens = [5, 6, 7, 8, 9] + marked(a)[0] + [10, 11, 12, 13, 14]  # the image's placeholders in blocks 1 and 2
    cache = vision.ImageFeatures()

    def seq(x: dict) -> Sequence:
        r = Request("r", list(tokens), SamplingParams(), 0, images=vision.prompt_images(model, tokens, x, cache))
        return Sequence(r, 0, list(tokens))

    first = seq(a)
    for _ in range(len(tokens) // 4):
        first.table.append(pool.allocate())
    first.computed = len(tokens)
    sched.remember(first)
    assert len(pool.known) == 4
    same, other = seq({k: v.clone() for k, v in a.items()}), seq(b)
    sched._start(same)
    sched._start(other)
    assert same.table == first.table[:3] and other.table == first.table[:1]  # (the last token is always run)
    assert cache.tower_calls == 2


def test_bad_image_inputs_are_refused_by_name(model):
    a = image(model, 4, 4, 140)
    p = prompt_with(a, 141)
    engine = Engine(model)
    cases = [({**a, "pixel_mask": torch.ones(1)}, "pixel_mask"),
             ({"pixel_values": a["pixel_values"][:-1], "image_grid_thw": a["image_grid_thw"]}, "pixel_values has shape"),
             ({"pixel_values": a["pixel_values"].tolist(), "image_grid_thw": a["image_grid_thw"]}, "needs tensors"),
             (joined(a, a), "image_grid_thw has 2 images"),
             ({**a, "mm_token_type_ids": torch.zeros(1, len(p), dtype=torch.long)}, "mm_token_type_ids")]
    for inputs, message in cases:
        with pytest.raises(KilnError, match=message):
            engine.add_request(p, SamplingParams(), prompt_inputs=inputs)
    with pytest.raises(KilnError, match="an image run of 3 placeholder tokens"):
        engine.add_request(p[:p.index(IMG) + 3] + [END], SamplingParams(), prompt_inputs=a)
    assert not engine.requests and engine.image_features.tower_calls == 0
    # no image at all (an image-text chat's text-only turn): the text prompt's result; placeholders without images
    text = prompts(1, 4, 8, seed=142)[0]
    none = {"pixel_values": torch.zeros(0, model.visual.config.patch_dim), "image_grid_thw": torch.zeros(0, 3)}
    greedy = SamplingParams(max_tokens=3, temperature=0.0, logprobs=True)
    assert results(engine.generate([text], greedy, [none])[0]) == results(engine.generate([text], greedy)[0])
    with pytest.raises(KilnError, match="more image runs"):
        engine.add_request(p, SamplingParams(), prompt_inputs=none)
    with pytest.raises(KilnError, match="'qwen3' takes no images"):
        Engine(tiny_model("qwen3")).add_request(p, SamplingParams(), prompt_inputs=a)


def test_continuer_runs_image_prompts_on_the_engine(model):
    """What `kiln chat` and `kiln generate` call: image prompts go through the engine (one kept, so a chat's next
    turn, re-sending its images, runs no tower) and give the engine's greedy tokens."""
    a, b = image(model, 4, 4, 150), image(model, 4, 8, 151)
    run = Continuer(model, 5, max_seqs=1)
    assert run.engine is not None
    first = prompt_with(a, 152)
    got = run(first, a)
    want = Engine(model).generate([first], SamplingParams(max_tokens=5, temperature=0.0), [a])[0][0].token_ids
    assert got == want and run.engine.image_features.tower_calls == 1
    turn = first + got + prompt_with(b, 153)
    run(turn, joined(a, b))
    assert run.engine.image_features.tower_calls == 2
