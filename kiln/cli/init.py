"""`kiln init NAME --template ...`: a folder that `kiln train --config NAME/run.toml` trains as it is, and
`kiln examples`: the repository's examples and how to run each.

Each template writes a commented run.toml, a small sample of data generated from a fixed seed
(news-like articles of five topics, short dialogs) and a README; every model is built from a config,
with a tiny tokenizer trained on the sample (kiln's own BPE trainer), and the pretrain and mamba
templates make token shards with `kiln tokenize`'s code. So every template trains without another
step on a plain `pip install kiln` (no data or model package), and nothing written holds an absolute path.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import typer

from kiln.cli.output import out
from kiln.errors import KilnError

TEMPLATES = ("classify", "sft", "pretrain", "mamba")
# What each template's run reaches as written (its README says so; tests/cli/test_init.py holds it): the metric,
# and for accuracy the floor it clears; a loss falls from its first evaluation to its last, below a uniform guess's
RESULTS = {
    "classify": ("eval_accuracy", 0.8, "eval_accuracy of at least 0.8 on the 100 held-out articles (chance: 0.2)"),
    "sft": ("eval_loss", None, "an eval_loss that falls from the first evaluation (step 50) to the last (step 100), "
                               "below ln(512) = 6.24, a uniform guess over the vocabulary"),
    "pretrain": ("eval_loss", None, "an eval_loss that falls from the first evaluation (step 50) to the last (step "
                                    "100), below ln(512) = 6.24, a uniform guess over the vocabulary"),
    "mamba": ("eval_loss", None, "an eval_loss that falls from the first evaluation (step 50) to the last (step 100), "
                                 "below ln(512) = 6.24, a uniform guess over the vocabulary"),
}
WRITES = ("run.toml", "README.md", "data")  # what a template puts in NAME (all that --overwrite replaces)


# The sample data is generated here from a fixed seed, so a template needs no package beyond kiln's own
# dependencies (a plain `pip install kiln`): five topics of news-like text, and short dialogs.
TOPICS = {
    "business": "market shares profit bank company investors prices growth economy trade sales deal firm "
                "earnings quarter rates inflation exports",
    "entertainment": "film music band album actor award festival star show singer movie director stage "
                     "concert comedy premiere audience",
    "politics": "government minister election party vote parliament policy labour campaign leader council "
                "law reform tax debate opposition",
    "sport": "match team goal season coach players win cup league championship injury striker final "
             "referee tournament victory squad",
    "tech": "software computer internet phone users digital network mobile games broadband online chip "
            "device data security website",
}
FILLER = ["the", "a", "said", "on", "in", "this", "year", "new", "last", "week", "after", "more", "than", "its", "their", "was", "will", "be", "has", "have", "it", "for", "with", "at", "by", "from"]


def _article(rng: random.Random, topic: str) -> str:
    """A few sentences mixing the topic's words with common ones (the topic is learnable from the words)."""
    words = TOPICS[topic].split()
    sentences = []
    for _ in range(rng.randint(3, 6)):
        n = rng.randint(8, 16)
        body = [rng.choice(words) if rng.random() < 0.45 else rng.choice(FILLER) for _ in range(n)]
        sentences.append(" ".join(body).capitalize() + ".")
    return " ".join(sentences)


def _articles(per_topic: int, seed: int = 0) -> list[dict[str, str]]:
    """`per_topic` generated articles of each of the 5 topics (seeded), as {"text", "label"} rows."""
    rng = random.Random(seed)
    rows = [{"text": _article(rng, topic), "label": topic} for topic in sorted(TOPICS) for _ in range(per_topic)]
    rng.shuffle(rows)
    return rows


def _dialogs(limit: int, seed: int = 0) -> list[dict]:
    """`limit` generated conversations (sums, greetings, topic questions) as {"messages": [user, assistant, ...]}."""
    rng = random.Random(seed)
    greetings = [("Hello", "Hello! How can I help?"), ("Hi there", "Hi! What would you like to know?"),
                 ("Good morning", "Good morning! Ask me anything."), ("Thanks", "You are welcome.")]
    rows = []
    for _ in range(limit):
        turns: list[str] = []
        for _ in range(rng.randint(1, 3)):
            kind = rng.random()
            if kind < 0.5:
                a, b = rng.randint(0, 20), rng.randint(0, 20)
                turns += [f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."]
            elif kind < 0.75:
                turns += list(rng.choice(greetings))
            else:
                topic = rng.choice(sorted(TOPICS))
                word = rng.choice(TOPICS[topic].split())
                turns += [f"Which topic is the word {word} about?", f"The word {word} is about {topic}."]
        rows.append({"messages": [{"role": "user" if i % 2 == 0 else "assistant", "content": t}
                                  for i, t in enumerate(turns)]})
    return rows


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def _tokenizer_and_shards(data: Path, docs: list[dict], vocab: int) -> None:
    """data/tokenizer (a byte-level BPE trained on `docs`) and data/shards (`kiln tokenize` of them, 10% held out)."""
    from kiln.data.bpe import train_bpe
    from kiln.data.tokenize import TokenizeOptions, tokenize_to_shards

    _jsonl(data / "docs.jsonl", docs)
    train_bpe([data / "docs.jsonl"], data / "tokenizer", vocab_size=vocab, min_frequency=2)
    tokenize_to_shards([data / "docs.jsonl"], data / "tokenizer", data / "shards",
                       TokenizeOptions(val_fraction=0.1, eos="<|endoftext|>", shard_tokens=1 << 16, progress=False))


TRAIN = """
[train]
out_dir = "runs/{name}"   # relative to where you run kiln train
steps = {steps}
batch_size = {batch}
lr = {lr}
warmup_steps = {warmup}         # linear warmup, then cosine decay to min_lr_ratio x lr
min_lr_ratio = 0.1        # the last steps still learn (0: the lr ends at 0)
eval_every = {eval_every}
save_every = 0            # 0: a checkpoint at the end only (and at each new best eval_loss: best.json)
log_every = 5
device = "auto"           # cpu, cuda, mps
# report_to = ["tensorboard"]   # or wandb, trackio (pip install 'kiln[tensorboard]')
"""

TOKENS_MODEL = {
    "pretrain": """[model]
family = "qwen3"          # a small Qwen3-shaped decoder, built from scratch
task = "causal-lm"
tokenizer = "data/tokenizer"
[model.config]
vocab_size = 512          # = the tokenizer's vocabulary (kiln tokenizer train --vocab-size)
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 16
max_position_embeddings = 128
tie_word_embeddings = true
eos_token_id = 0          # <|endoftext|>, after every document in the shards
pad_token_id = 0
""",
    "mamba": """[model]
family = "mamba"          # a small Mamba (selective state space), built from scratch
task = "causal-lm"
tokenizer = "data/tokenizer"
[model.config]
vocab_size = 512          # = the tokenizer's vocabulary (kiln tokenizer train --vocab-size)
hidden_size = 64
state_size = 8
conv_kernel = 4
num_hidden_layers = 2
eos_token_id = 0
pad_token_id = 0
""",
}

SHARD_DATA = """
[data]
train = "data/shards"     # a `kiln tokenize` folder: pre-training on its token stream
eval = "data/shards"      # its "val" split: held-out loss and perplexity
max_length = 64           # tokens per window
"""


def _write(root: Path, template: str) -> str:
    """The template's files under `root`; returns the README's "what is here" paragraph."""
    data = root / "data"
    data.mkdir()
    name = root.name
    if template == "classify":
        from kiln.data.bpe import train_bpe

        rows = _articles(per_topic=100)
        _jsonl(data / "train.jsonl", rows[:400])
        _jsonl(data / "eval.jsonl", rows[400:])
        train_bpe([data / "train.jsonl"], data / "tokenizer", vocab_size=512, min_frequency=2)
        toml = """# Train a tiny BERT-shaped encoder from scratch as a 5-topic news classifier.
# Relative paths resolve against this file's folder. To fine-tune a trained model instead, replace
# the [model] table with  path = "org/name"  (a Hub repo id or an HF folder) and task.
[model]
family = "bert"
task = "sequence-classification"
tokenizer = "data/tokenizer"   # byte-level BPE trained on data/train.jsonl (kiln tokenizer train)
[model.config]
vocab_size = 512
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
max_position_embeddings = 128
pad_token_id = 0          # <|endoftext|>

[data]
train = "data/train.jsonl"  # {"text": ..., "label": ...} per line; labels are read from the data
eval = "data/eval.jsonl"
max_length = 64            # the first 64 tokens of an article tell its topic
""" + TRAIN.format(name=name, steps=150, lr=3e-3, eval_every=50, batch=16, warmup=0)
        what = ("500 generated news-like articles of 5 topics split 400 train / 100 eval, and a 512-token BPE "
                "trained on the train split (data/tokenizer).")
    elif template == "sft":
        rows = _dialogs(120)
        _jsonl(data / "chat.jsonl", rows)
        from kiln.data.bpe import train_bpe

        train_bpe([data / "chat.jsonl"], data / "tokenizer", vocab_size=512, min_frequency=1)
        toml = """# Supervised fine-tuning of a tiny chat model from scratch on generated dialogs.
# Relative paths resolve against this file's folder.
[model]
family = "qwen3"
task = "causal-lm"
tokenizer = "data/tokenizer"   # byte-level BPE with a ChatML chat template (kiln tokenizer train)
[model.config]
vocab_size = 512
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 16
max_position_embeddings = 128
tie_word_embeddings = true
pad_token_id = 0          # <|endoftext|>
eos_token_id = 2          # <|im_end|>: the end of every turn

[data]
train = "data/chat.jsonl"  # {"messages": [{"role", "content"}, ...]} per line
eval = "data/chat.jsonl"
max_length = 128
train_on = "assistant"     # loss on the replies only
pack = true                # several dialogs per row, attention kept inside each
""" + TRAIN.format(name=name, steps=100, lr=3e-3, eval_every=50, batch=8, warmup=0)
        what = ("120 generated dialogs (sums, greetings, topic questions) in data/chat.jsonl and a 512-token BPE "
                "trained on them (data/tokenizer).")
    else:
        _tokenizer_and_shards(data, [{"text": r["text"]} for r in _articles(per_topic=20)], vocab=512)
        toml = (f"# Pre-train a tiny {'Qwen3-shaped decoder' if template == 'pretrain' else 'Mamba'} from scratch "
                "on token shards of generated news-like text.\n# Relative paths resolve against this file's folder.\n"
                + TOKENS_MODEL[template] + SHARD_DATA
                + TRAIN.format(name=name, steps=100, lr=3e-3, eval_every=50, batch=8, warmup=0))
        what = ("100 generated news-like articles (data/docs.jsonl), a 512-token BPE trained on them (data/tokenizer) and "
                "their token shards (data/shards, 10% held out), made with:\n\n"
                "    kiln tokenizer train data/docs.jsonl --out data/tokenizer --vocab-size 512\n"
                "    kiln tokenize data/docs.jsonl --tokenizer data/tokenizer --out data/shards "
                "--val-fraction 0.1 --eos '<|endoftext|>'")
    (root / "run.toml").write_text(toml, encoding="utf-8")
    return what


def init(name: Path = typer.Argument(..., help="The folder to create."),
         template: str = typer.Option("classify", "--template", "-t", help="classify, sft, pretrain or mamba."),
         overwrite: bool = typer.Option(False, "--overwrite", help="Replace run.toml, README.md and data/ in an "
                                                                   "existing folder.")) -> None:
    """Create a folder with a run.toml, sample data and a README that `kiln train` trains as it is."""
    if template not in TEMPLATES:
        raise KilnError(f"--template {template!r}: choose one of {', '.join(TEMPLATES)}")
    if name.exists() and not name.is_dir():
        raise KilnError(f"{name}: is a file, not a folder")
    if name.is_dir() and any(name.iterdir()):
        if not overwrite:
            raise KilnError(f"{name}: already exists and is not empty; choose another name, or pass --overwrite "
                            f"to replace its {', '.join(WRITES)}")
        for part in WRITES:
            p = name / part
            shutil.rmtree(p) if p.is_dir() else p.unlink(missing_ok=True)
    name.mkdir(parents=True, exist_ok=True)
    try:
        what = _write(name, template)
    except BaseException:
        for part in WRITES:  # no half-made folder left behind
            p = name / part
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        raise
    (name / "README.md").write_text(f"""# {name.name} ({template})

Made by `kiln init {name.name} --template {template}`.

{what}

Train it (a checkpoint and metrics.jsonl land in runs/{name.name}):

    kiln train --config {name.name}/run.toml

As written, the run ends with {RESULTS[template][2]}.

Every key of run.toml is checked; override one from the command line with
`--set train.steps=10`. `kiln plot runs/{name.name}` draws the curves.
""", encoding="utf-8")
    out.print(f"{name}: {template} template written (run.toml, README.md, data/); "
              f"train it with: kiln train --config {name / 'run.toml'}")


# The repository's examples: (path from the repository root, what it shows, how to run it).
EXAMPLES = [
    ("examples/demo.py", "all-MiniLM-L6-v2 round trip, then a BBC News classifier fine-tuned, plotted, exported "
                         "and verified", "make demo"),
    ("examples/bbc.toml", "the demo's fine-tuning run config on its own", "kiln train --config examples/bbc.toml "
                                                                        "(after make demo wrote its data)"),
    ("examples/chatbot", "tokenizer + small Qwen3 chat model by SFT on chatterbot-corpus, then LoRA",
     ".venv/bin/python examples/chatbot/run.py"),
    ("examples/pretrain_bbc", "tokenizer, token shards and a small Qwen3 pre-trained on BBC News",
     ".venv/bin/python examples/pretrain_bbc/run.py"),
    ("examples/mamba_hpn", "Mamba with a prototype head and staged growth, SIGKILLed and resumed",
     ".venv/bin/python examples/mamba_hpn/run.py"),
    ("examples/mamba_ff", "Forward-Forward updates of Mamba's D vs plain backprop on BBC News",
     ".venv/bin/python examples/mamba_ff/run.py"),
    ("examples/deepseek_moe", "a tiny DeepSeek-V3-shaped MoE pre-trained on BBC News, then LoRA-tuned; expert load",
     ".venv/bin/python examples/deepseek_moe/run.py"),
    ("examples/preference", "SFT, then DPO on chatterbot-corpus preference pairs; held-out preference",
     ".venv/bin/python examples/preference/run.py"),
    ("examples/grpo", "SFT, then GRPO on single-digit sums with exact-match rewards; held-out accuracy",
     ".venv/bin/python examples/grpo/run.py"),
    ("examples/digits_vlm", "a tiny image-text model on scikit-learn's digits 0-4, then LoRA-tuned to all ten",
     ".venv/bin/python examples/digits_vlm/run.py"),
    ("examples/agent", "multi-turn GRPO on a number-guessing environment with feedback turns; the reward curve",
     ".venv/bin/python examples/agent/run.py"),
]


def examples() -> None:
    """List the repository's examples and how to run each (from the repository root)."""
    for path, what, how in EXAMPLES:
        out.print(f"{path}\n    {what}\n    run: {how}")


def register(app: typer.Typer) -> None:
    app.command("init")(init)
    app.command("examples")(examples)
