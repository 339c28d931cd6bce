"""Multi-turn episodes (kiln.train.agent_rollout, kiln.train.envs): the loss mask of an episode equals one made
by hand token by token; the tokens and log-probs given to the trainer are exactly the sampled ones; environments
that raise, hang or return malformed observations fail their episode by message; TRL's environment classes run
unchanged; templates that cannot run episodes are refused before any work."""

from __future__ import annotations

import copy
import json
import time
import types

import pytest
import torch

from kiln.errors import ConfigError
from kiln.train import agent_rollout as ar
from kiln.train.envs import EnvSpec, EpisodeError, Obs, as_obs, as_tool, call_user
from tests.train.agent_helpers import Calculator, GuessEnv, make_model, make_tokenizer

EOS = 2


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("agent"))


@pytest.fixture(scope="module")
def model(tok):
    return make_model(tok)


def _g(**kw):
    base = dict(max_turns=3, max_new_tokens=40, max_episode_tokens=400, temperature=1.0, top_k=0, top_p=1.0,
                min_p=0.0, repetition_penalty=1.0)  # engfsdp: the engine's settings too
    return types.SimpleNamespace(**{**base, **kw})


def _runner(model, env_factory, g=None, tools=(), timeout=5.0):
    dialect = ar.Dialect(model.tokenizer, [EOS]).check()
    spec = EnvSpec(env_factory, [as_tool(t, "test") for t in tools], timeout)
    return ar.EpisodeRunner(spec, dialect, g or _g()), dialect


def _scripted(monkeypatch, dialect, turns: list[str]):
    """The policy replaced by a script: turn k of every episode is turns[k] then the end-of-turn token."""
    calls = {"n": 0}

    def fake(decoder, contexts, budgets, g, gen, pad, eos_ids, device):
        text = turns[calls["n"]]
        calls["n"] += 1
        ids = dialect.encode(text) + [EOS]
        return [(ids, [-0.5] * len(ids), True) for _ in contexts]

    monkeypatch.setattr(ar, "sample_turns", fake)


ROW = {"prompt": "guess my number", "answer": "7"}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>'


def test_loss_mask_of_a_multi_turn_episode_equals_a_hand_made_one(model, monkeypatch):
    """Turn 1 calls a tool and guesses wrong; the tool result and the environment's hint follow (mask 0, in the
    template's own layout: end-of-turn newline, a user turn wrapping <tool_response>, the user hint, the
    generation prompt); turn 2 guesses right (done)."""
    e, d = _tool_episode(model, monkeypatch)
    assert e.end == "done" and e.turns == 2 and e.error is None, (e.end, e.error)
    turn1, between, turn2 = _hand_made(d)
    assert d.tokenizer.decode(e.ids, skip_special_tokens=False) == \
        d.tokenizer.decode(turn1 + between + turn2, skip_special_tokens=False)
    assert e.ids == turn1 + between + turn2
    assert e.mask == [1] * len(turn1) + [0] * len(between) + [1] * len(turn2)
    assert e.rewards == [None, 0.0, 1.0] and e.reward == 1.0
    assert [m["role"] for m in e.messages] == ["user", "assistant", "tool", "user", "assistant"]
    # the prompt was rendered once, with the tools
    assert d.tokenizer.decode(e.prompt_ids, skip_special_tokens=False).endswith(
        "<|im_start|>user\nguess my number<|im_end|>\n<|im_start|>assistant\n")
    assert '"name": "add"' in d.tokenizer.decode(e.prompt_ids, skip_special_tokens=False)
    micro = ar.to_micro([e], 0, [EOS], torch.device("cpu"))
    p = micro["prompt_len"]
    assert micro["input_ids"][0, p:].tolist() == e.ids
    assert micro["loss_mask"][0].tolist() == e.mask


def test_sft_of_an_episodes_conversation_has_the_rollouts_tokens_and_mask(model, monkeypatch):
    """One masking path: the conversation a rollout produced, encoded as an SFT tool row, gives the rollout's
    tokens (prompt + episode) and its mask token by token, and both equal the hand-made mask."""
    from kiln.constants import IGNORE_INDEX
    from kiln.data.sft import encode_conversation
    from kiln.data.turns import TurnCodec

    e, d = _tool_episode(model, monkeypatch)
    turn1, between, turn2 = _hand_made(d)
    tok = d.tokenizer
    used, real = [], TurnCodec.conversation
    monkeypatch.setattr(TurnCodec, "conversation", lambda self, *a, **k: used.append(1) or real(self, *a, **k))
    ids, labels = encode_conversation(tok, tok.chat(), e.messages, tools=e.schemas)
    assert used  # the SFT row went through kiln.data.turns, not the whole-rendering fallback
    sft_mask = [int(lab != IGNORE_INDEX) for lab in labels]
    hand = [0] * len(e.prompt_ids) + [1] * len(turn1) + [0] * len(between) + [1] * len(turn2)
    assert ids[:len(e.prompt_ids) + len(e.ids)] == e.prompt_ids + e.ids
    # SFT's row ends as the template ends a conversation: the newline after the last end-of-turn (mask 0)
    assert tok.decode(ids[len(e.prompt_ids) + len(e.ids):], skip_special_tokens=False) == "\n"
    assert sft_mask[:len(hand)] == [0] * len(e.prompt_ids) + e.mask == hand and sft_mask[len(hand):] == [0]
    assert all(lab == i for i, lab in zip(ids, labels) if lab != IGNORE_INDEX)
    # and the whole rendering (transformers' apply_chat_template) is the same text: nothing was re-rendered
    assert tok.decode(ids, skip_special_tokens=False) == tok.chat().render(e.messages, tools=e.schemas)


def _hand_made(d):
    turn1 = d.encode(f"5\n{CALL}") + [EOS]
    between = d.encode("\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n<|im_start|>user\n"
                       "higher<|im_end|>\n<|im_start|>assistant\n")
    return turn1, between, d.encode("7") + [EOS]


def _tool_episode(model, monkeypatch):
    """Turn 1 calls the `add` function tool and guesses 5 (wrong), turn 2 guesses 7 (right), scripted."""
    runner, d = _runner(model, GuessEnv)
    _scripted(monkeypatch, d, [f"5\n{CALL}", "7"])

    class Env(GuessEnv):
        def reset(self, row, seed):
            obs = super().reset(row, seed)
            obs["tools"] = [adder]  # a function tool: kiln calls it and appends its result
            return obs

    def adder(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: first
            b: second
        """
        return a + b

    adder.__name__ = "add"
    runner.spec.factory = Env
    (e,) = runner.run(None, [ROW], [0], [[1]], [0], None, 0, torch.device("cpu"))
    return e, d


class Chatty:
    """Answers every turn with one more user message; never ends an episode itself."""

    def reset(self, row, seed):
        return Obs([{"role": "user", "content": row["prompt"]}])

    def step(self, message):
        return Obs([{"role": "user", "content": "more"}])


def _spy(monkeypatch) -> tuple[list, list]:
    """sample_turns watched: each call's results, and its contexts with the engine that ran them (None off it)."""
    drawn, contexts = [], []
    real = ar.sample_turns

    def spy(decoder, ctx, *a, **k):
        out = real(decoder, ctx, *a, **k)
        drawn.append(out)
        contexts.append(([list(c) for c in ctx], getattr(getattr(decoder, "rollouts", None), "engine", None)))
        return out

    monkeypatch.setattr(ar, "sample_turns", spy)
    return drawn, contexts


def test_policy_tokens_given_to_the_trainer_are_the_sampled_ones(model, monkeypatch):
    """Real sampling (tiny random model, several turns through a user-message environment): every token under
    loss_mask 1 is one sample_turns drew, in order, with its log-prob; the trainer's forward gives the same
    log-probs (the rollout's logprob_gap) to fp32 rounding."""
    from kiln.train.grpo_engine import EngineDecoder, EngineRollouts
    from kiln.train.grpo_rollout import GRPORun

    drawn, _ = _spy(monkeypatch)
    runner, _ = _runner(model, Chatty, _g(max_turns=3, max_new_tokens=12))
    rows = [ROW, {"prompt": "another one", "answer": "3"}]
    gen = torch.Generator().manual_seed(5)
    # engfsdp: the engine (the generate loop is gone), on a copy: the engine keeps its runner on the model it runs,
    # and a model holding one no longer deep-copies (the later tests copy the module's model)
    decoder = EngineDecoder(EngineRollouts(runner.g), copy.deepcopy(model))
    eps = runner.run(decoder, rows, [0, 1], [[1], [1]], [0, 1], gen, 0, torch.device("cpu"))
    assert drawn and all(e.turns >= 1 for e in eps)
    # per episode: the policy tokens (mask 1) in order are the concatenation of its turns' draws
    active = list(range(len(eps)))
    per_ep = {i: ([], []) for i in active}
    for turn in drawn:
        for i, (toks, lps, _ended) in zip(active, turn):
            per_ep[i][0].extend(toks)
            per_ep[i][1].extend(lps)
        active = [i for i, (toks, lps, ended) in zip(active, turn) if ended]  # the environment never ends one
    micro = ar.to_micro(eps, 0, [EOS], torch.device("cpu"))
    p = micro["prompt_len"]
    for i in range(len(eps)):
        on = micro["loss_mask"][i].bool()
        assert micro["input_ids"][i, p:][on].tolist() == per_ep[i][0]
        torch.testing.assert_close(micro["sampler_logps"][i][on], torch.tensor(per_ep[i][1]))
    run = types.SimpleNamespace(g=types.SimpleNamespace(temperature=1.0), exact=lambda m: False)
    trainer = GRPORun.logps(run, model, micro)  # the training forward
    on = micro["loss_mask"].bool()
    gap = (trainer[on] - micro["sampler_logps"][on]).abs().max()
    assert gap <= 1e-4, gap  # the cached decode against the full forward: fp32 rounding over 2 layers


def test_engine_episodes_reuse_earlier_turns_and_their_logps_equal_the_scorers(model, monkeypatch):
    """On the generation engine (kiln.train.grpo_engine): each turn of each episode is one request over its whole
    history; the earlier turns' full KV blocks are reused (remembered by content), so fewer tokens run through the
    model than the histories hold; the policy tokens given to the trainer are the drawn ones, and the scorer
    through the engine's kernels (exact_logps) gives their log-probs at the temperature bit for bit."""
    from kiln.train.grpo_engine import EngineDecoder, EngineRollouts, exact_logps

    drawn, contexts = _spy(monkeypatch)
    # the random model made to end its turns: the end token's head row moved along the mean hidden state (the
    # end token's probability then averages ~0.1 over random contexts: turns of ~10 tokens)
    model = copy.deepcopy(model)
    with torch.no_grad():
        ids = torch.randint(3, 400, (4, 40), generator=torch.Generator().manual_seed(0))
        u = model.model(input_ids=ids).reshape(-1, model.config.hidden_size).mean(0)
        model.lm_head.weight[EOS] += 2.5 * u / u.norm() ** 2
    g = _g(max_turns=3, max_new_tokens=30, temperature=0.7, top_k=40, min_p=0.0, repetition_penalty=1.1)
    runner, _ = _runner(model, Chatty, g)
    rollouts = EngineRollouts(g)
    # two episodes of one row (a group): their first turns share the prompt, one request with n = 2
    eps = runner.run(EngineDecoder(rollouts, model), [ROW, ROW, {"prompt": "another one", "answer": "3"}], [0, 0, 1],
                     [[1], [1], [1]], [0, 1, 2], torch.Generator().manual_seed(5), 0, torch.device("cpu"))
    assert len(drawn) >= 2 and all(e.turns >= 2 for e in eps)
    assert contexts[0][0][0] == contexts[0][0][1] and drawn[0][0][0] != drawn[0][1][0]  # own generators
    assert all(engine is rollouts.engine for _, engine in contexts)  # one engine (one pool) for every turn
    # without reuse, every request's whole history would be fed, and every drawn token but the last of each turn
    naive = sum(len(c) for turn, _ in contexts for c in turn) + sum(len(t) - 1 for turn in drawn for t, _, _ in turn)
    later = sum(len(turn) for turn, _ in contexts[1:])
    # the shared prompt is fed once, not twice; each later turn's history starts with the previous request's
    # computed tokens: at least one full block of 16
    saved = len(contexts[0][0][0]) + 16 * later
    assert rollouts.engine.tokens_fed <= naive - saved, (rollouts.engine.tokens_fed, naive)
    micro = ar.to_micro(eps, 0, [EOS], torch.device("cpu"))
    on = micro["loss_mask"].bool()
    p = micro["prompt_len"]
    per_ep: dict[int, list[int]] = {i: [] for i in range(len(eps))}
    active = list(range(len(eps)))
    for turn in drawn:
        for i, (toks, _, _) in zip(active, turn):
            per_ep[i] += toks
        active = [i for i, (_, _, ended) in zip(active, turn) if ended]  # Chatty never ends an episode itself
    for i in range(len(eps)):
        assert micro["input_ids"][i, p:][on[i]].tolist() == per_ep[i]
    with torch.no_grad():
        scored = exact_logps(model, micro, 0.7)
    assert torch.equal(scored[on], micro["sampler_logps"][on])


@pytest.mark.parametrize("kind, message", [
    ("raise", r"env.step raised RuntimeError: broken env"),
    ("hang", r"env.step did not return within 0.5 s \(grpo.env_timeout\)"),
    ("not-a-dict", r"env.step returned str, not an Obs or a dict"),
    ("bad-key", r"env.step returned a dict with unknown keys \['mesages'\]"),
    ("bad-role", r"env.step: messages\[0\] is not a \{role, content\} message"),
    ("nan-reward", r"env.step: reward is nan"),
    ("reset-raise", r"env.reset raised ValueError: no reset"),
])
def test_a_failing_environment_fails_its_episode_by_message(model, monkeypatch, kind, message):
    """The other episode of the batch runs to its end; the failed one keeps its message, carries no loss."""
    runner, d = _runner(model, None, timeout=0.5)
    _scripted(monkeypatch, d, ["5", "7", "7"])

    class Bad(GuessEnv):
        def reset(self, row, seed):
            if kind == "reset-raise" and row["answer"] == "bad":
                raise ValueError("no reset")
            return super().reset({**row, "answer": "7"}, seed)

        def step(self, message):
            if self.target is not None and getattr(self, "bad", False):
                if kind == "raise":
                    raise RuntimeError("broken env")
                if kind == "hang":
                    time.sleep(3)
                return {"not-a-dict": "oops", "bad-key": {"mesages": []},
                        "bad-role": {"messages": [{"role": "robot", "content": "x"}]},
                        "nan-reward": {"reward": float("nan"), "messages": [{"role": "user", "content": "x"}]},
                        }.get(kind) or super().step(message)
            return super().step(message)

    made = []

    def factory():
        env = Bad()
        env.bad = len(made) == 1
        made.append(env)
        return env

    runner.spec.factory = factory
    rows = [ROW, {**ROW, "answer": "bad"}]
    good, bad = runner.run(None, rows, [0, 1], [[1], [1]], [0, 1], None, 0, torch.device("cpu"))
    assert good.end == "done" and good.reward == 1.0
    assert bad.end == "error" and bad.reward is None
    import re
    assert re.search(message, bad.error), bad.error
    micro = ar.to_micro([good, bad], 0, [EOS], torch.device("cpu"))
    assert micro["loss_mask"][1].sum() == 0 and micro["loss_mask"][0].sum() > 0


def test_call_user_awaits_async_and_times_out():
    async def slow_ok():
        return 3

    assert call_user(slow_ok, timeout=2, what="x") == 3
    with pytest.raises(EpisodeError, match="x did not return within 0.2 s"):
        call_user(time.sleep, 2, timeout=0.2, what="x")


def test_a_plain_dict_and_an_obs_are_the_same_observation():
    a = as_obs({"messages": [{"role": "tool", "content": "1"}], "done": True, "reward": 2}, "t")
    b = as_obs(Obs([{"role": "tool", "content": "1"}], done=True, reward=2.0), "t")
    assert a == b


def test_trl_environment_class_runs_unchanged(model, monkeypatch):
    """reset(**row) (None: the prompt as is), its public method `add` a tool kiln calls, get_reward() at the end."""
    runner, d = _runner(model, Calculator)
    _scripted(monkeypatch, d, [CALL, CALL, "7"])
    (e,) = runner.run(None, [ROW], [0], [[1]], [0], None, 0, torch.device("cpu"))
    assert e.end == "done" and e.turns == 3, (e.end, e.error)
    assert [m["role"] for m in e.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert e.messages[2]["content"] == "7" and e.reward == 2.0  # two calls counted by the environment itself
    assert isinstance(ar.inner_envs([e])[0], Calculator)


def test_tool_failures_and_parse_failures_are_counted(model, monkeypatch):
    runner, d = _runner(model, Calculator)
    _scripted(monkeypatch, d, ['<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>',
                               "<tool_call>\nnot json\n</tool_call>"])
    (e,) = runner.run(None, [ROW], [0], [[1]], [0], None, 0, torch.device("cpu"))
    assert e.tool_failures == 1 and "error" in json.loads(e.messages[2]["content"])  # missing argument b
    assert e.parse_failures == 1 and e.end == "done"


@pytest.mark.parametrize("template, message", [
    ("chatml", r"does not render `tools`"),
    ("qwen3.jinja", r"not prefix-preserving when a tool message follows"),
    ("no-parser", r"no parser for this template's tool calls"),
])
def test_a_template_that_cannot_run_episodes_is_refused(tmp_path, template, message):
    from kiln.hub import Tokenizer
    from kiln.hub.chat import CHATML_TEMPLATE

    tok = make_tokenizer(tmp_path)
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    if template == "chatml":
        cfg["chat_template"] = CHATML_TEMPLATE
    elif template == "no-parser":
        cfg["chat_template"] = cfg["chat_template"].replace("<tool_call>", "<call>").replace("</tool_call>", "</call>")
    else:
        from tests.train.agent_helpers import TEMPLATES
        cfg["chat_template"] = (TEMPLATES / template).read_text()
    (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=message):
        ar.Dialect(Tokenizer.from_dir(tok), [EOS]).check()


def test_a_turn_cut_by_the_budget_is_scored_then_ends_the_episode(model, monkeypatch):
    """No end-of-turn token: the environment still scores what was written (its step's reward), the written tool
    call is not run, no environment tokens follow, and the episode ends as truncated."""
    runner, d = _runner(model, Calculator)
    ids = d.encode(f"7 {CALL}")

    def fake(decoder, contexts, budgets, g, gen, pad, eos_ids, device):
        return [(ids, [-0.5] * len(ids), False) for _ in contexts]

    monkeypatch.setattr(ar, "sample_turns", fake)
    (e,) = runner.run(None, [ROW], [0], [[1]], [0], None, 0, torch.device("cpu"))
    assert e.end == "truncated" and e.turns == 1 and e.ids == ids and e.mask == [1] * len(ids)
    assert e.env.inner.calls == 0 and e.reward == 0.0  # get_reward() ran: 0 calls
    micro = ar.to_micro([e], 0, [EOS], torch.device("cpu"))
    assert bool(micro["truncated"][0])
