"""SFT rows with tools, tool calls, tool results and reasoning: rendered as transformers renders them
(Qwen3's chat template, as trl ships it), loss exactly on the assistant turns, bad arguments named."""

from __future__ import annotations

import json
import shutil
from importlib import resources

import pytest
import transformers

from kiln.constants import IGNORE_INDEX as IGNORE
from kiln.data.bpe import train_bpe
from kiln.data.records import read_records
from kiln.data.sft import encode_conversation, encode_sft
from kiln.errors import KilnError

transformers.logging.set_verbosity_error()

TEMPLATES = resources.files("trl") / "chat_templates"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Local time in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# two calls in one turn (arguments as an object and as a JSON string), their results, reasoning, then a
# second user query: Qwen3 then drops the first exchange's reasoning, so its rendering is not incremental
AGENT = [
    {"role": "system", "content": "You are a helpful agent."},
    {"role": "user", "content": "Weather and time in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "I need both tools.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"type": "function", "function": {"name": "get_time", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "content": "{\"temp\": 18}"},
    {"role": "tool", "content": "{\"time\": \"14:05\"}"},
    {"role": "assistant", "content": "18 degrees, and it is 14:05.", "reasoning_content": "Combine both."},
    {"role": "user", "content": "Thanks! And London?"},
    {"role": "assistant", "content": None, "reasoning_content": "Call again.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "London"}}}]},
    {"role": "tool", "content": "{\"temp\": 12}"},
    {"role": "assistant", "content": "12 degrees in London.", "reasoning_content": "Report it."},
]
# what each assistant turn is in the whole rendering (after "<|im_start|>assistant\n", through <|im_end|>):
# the first exchange's turns lose their reasoning once the second user query comes
WANT_TURNS = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>',
    "18 degrees, and it is 14:05.<|im_end|>",
    '<think>\nCall again.\n</think>\n\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "London"}}\n</tool_call><|im_end|>',
    "<think>\nReport it.\n</think>\n\n12 degrees in London.<|im_end|>",
]


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory):
    d = tmp_path_factory.mktemp("tools")
    corpus = d / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"messages": AGENT, "tools": TOOLS}) + "\n" for _ in range(3)))
    train_bpe([corpus], d / "base", vocab_size=400, min_frequency=1)
    dirs = {}
    for name in ("qwen3", "qwen3_training"):
        dirs[name] = d / name
        shutil.copytree(d / "base", dirs[name])
        cfg = json.loads((dirs[name] / "tokenizer_config.json").read_text())
        cfg["chat_template"] = (TEMPLATES / f"{name}.jinja").read_text()
        (dirs[name] / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dirs


def _hf_ids(out) -> list[int]:
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_training"])
def test_tool_rows_render_as_transformers(tok_dirs, name):
    from kiln.hub import Tokenizer

    ours, hf = Tokenizer.from_dir(tok_dirs[name]), transformers.AutoTokenizer.from_pretrained(tok_dirs[name])
    for n in range(2, len(AGENT) + 1):
        conv = AGENT[:n]
        for gen in (False, True):
            text = ours.chat().render(conv, add_generation_prompt=gen, tools=TOOLS)
            assert text == hf.apply_chat_template(conv, tools=TOOLS, tokenize=False, add_generation_prompt=gen)
    assert '"name": "get_time"' in text and "<tool_response>\n{\"temp\": 12}" in text and "Report it." in text
    ids, _ = encode_conversation(ours, ours.chat(), AGENT, tools=TOOLS)
    assert ids == _hf_ids(hf.apply_chat_template(AGENT, tools=TOOLS, tokenize=True))


def test_a_tool_row_the_template_renders_incrementally_goes_turn_by_turn(tok_dirs, monkeypatch):
    """One user query (Qwen3 then keeps every turn's reasoning, so it renders incrementally): the row is encoded
    by kiln.data.turns (the rollout's path), and its ids are still transformers' rendering tokenized whole.
    With a second user query (AGENT) Qwen3 re-renders the first turns without their reasoning: that row is
    rendered whole instead, as the tests above check."""
    from kiln.data.turns import TurnCodec
    from kiln.hub import Tokenizer

    tok = Tokenizer.from_dir(tok_dirs["qwen3"])
    hf = transformers.AutoTokenizer.from_pretrained(tok_dirs["qwen3"])
    used, real = [], TurnCodec.conversation
    monkeypatch.setattr(TurnCodec, "conversation", lambda self, *a, **k: used.append(real(self, *a, **k)) or used[-1])
    conv = AGENT[:6]
    ids, labels = encode_conversation(tok, tok.chat(), conv, tools=TOOLS)
    assert used and used[-1][1].ids == ids
    assert ids == _hf_ids(hf.apply_chat_template(conv, tools=TOOLS, tokenize=True))
    want = ['<think>\nI need both tools.\n</think>\n\n' + WANT_TURNS[0], "<think>\nCombine both.\n</think>\n\n"
            + WANT_TURNS[1]]
    assert _trained_runs(tok, ids, labels) == want
    _, hidden = encode_conversation(tok, tok.chat(), conv, "assistant_no_reasoning", tools=TOOLS)
    assert ["".join(r) for r in _split_at_gaps(tok, ids, labels, hidden)] == \
        [w.replace("I need both tools.", "").replace("Combine both.", "") for w in want]


def _trained_runs(tok, ids, labels) -> list[str]:
    """The trained tokens as text, one string per contiguous run."""
    runs, cur = [], []
    for i, lab in zip(ids, labels):
        if lab != IGNORE:
            assert lab == i
            cur.append(i)
        elif cur:
            runs.append(tok.decode(cur, skip_special_tokens=False)), cur.clear()
    return runs + ([tok.decode(cur, skip_special_tokens=False)] if cur else [])


def test_loss_is_exactly_the_assistant_turns(tok_dirs):
    from kiln.hub import Tokenizer

    tok = Tokenizer.from_dir(tok_dirs["qwen3"])
    ids, labels = encode_conversation(tok, tok.chat(), AGENT, tools=TOOLS)
    assert _trained_runs(tok, ids, labels) == WANT_TURNS
    # reasoning left out: the turns lose exactly their reasoning text (the template's think tags stay)
    ids2, labels2 = encode_conversation(tok, tok.chat(), AGENT, "assistant_no_reasoning", tools=TOOLS)
    assert ids2 == ids
    assert [t.replace("Call again.", "").replace("Report it.", "") for t in WANT_TURNS] == \
        ["".join(r) for r in _split_at_gaps(tok, ids, labels, labels2)]


def _split_at_gaps(tok, ids, full, partial) -> list[list[str]]:
    """Per assistant turn (a run of `full`), the text of the tokens `partial` still trains."""
    turns, cur, inside = [], [], False
    for i, f, p in zip(ids, full, partial):
        if f != IGNORE:
            inside = True
            if p != IGNORE:
                cur.append(tok.decode([i], skip_special_tokens=False))
        elif inside:
            turns.append(cur), (cur := [])
            inside = False
    return turns + ([cur] if inside else [])


def test_assistant_mask_equals_transformers_generation_mask(tok_dirs):
    """With a {% generation %}-tagged template transformers computes the assistant mask itself: kiln's labels
    are that mask, less the newline after each <|im_end|> (kiln ends a turn at its EOS)."""
    from kiln.hub import Tokenizer

    tok = Tokenizer.from_dir(tok_dirs["qwen3_training"])
    hf = transformers.AutoTokenizer.from_pretrained(tok_dirs["qwen3_training"])
    out = hf.apply_chat_template(AGENT, tools=TOOLS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, labels = encode_conversation(tok, tok.chat(), AGENT, tools=TOOLS)
    assert ids == list(out["input_ids"])
    newline = tok.backend.encode("\n", add_special_tokens=False).ids
    want = [bool(m) and not (i in newline and k and ids[k - 1] == tok.backend.token_to_id("<|im_end|>"))
            for k, (i, m) in enumerate(zip(ids, out["assistant_masks"]))]
    assert [lab != IGNORE for lab in labels] == want and sum(want) > 40


def test_bad_tool_rows_are_named(tok_dirs, tmp_path):
    from kiln.hub import Tokenizer

    tok = Tokenizer.from_dir(tok_dirs["qwen3"])
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris}"}}]}
    good = {"messages": AGENT[:2] + [{"role": "assistant", "content": "ok"}], "tools": TOOLS}
    cases = [({"messages": AGENT[:2] + [call], "tools": TOOLS},
              r"rows\.jsonl:2: messages\[2\]\.tool_calls\[0\]\.function\.arguments is not JSON"),
             ({"messages": AGENT[:2] + [{**call, "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}]},
              r"rows\.jsonl:2: messages\[2\]\.tool_calls\[0\]\.function\.arguments must be a JSON object"),
             ({"messages": AGENT[:2] + [{**call, "tool_calls": [{"function": {"arguments": {}}}]}]},
              r"rows\.jsonl:2: messages\[2\]\.tool_calls\[0\] must be"),
             ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
              r"rows\.jsonl:2: messages\[0\] has tool_calls but role 'user'"),
             ({"messages": AGENT[:3], "tools": {"get_weather": {}}}, r"rows\.jsonl:2: 'tools' must be a list")]
    for row, msg in cases:
        f = tmp_path / "rows.jsonl"
        f.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(KilnError, match=msg):
            encode_sft(read_records(f), tok, max_length=512)
    f.write_text(json.dumps(good) + "\n" + json.dumps({"messages": AGENT, "tools": TOOLS}) + "\n")
    _examples, stats = encode_sft(read_records(f), tok, max_length=4096)  # the control: the good rows pass
    assert stats.samples == 2 and stats.truncated == 0
