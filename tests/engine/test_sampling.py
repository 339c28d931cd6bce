"""kiln.engine.sampling against direct numpy implementations of each option's definition: penalties, greedy,
top-k / top-p / min-p (the kept set and the distribution of many seeded draws), log-probs; seeds and streams;
batch invariance (a row alone vs among 31 others with other params, bit for bit)."""

from __future__ import annotations

from statistics import NormalDist

import numpy as np
import pytest
import torch

from kiln.engine.params import SamplingParams as SP
from kiln.engine.sampling import (
    _first_argmax,
    _mass_threshold,
    _penalize,
    _radix_threshold,
    _top,
    request_generator,
    sample,
)
from kiln.errors import KilnError
from kiln.models.generation import inverse_cdf

# ---- direct implementations ----------------------------------------------------------------------------------


def ref_penalize(x: np.ndarray, p: SP, prompt: list[int], output: list[int]) -> np.ndarray:
    """HF's repetition penalty over prompt + output, then OpenAI's frequency / presence over output, in float32."""
    x = x.astype(np.float32).copy()
    for t in set(prompt) | set(output):
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / np.float32(p.repetition_penalty) if x[t] > 0 else x[t] * np.float32(p.repetition_penalty)
    for t in set(output):
        c = output.count(t)
        x[t] = np.float32(x[t] - np.float32(p.frequency_penalty) * np.float32(c)) - np.float32(p.presence_penalty)
    return x


def ref_distribution(x: np.ndarray, p: SP) -> np.ndarray:
    """The distribution a row is drawn from, in float64: softmax(x / T), then top-k (the k largest), top-p (the
    smallest most-likely-first set of the top-k survivors whose renormalized mass reaches top_p), min-p
    (probability >= min_p * the largest), renormalized."""
    s = x.astype(np.float64) / p.temperature
    q = np.exp(s - s.max())
    q /= q.sum()
    keep = np.ones_like(q, dtype=bool)
    order = np.argsort(-q, kind="stable")
    if 0 < p.top_k < len(q):
        keep[:] = False
        keep[order[: p.top_k]] = True
    if p.top_p < 1.0:
        mass = q[keep].sum()
        head, acc = np.zeros_like(keep), 0.0
        for i in order:
            if not keep[i] or acc >= p.top_p * mass:
                continue
            head[i], acc = True, acc + q[i]
        keep = head
    keep &= q >= p.min_p * q.max()
    out = np.where(keep, q, 0.0)
    return out / out.sum()


def log_softmax(x: np.ndarray) -> np.ndarray:
    s = x.astype(np.float64)
    return s - s.max() - np.log(np.exp(s - s.max()).sum())


def draws(x: torch.Tensor, p: SP, n: int, seed: int = 0, rows: int = 500) -> np.ndarray:
    """n draws of one row: calls on `rows` copies of it, each row with its own generator (one draw per call)."""
    rows = min(rows, n)
    gens = [request_generator(seed, i, "cpu") for i in range(rows)]
    xs = x.expand(rows, -1).contiguous()
    out = [sample(xs, [p] * rows, [[]] * rows, [[]] * rows, gens).tokens for _ in range(-(-n // rows))]
    return torch.cat(out)[:n].numpy()


# ---- penalties, greedy ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [SP(repetition_penalty=1.7), SP(repetition_penalty=0.6), SP(presence_penalty=1.5),
                               SP(frequency_penalty=0.8), SP(frequency_penalty=-0.5, presence_penalty=-1.0),
                               SP(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.25)])
def test_penalties_match_direct_implementation(p):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 40, generator=g) * 3
    prompts, outputs = [[1, 2, 3, 3], [], [5]], [[3, 7, 7, 7, 9], [0, 0], []]
    got = _penalize(x, [p] * 3, prompts, outputs)
    for b in range(3):
        want = ref_penalize(x[b].numpy(), p, prompts[b], outputs[b])
        np.testing.assert_allclose(got[b].numpy(), want, rtol=0, atol=1e-6)
    # the control: a penalty changes the seen tokens' logits (both signs)
    assert not torch.equal(got, x)


def test_no_penalty_returns_the_logits_untouched():
    x = torch.randn(2, 10)
    assert _penalize(x, [SP(), SP(temperature=0.0)], [[1], [2]], [[3], [4]]) is x


def test_greedy_is_the_argmax_of_the_penalized_logits():
    x = torch.tensor([[0.0, 5.0, 4.0, -1.0], [2.0, -3.0, 1.0, 1.9]])
    out = sample(x, [SP(temperature=0.0)] * 2, [[], []], [[], []], [None, None])
    assert out.tokens.tolist() == [1, 0]
    # repetition 2 on token 1 (5 -> 2.5) makes 2 the argmax; presence 0.5 on token 0 (2 -> 1.5) makes 3 it
    out = sample(x, [SP(temperature=0.0, repetition_penalty=2.0), SP(temperature=0.0, presence_penalty=0.5)],
                 [[1], [0]], [[], [0]], [None, None])
    assert out.tokens.tolist() == [2, 3]


# ---- the filters: the kept set and the distribution of the draws ------------------------------------------------

FILTERS = [SP(), SP(temperature=0.6), SP(temperature=1.8), SP(top_k=7), SP(top_p=0.6), SP(top_p=0.9, temperature=1.4),
           SP(min_p=0.2), SP(top_k=12, top_p=0.75), SP(top_k=20, top_p=0.8, min_p=0.1, temperature=0.8)]


@pytest.mark.parametrize("p", FILTERS, ids=lambda p: ",".join(
    f"{f}={getattr(p, f)}" for f in ("temperature", "top_k", "top_p", "min_p") if getattr(p, f) != getattr(SP(), f)))
def test_draws_follow_the_filtered_distribution(p):
    V, n = 48, 20000
    x = torch.randn(1, V, generator=torch.Generator().manual_seed(3)) * 1.5
    want = ref_distribution(x[0].numpy(), p)
    support = want > 0
    if p.top_p < 1:  # the cut must not sit within float32 rounding of a boundary, or the reference is moot
        q = ref_distribution(x[0].numpy(), SP(temperature=p.temperature, top_k=p.top_k))
        head = np.sort(q)[::-1].cumsum()
        assert np.abs(head - p.top_p).min() > 1e-4
    got = np.bincount(draws(x, p, n), minlength=V)
    assert not got[~support].any(), "a token outside the kept set was drawn"
    # a kept token expected more than 80 times shows up (P(missing) < e^-80)
    assert got[want * n > 80].all()
    assert chi_square(got, want, n) < chi_square_bound(got, want, n), p


def chi_square(got: np.ndarray, want: np.ndarray, n: int) -> float:
    """Pearson's X^2 over the tokens expected >= 5 times, the rest of the kept ones pooled in one bin."""
    big, small = want * n >= 5, (want > 0) & (want * n < 5)
    obs, exp = list(got[big]), list(want[big] * n)
    if want[small].sum() * n >= 5:
        obs.append(got[small].sum())
        exp.append(want[small].sum() * n)
    obs, exp = np.array(obs, dtype=np.float64), np.array(exp)
    return float(((obs - exp) ** 2 / exp).sum())


def chi_square_bound(got: np.ndarray, want: np.ndarray, n: int, tail: float = 1e-6) -> float:
    """X^2 exceeds this with probability ~`tail` when the draws follow `want`: the chi-square quantile with one
    degree of freedom per bin (one more than the usual bins - 1: a small pooled bin may be left out), by
    Wilson-Hilferty's cube-root normal approximation (a few percent off this far out), plus 10% headroom."""
    k = int((want * n >= 5).sum()) + 1
    z = NormalDist().inv_cdf(1 - tail)
    return 1.1 * k * (1 - 2 / (9 * k) + z * (2 / (9 * k)) ** 0.5) ** 3


def test_the_chi_square_check_can_fail():
    p, V, n = SP(top_p=0.9), 48, 20000
    x = torch.randn(1, V, generator=torch.Generator().manual_seed(3)) * 1.5
    got = np.bincount(draws(x, SP(top_p=0.9, temperature=1.15), n), minlength=V)  # a slightly different T
    want = ref_distribution(x[0].numpy(), p)
    assert chi_square(got, want, n) > chi_square_bound(got, want, n)


def test_flat_rows_fall_back_to_the_whole_vocabulary():
    # uniform logits: every token ties, so no candidate list short of the whole vocabulary decides top-p;
    # ties are kept, so top-p over equal probabilities keeps them all (as top-k keeps ties at its cut)
    V, n = 30, 6000
    x = torch.zeros(1, V)
    got = np.bincount(draws(x, SP(top_p=0.5), n), minlength=V)
    assert (got > 0).all()
    # a tiny-probability tail: top_p so close to 1 that tokens below e^-20 of the max are in the head
    x = torch.tensor([[0.0] + [-25.0] * 9])
    p = SP(top_p=1 - 1e-12)
    assert (np.bincount(draws(x, p, 200), minlength=10)[1:] == 0).all()  # they are kept but nearly never drawn
    assert ref_distribution(x[0].numpy(), p)[1:].min() > 0
    x = torch.tensor([[0.0] + [-25.0] * 9 + [-float("inf")] * 3])
    assert set(draws(x, SP(top_k=12, top_p=0.999999), 50)) == {0}


def test_a_zero_probability_token_is_never_drawn():
    x = torch.full((1, 2100), -float("inf"))
    x[0, [3, 1500, 2099]] = torch.tensor([0.0, 1.0, -0.5])
    for p in (SP(), SP(top_k=5), SP(top_p=0.99), SP(min_p=0.01)):
        assert set(draws(x, p, 500)) == {3, 1500, 2099}
    # u at its largest: the last token of positive probability, never a zero after it
    q = torch.tensor([[0.0, 0.25, 0.0, 0.5, 0.25, 0.0, 0.0]])
    u = torch.tensor([1 - 2.0**-53], dtype=torch.float64)
    for block in (1, 2, 3, 7):
        assert inverse_cdf(q, block=block, u=u).item() == 4
        assert inverse_cdf(q, block=block, u=torch.zeros(1, dtype=torch.float64)).item() == 1


def test_a_vocabulary_of_many_blocks():
    # 5,000 tokens = 4 blocks of 1,024 and a short one; the likely tokens scattered over all of them
    V, n = 5000, 1000
    g = torch.Generator().manual_seed(8)
    x = torch.randn(1, V, generator=g) - 30
    spots = torch.randperm(V, generator=g)[:24]
    spots[0] = V - 1  # the short block's last column
    x[0, spots] = torch.randn(24, generator=g) * 0.7
    for p in (SP(top_p=0.7), SP(top_k=9), SP(min_p=0.3), SP(top_k=15, top_p=0.9, temperature=0.8)):
        want = ref_distribution(x[0].numpy(), p)
        got = np.bincount(draws(x, p, n, rows=200), minlength=V)
        assert not got[want == 0].any(), p
        assert chi_square(got, want, n) < chi_square_bound(got, want, n), p


@pytest.mark.parametrize("V", [7, 1024, 3000, 4097])
def test_first_argmax_and_top_match_torch(V):
    g = torch.Generator().manual_seed(V)
    x = torch.randint(-3, 3, (6, V), generator=g).float()  # many ties
    x[1] = -float("inf")
    x[2, : V - 2] = -float("inf")  # two finite values, the rest -inf
    x[3, V - 1] = 10.0  # the maximum in the last (maybe short) block
    x[4:] = torch.randn(2, V, generator=g)  # no ties
    assert torch.equal(_first_argmax(x), x.argmax(-1))
    vals, ids = _top(x, 20)
    k = min(20, V)
    for b in range(6):
        ref = np.lexsort((np.arange(V), -x[b].numpy()))[:k]  # by value, then by column
        assert vals[b].tolist() == x[b, ref].tolist()  # the k largest values, largest first
        assert torch.equal(vals[b], x[b, ids[b]]) and (ids[b] < V).all() and len(set(ids[b].tolist())) == k
        for v in set(vals[b].tolist()):  # equal values by column
            cols = ids[b][vals[b] == v].tolist()
            assert cols == sorted(cols)
        if b >= 4:  # which of several equal values make the list is topk's choice; without ties, the columns
            assert ids[b].tolist() == ref.tolist()


@pytest.mark.parametrize("N", [300, 5000, 40000])
def test_top_p_cut_radix_and_sort_match_the_definition(N):
    g = torch.Generator().manual_seed(N)
    x = torch.randn(12, N, generator=g) * torch.tensor([0.5, 1, 2, 4, 8, 1, 1, 3, 3, 0.1, 2, 6])[:, None]
    x[5] = torch.randint(0, 4, (N,), generator=g).float()  # ties everywhere
    x[6, N // 3:] = -float("inf")  # zeros
    w = x.softmax(-1)
    frac = torch.tensor([0.1, 0.5, 0.9, 0.95, 0.99, 0.6, 0.7, 0.3, 0.999, 0.5, 0.2, 0.8], dtype=torch.float64)
    got = {"radix": _radix_threshold(w, frac), "default": _mass_threshold(w, frac)}
    exact = 0
    for c in range(12):
        q = w[c].double().numpy()
        vals = np.sort(q)[::-1]
        cum = np.cumsum(vals)
        target = frac[c].item() * cum[-1]
        want = vals[min(int((cum < target).sum()), N - 1)]  # the first value whose head reaches the target
        # where the target sits within float32 rounding of a head's mass (the radix sums buckets in float32), either
        # neighbour is right
        near = np.abs(cum - target).min() < 2e-6 * cum[-1]
        for name, v in got.items():
            assert v[c].item() == np.float32(want) or near, (name, c, v[c].item(), want)
        exact += not near
    assert exact >= 9  # the check above is not vacuous


# ---- log-probs ---------------------------------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_the_raw_logits():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 300, generator=g) * 4
    params = [SP(logprobs=True, top_logprobs=5, temperature=0.5, repetition_penalty=1.5),
              SP(logprobs=True), SP(), SP(logprobs=True, top_logprobs=20, top_k=3)]
    out = sample(x, params, [[1, 2]] * 4, [[3]] * 4, [request_generator(0, i, "cpu") for i in range(4)])
    full = x.log_softmax(-1)
    for b in (0, 1, 3):
        t = out.tokens[b]
        assert out.logprobs[b] == full[b, t]  # the training forward's formula, bit for bit
        assert abs(out.logprobs[b].item() - log_softmax(x[b].numpy())[t]) < 1e-5
    assert out.logprobs[2].isnan()
    assert out.top_ids.shape == (4, 20)
    for b, n in ((0, 5), (3, 20)):
        ref = np.argsort(-log_softmax(x[b].numpy()), kind="stable")[:n]
        assert out.top_ids[b, :n].tolist() == ref.tolist()
        assert torch.equal(out.top_logprobs[b, :n], full[b, out.top_ids[b, :n]])
        assert (out.top_ids[b, n:] == -1).all() and out.top_logprobs[b, n:].isnan().all()
    assert (out.top_ids[1:3] == -1).all()


def test_logprobs_off_gives_the_same_tokens_and_no_logprobs():
    """sample(..., logprobs=False) is for a caller computing log-probs itself: the same tokens from the same
    generators (the log-probs draw no random numbers), none of the log-prob work."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 300, generator=g) * 4
    params = _mixed_params(5)
    run = [sample(x, params, [[1, 2]] * 5, [[3]] * 5, [request_generator(0, i, "cpu") for i in range(5)], logprobs=on)
           for on in (True, False)]
    assert torch.equal(run[0].tokens, run[1].tokens)
    assert run[1].logprobs.isnan().all() and run[1].top_ids.shape == (5, 0) and run[1].top_logprobs.shape == (5, 0)
    assert not run[0].logprobs.isnan().all()  # some of these rows ask for log-probs: the default computes them


# ---- seeds and streams -------------------------------------------------------------------------------------------


def test_same_seed_same_tokens_and_each_index_its_own_stream():
    x = torch.randn(1, 500, generator=torch.Generator().manual_seed(9))
    p = SP(temperature=1.0)

    def run(seed, index, steps=30):
        gen = request_generator(seed, index, "cpu")
        return [sample(x, [p], [[]], [[]], [gen]).tokens.item() for _ in range(steps)]

    assert run(11, 0) == run(11, 0)
    assert run(11, 0) != run(11, 1)
    assert run(11, 0) != run(12, 0)
    torch.manual_seed(4)
    a = run(None, 0)
    torch.manual_seed(4)
    assert run(None, 0) == a  # seed None: drawn from torch's global generator, so the global seed fixes it


# ---- batch invariance --------------------------------------------------------------------------------------------


def _mixed_params(B: int) -> list[SP]:
    menu = [SP(), SP(temperature=0.0), SP(top_p=0.9, logprobs=True, top_logprobs=5), SP(top_k=50, temperature=0.7),
            SP(min_p=0.1, logprobs=True), SP(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3),
            SP(temperature=0.0, repetition_penalty=1.5, logprobs=True, top_logprobs=20), SP(top_p=0.999999),
            SP(top_k=40, top_p=0.5, min_p=0.05, temperature=1.3, logprobs=True, top_logprobs=1),
            SP(temperature=3.0, top_p=0.95)]
    return [menu[b % len(menu)] for b in range(B)]


@pytest.mark.parametrize("threads", [1, 3])
def test_a_row_alone_equals_the_row_among_31_others(threads):
    B, V = 32, 151_936
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, V, generator=g) * 3
    x[::3, :1000] += 8  # a peaked head on some rows, a flat distribution on the others
    params = _mixed_params(B)
    prompts = [torch.randint(0, V, (20 + b,), generator=g).tolist() for b in range(B)]
    outputs = [torch.randint(0, V, (b,), generator=g).tolist() for b in range(B)]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        batch = sample(x, params, prompts, outputs, [request_generator(b, 0, "cpu") for b in range(B)])
        perm = torch.randperm(B, generator=g).tolist()
        shuffled = sample(x[perm], [params[i] for i in perm], [prompts[i] for i in perm],
                          [outputs[i] for i in perm], [request_generator(i, 0, "cpu") for i in perm])
        for b in range(B):
            alone = sample(x[b:b + 1], [params[b]], [prompts[b]], [outputs[b]], [request_generator(b, 0, "cpu")])
            j = perm.index(b)
            for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
                a, c, s = getattr(alone, name)[0], getattr(batch, name)[b], getattr(shuffled, name)[j]
                if c.dim():  # top_ids / top_logprobs: the batch is as wide as its widest request
                    c, s = c[: a.numel()], s[: a.numel()]
                assert torch.equal(a, c) or (a.isnan().all() and c.isnan().all()), (b, name)
                assert torch.equal(c, s) or (c.isnan().all() and s.isnan().all()), (b, name)
    finally:
        torch.set_num_threads(before)
    assert len(set(batch.tokens.tolist())) > B // 2  # the rows did sample different things


# ---- errors --------------------------------------------------------------------------------------------------------


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="logits must be"):
        sample(torch.zeros(5), [SP()], [[]], [[]], [None])
    with pytest.raises(ValueError, match="1 params for 2 rows"):
        sample(torch.zeros(2, 5), [SP()], [[]] * 2, [[]] * 2, [None] * 2)
    x = torch.zeros(2, 5)
    x[1] = -float("inf")
    with pytest.raises(KilnError, match="row 1 of the logits has no finite maximum"):
        sample(x, [SP()] * 2, [[]] * 2, [[]] * 2, [None] * 2)
