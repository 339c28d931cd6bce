"""DPO with data.pack (a micro-batch's chosen and rejected sequences packed into rows, attention kept per sequence)
vs the same run padded (data.pack = false), on pairs of mixed lengths, through `kiln train`, CPU.

The lengths: no real preference set is available offline, so each pair's lengths are drawn from a documented
distribution in the range of real ones (20-400 tokens a side): a sequence's length (prompt + reply, in tokens)
is log-normal with median 130 and log-sigma 0.6, cut to [20, 400]; the prompt takes a uniform 15-50% of the first
side drawn, the chosen and rejected replies are drawn independently after it (so the two sides of a pair differ,
as real replies do). The text: chatterbot-corpus words (bench_dpo.py's corpus and 4,000-token byte-level BPE)
added until each part has its drawn token count; standard (string) rows.

The model: Qwen3 layout, hidden 256, 6 layers, vocabulary 4,096, random weights. The chunked LM head runs only
where a completion token is scored, padded or packed alike, so packing saves the body's work on padding: this
shape's body-to-head cost per token (12 x layers x hidden / vocabulary = 4.5) is that of real models (Qwen3-0.6B
2.3, Llama-3-8B 12), where bench_dpo.py's 151,936-word vocabulary on a 4-layer body would be mostly head.
Full weights, loss "sigmoid", beta 0.1, the reference a frozen copy of the starting weights, batch 8 pairs,
max_length 400, AdamW lr 1e-5, fp32, kiln's default seed: both sides see the same pairs in the same micro-batches, so the
losses are equal (within float32 rounding: the first step's to 1e-5 relative, checked, every step's printed).

Each side runs in its own process; rounds interleave; tokens/s counts the real (unpadded) chosen + rejected tokens
of the timed steps (all but the first `--warmup`). Ratio (packed / padded) last.

    python benchmarks/bench_dpo_pack.py [--steps 3] [--warmup 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dpo import pairs as chatterbot_pairs
from bench_dpo import run_kiln
from common import interleaved, report

SIZE = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
            pad_token_id=0, eos_token_id=2)
BATCH, MAX_LENGTH = 8, 400
MEDIAN, SIGMA, LOW, HIGH = 130, 0.6, 20, 400


def draw_length(rng: random.Random) -> int:
    return max(LOW, min(HIGH, round(math.exp(math.log(MEDIAN) + SIGMA * rng.gauss(0, 1)))))


def prepare(tmp: Path, n_pairs: int) -> dict:
    """The tokenizer (bench_dpo's BPE), the pairs JSONL with drawn token lengths, the random model directory."""
    import torch
    import transformers
    from tokenizers import Tokenizer

    from kiln.data.bpe import train_bpe

    everything = chatterbot_pairs(10_000)
    (tmp / "text.jsonl").write_text("".join(json.dumps({"messages": r["prompt"] + r["chosen"]}) + "\n"
                                            for r in everything))
    train_bpe([tmp / "text.jsonl"], tmp / "model", vocab_size=4000, min_frequency=2)
    tok = Tokenizer.from_file(str(tmp / "model" / "tokenizer.json"))
    words = " ".join(m["content"] for r in everything for m in r["prompt"] + r["chosen"]).split()
    rng = random.Random(0)

    def text(tokens: int) -> str:
        """Chatterbot words from a random place on, until the text is `tokens` tokens long."""
        at, out = rng.randrange(len(words)), []
        while len(tok.encode(" ".join(out), add_special_tokens=False).ids) < tokens:
            out.append(words[at % len(words)])
            at += 1
        return " ".join(out)

    rows, lengths = [], []
    for _ in range(n_pairs):
        first = draw_length(rng)
        prompt = max(1, round(first * rng.uniform(0.15, 0.5)))
        chosen, rejected = first - prompt, max(1, draw_length(rng) - prompt)
        rows.append({"prompt": text(prompt), "chosen": " " + text(chosen), "rejected": " " + text(rejected)})
        lengths += [prompt + chosen, prompt + rejected]
    (tmp / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZE)).save_pretrained(tmp / "model")
    return {"min": min(lengths), "median": statistics.median(lengths), "max": max(lengths)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-dpo-pack-") as tmp:
        lengths = prepare(Path(tmp), BATCH * (a.steps + a.warmup))
        res = interleaved(__file__, a.rounds, tmp, str(a.steps), str(a.warmup), sides=("padded", "packed"))
    packed, padded = res["packed"], res["padded"]
    first = [r["losses"] for r in packed + padded]
    worst = max(abs(x - y) / abs(y) for run in first for x, y in zip(run, first[0]))
    print(f"losses per step, packed: {packed[0]['losses']}; padded: {padded[0]['losses']}; largest relative "
          f"difference of any run's step from the first's: {worst:.2e}")
    step1 = max(abs(r[0] - first[0][0]) / abs(first[0][0]) for r in first)
    if step1 > 1e-5:  # the same pairs and weights at step 1: only float32 rounding may differ
        raise SystemExit(f"the first step's loss differs by {step1:.2e} relative between runs: not the same work")
    print(f"Qwen3 shape, hidden 256, 6 layers, vocab 4,096; full-weight DPO (sigmoid), frozen-copy reference, batch "
          f"{BATCH} pairs; sequence lengths drawn log-normal (median {MEDIAN}, sigma {SIGMA}) in [{LOW}, {HIGH}]: "
          f"min {lengths['min']}, median {lengths['median']:.0f}, max {lengths['max']} tokens")
    report("DPO packed vs padded, mixed lengths 20-400 (kiln train, data.pack)", "kiln padded (data.pack = false)",
           "tokens/s", [x["tokens_per_s"] for x in packed], [x["tokens_per_s"] for x in padded],
           kiln_mem=min(x["peak_mb"] for x in packed), peer_mem=min(x["peak_mb"] for x in padded),
           goal=">= 1.5x at equal loss")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        side, tmp, steps, warmup = sys.argv[2:]
        print(json.dumps(run_kiln(Path(tmp), False, int(steps), int(warmup), BATCH, MAX_LENGTH,
                                  f"pack = {str(side == 'packed').lower()}")))
    else:
        main()
