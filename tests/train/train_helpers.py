"""Helpers for tests/train: a tiny BERT directory with a WordPiece tokenizer, JSONL data, run TOMLs.

(A uniquely named module: several test folders have a conftest.py, so `from conftest import` is ambiguous.)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from kiln.hub import Tokenizer
from kiln.models.auto import AutoConfig, from_config
from tests.kiln_cli import kiln

WORDS = ["red", "blue", "green", "cat", "dog", "bird", "runs", "sits", "flies", "fast", "slow", "big", "small",
         "the", "a", "and", "on", "in", "tree", "house", "car", "road", "sky", "water", "fish", "swims"]
LABELS = ["animal", "colour", "place"]


TINY = {"vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 37, "max_position_embeddings": 64}


def tiny_config(**changes):
    cfg = AutoConfig.for_model("bert", **{**TINY, **changes})
    cfg.set_labels(LABELS)
    return cfg


def make_model_dir(path: Path, dropout: float = 0.1) -> Path:
    """A tiny BERT sequence classifier with a real tokenizer, saved as an HF directory."""
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS
    vocab += [f"##x{i}" for i in range(99 - len(vocab))]
    src = path.parent / (path.name + "-vocab")
    src.mkdir(parents=True)
    (src / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (src / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}))
    model = from_config(tiny_config(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout),
                        task="sequence-classification", seed=0)
    model.tokenizer = Tokenizer.from_dir(src)
    model.save_pretrained(path)
    return path


def make_rows(n: int, seed: int) -> list[dict]:
    """Sentences of 3-12 words whose label is the kind of their first content word (learnable)."""
    rng = random.Random(seed)
    kinds = {"animal": ["cat", "dog", "bird", "fish"], "colour": ["red", "blue", "green"],
             "place": ["tree", "house", "road", "sky"]}
    rows = []
    for i in range(n):
        label = LABELS[i % 3]
        words = [rng.choice(kinds[label])] + [rng.choice(WORDS) for _ in range(rng.randint(2, 11))]
        rows.append({"text": " ".join(words), "label": label})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_toml(path: Path, model_dir: Path, train: Path, eval_: Path | None, out_dir: Path, **train_keys) -> Path:
    keys = {"out_dir": str(out_dir), "seed": 3, "steps": 12, "batch_size": 4, "lr": 2e-3, "warmup_steps": 2,
            "save_every": 4, "eval_every": 4, "keep_last": 10, "progress": False, **train_keys}
    body = [f'[model]\npath = "{model_dir}"\ntask = "sequence-classification"\n',
            f'[data]\ntrain = "{train}"\n' + (f'eval = "{eval_}"\n' if eval_ else "") + "max_length = 32\n",
            "[train]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items())]
    path.write_text("\n".join(body))
    return path




# A tiny Qwen3 decoder's [model.config] body for run TOMLs (vocabulary, pad and eos ids added by each test).
TINY_QWEN3_TOML = """hidden_size = 32
intermediate_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
head_dim = 8
max_position_embeddings = 64
"""


def curve(run: Path) -> list[tuple]:
    """Every metrics line of a run minus its wall-clock fields, in order: two exact runs have equal curves."""
    from kiln.train.metrics import read_metrics

    return [tuple(sorted((k, v) for k, v in r.items() if not k.endswith("_per_s")))
            for r in read_metrics(run / "metrics.jsonl")]


def killed_then_resumed_matches(ref_cfg: Path, cfg: Path, *, fault: str = "step:5",
                                steps: tuple[int, ...] = (6, 8), ref_in_process: bool = False) -> list[tuple]:
    """Train `ref_cfg` through; train `cfg` (the same run in another out_dir) until SIGKILL at `fault`, resume
    it, and assert its checkpoints at `steps` and its metrics curve equal the uninterrupted run's. Returns
    the curve. The out_dirs are read from the TOMLs. `ref_in_process`: the uninterrupted run in this process
    (one interpreter start fewer), on one thread as the CLI processes run."""
    import tomllib

    import torch
    from safetensors.torch import load_file

    ref, run = (Path(tomllib.loads(c.read_text())["train"]["out_dir"]) for c in (ref_cfg, cfg))
    if ref_in_process:
        from kiln.train.config import load_run_config
        from kiln.train.run import build_trainer

        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # the CLI processes run with OMP_NUM_THREADS=1: the same kernels, the same bits
        try:
            build_trainer(load_run_config(ref_cfg)).fit()
        finally:
            torch.set_num_threads(threads)
    else:
        kiln("train", "--config", str(ref_cfg))
    p = kiln("train", "--config", str(cfg), env={"KILN_FAULT": fault}, check=False)
    assert p.returncode == -9, p.stderr
    kiln("train", "--config", str(cfg), "--resume", str(run))
    for step in steps:
        a = load_file(str(ref / f"ckpt-{step:06d}" / "model" / "model.safetensors"))
        b = load_file(str(run / f"ckpt-{step:06d}" / "model" / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"weights differ at step {step}"
    got = curve(run)
    assert got == curve(ref)
    return got


def write_sum_prompts(d: Path, n: int, rewards: dict[str, str]) -> Path:
    """GRPO inputs in `d`: prompts "what is a plus b?" with their answers for a, b < n, a byte-level BPE of 300
    tokens trained on them (`d/tok`), and the reward modules `rewards` (file name -> source)."""
    from kiln.data.bpe import train_bpe

    rows = [{"prompt": f"what is {a} plus {b}?", "answer": str(a + b)} for a in range(n) for b in range(n)]
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "text.jsonl").write_text("".join(json.dumps({"text": f"{r['prompt']} {r['answer']}"}) + "\n" for r in rows))
    train_bpe([d / "text.jsonl"], d / "tok", vocab_size=300, min_frequency=1)
    for name, source in rewards.items():
        (d / name).write_text(source)
    return d
