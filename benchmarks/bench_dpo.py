"""DPO of a Qwen3-shaped model through `kiln train` ([dpo]) vs TRL 1.16's DPOTrainer, same pairs and settings, CPU.

The model: Qwen3 layout with the real Qwen3 vocabulary size (151,936), hidden 512, 4 layers, tied
embeddings, random weights built by transformers and saved once (the real Qwen3 tokenizer is not
available offline). The data: chatterbot-corpus preference pairs (prompt: a dialog's first turn; chosen:
its real reply; rejected: a reply from another category's dialog), conversational, rendered with a
ChatML template and tokenized by a 4,000-token byte-level BPE trained on the corpus (ids inside the
151,936-id vocabulary; the head and softmax still span all of it). Full weights, loss "sigmoid",
beta 0.1, the reference a frozen copy of the starting weights on both sides (--precompute: both
precompute the reference log-probs instead), batch 4 pairs, max_length 128, AdamW lr 1e-5, fp32.

kiln runs what `kiln train --config run.toml` runs (build_trainer + fit, its fast path); TRL runs
DPOTrainer.train() (its fused LM head; bf16 off, as kiln runs fp32). Each side runs in its own process;
rounds interleave; tokens/s counts real (unpadded) chosen + rejected tokens of the timed steps (all but
the first `--warmup`). Peak memory is the process's peak RSS above what it held before the run. Ratios last.

    python benchmarks/bench_dpo.py [--precompute] [--steps 3] [--warmup 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, peak_mb_above, report, rss_kb, setup_torch

SIZE = dict(vocab_size=151936, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True,
            pad_token_id=0, eos_token_id=2)
BATCH, MAX_LENGTH, LR, BETA = 4, 128, 1e-5, 0.1


def pairs(limit: int) -> list[dict]:
    """Conversational pairs from chatterbot-corpus: a dialog's first turn, its reply, another category's reply."""
    import chatterbot_corpus
    import yaml

    src = Path(chatterbot_corpus.__file__).parent / "data" / "english"
    dialogs = []
    for f in sorted(src.glob("*.yml")):
        for conv in yaml.safe_load(f.read_text(encoding="utf-8")).get("conversations") or []:
            turns = [str(t).strip() for t in conv if t is not None and str(t).strip()]
            if len(turns) >= 2:
                dialogs.append((f.stem, turns[0], turns[1]))
    rng = random.Random(0)
    rng.shuffle(dialogs)
    rows = []
    for cat, prompt, reply in dialogs[:limit]:
        other = rng.choice([d for d in dialogs if d[0] != cat])
        rows.append({"prompt": [{"role": "user", "content": prompt}], "chosen": [{"role": "assistant", "content": reply}],
                     "rejected": [{"role": "assistant", "content": other[2]}]})
    return rows


def prepare(tmp: Path, n_pairs: int) -> int:
    """The pairs JSONL, the tokenizer and the random model directory (once per benchmark run)."""
    import torch
    import transformers

    from kiln.data.bpe import train_bpe

    rows = pairs(n_pairs)
    everything = pairs(10_000)
    (tmp / "text.jsonl").write_text("".join(json.dumps({"messages": r["prompt"] + r["chosen"]}) + "\n"
                                            for r in everything))
    train_bpe([tmp / "text.jsonl"], tmp / "model", vocab_size=4000, min_frequency=2)
    (tmp / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZE))
    model.save_pretrained(tmp / "model")
    return sum(p.numel() for p in model.parameters())  # the tied embedding and head once


def timed_rate(stamps: list[tuple[float, int]], warmup: int) -> float:
    """Tokens per second over the steps after the warmup: (time at step end, cumulative tokens)."""
    (t0, n0), (t1, n1) = stamps[warmup - 1], stamps[-1]
    return (n1 - n0) / (t1 - t0)


def kiln_rate(tmp: Path, task: str, train: str, table: str, steps: int, warmup: int, batch: int = BATCH,
              max_length: int = MAX_LENGTH, data: str = "") -> dict:
    """`kiln train` on tmp's model: `task`, tmp/`train` as data.train (`data`: more [data] lines), the recipe's
    `table` (its TOML). Tokens/s over the steps after the warmup (each step's real tokens, as its record counts
    them), the process's peak memory above its start, each step's loss."""
    import torch  # noqa: F401  (imported before the baseline, as on the peer side)

    from kiln.train import Callback
    from kiln.train.config import load_run_config
    from kiln.train.run import build_trainer

    setup_torch()
    base = rss_kb()
    stamps: list[tuple[float, int]] = []
    losses: list[float] = []

    class Clock(Callback):
        def on_step(self, trainer, record):  # after the recipe's callback put the step's real tokens in the record
            stamps.append((time.perf_counter(), (stamps[-1][1] if stamps else 0) + record["tokens"]))
            losses.append(record["loss"])

    out = tmp / f"run-{time.time_ns()}"
    cfg = tmp / f"{out.name}.toml"
    cfg.write_text(f"""[model]
path = "{tmp / 'model'}"
task = "{task}"
[data]
train = "{tmp / train}"
max_length = {max_length}
{data}
[train]
out_dir = "{out}"
steps = {steps + warmup}
batch_size = {batch}
lr = {LR}
save_at_end = false
progress = false
{table}
""")
    trainer = build_trainer(load_run_config(cfg))
    trainer.callbacks.append(Clock())
    trainer.fit()
    shutil.rmtree(out, ignore_errors=True)
    return {"tokens_per_s": timed_rate(stamps, warmup), "peak_mb": peak_mb_above(base), "losses": losses}


def run_kiln(tmp: Path, precompute: bool, steps: int, warmup: int, batch: int = BATCH, max_length: int = MAX_LENGTH,
             data: str = "") -> dict:
    """`kiln train` [dpo] on tmp's model and pairs; `data`: more [data] lines."""
    return kiln_rate(tmp, "causal-lm", "pairs.jsonl",
                     f"[dpo]\nbeta = {BETA}\nprecompute_reference = {str(precompute).lower()}", steps, warmup,
                     batch, max_length, data)


def run_peer(tmp: Path, precompute: bool, steps: int, warmup: int) -> dict:
    import torch  # noqa: F401
    import transformers
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    setup_torch()
    transformers.logging.set_verbosity_error()
    base = rss_kb()
    rows = [json.loads(line) for line in (tmp / "pairs.jsonl").read_text().splitlines()]
    tok = transformers.AutoTokenizer.from_pretrained(tmp / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp / "model")
    ref = None if precompute else transformers.AutoModelForCausalLM.from_pretrained(tmp / "model")
    args = DPOConfig(output_dir=str(tmp / f"trl-{time.time_ns()}"), per_device_train_batch_size=BATCH,
                     max_length=MAX_LENGTH, beta=BETA, learning_rate=LR, max_steps=steps + warmup, bf16=False,
                     use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, disable_tqdm=True,
                     precompute_ref_log_probs=precompute, dataloader_num_workers=0, seed=0)
    stamps: list[tuple[float, int]] = []
    trainer: DPOTrainer | None = None

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kw):  # TRL counts each step's attention-mask tokens
            stamps.append((time.perf_counter(), trainer._total_train_tokens))

    trainer = DPOTrainer(model=model, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=tok, callbacks=[Clock()])
    trainer.train()
    return {"tokens_per_s": timed_rate(stamps, warmup), "peak_mb": peak_mb_above(base)}


def floor_note(n_params: int, more: list[str], kiln_mb: float, peer_mb: float) -> str:
    """The least any full-weight fp32 AdamW run of this model holds at its peak, from its parameter count:
    weights, gradients, AdamW's two moments (and whatever `more` names: one fp32 copy each), 4 bytes a value."""
    parts = ["weights", "gradients", "AdamW's 2 moments", *more]
    copies = 4 + len(more)
    floor = n_params * 4 * copies / 2**20
    return (f"memory floor: {n_params / 1e6:.1f}M parameters x 4 bytes x {copies} ({', '.join(parts)}) = "
            f"{floor:.0f} MB = {floor / peer_mb:.2f}x the peer's peak ({peer_mb:.0f} MB); kiln's peak is the floor "
            f"+ {kiln_mb - floor:.0f} MB, the peer's the floor + {peer_mb - floor:.0f} MB")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precompute", action="store_true", help="both sides precompute the reference log-probs")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    mode = "precomputed" if a.precompute else "frozen-copy"
    with tempfile.TemporaryDirectory(prefix="kiln-bench-dpo-") as tmp:
        # every pair is seen at most once, and precomputing reads exactly these
        n_params = prepare(Path(tmp), BATCH * (a.steps + a.warmup))
        res = interleaved(__file__, a.rounds, tmp, mode, str(a.steps), str(a.warmup))
    k, p = res["kiln"], res["peer"]
    print(f"Qwen3 shape, vocab 151,936, hidden 512, 4 layers; full-weight DPO (sigmoid), {mode} reference, "
          f"chatterbot pairs (<= {MAX_LENGTH} tokens), batch {BATCH} pairs")
    kiln_mem, peer_mem = min(x["peak_mb"] for x in k), min(x["peak_mb"] for x in p)
    note = floor_note(n_params, [] if a.precompute else ["the reference copy"], kiln_mem, peer_mem)
    print(note)
    report(f"DPO full weights, {mode} reference (kiln train, Qwen3 shape, vocab 151,936)", "TRL 1.16 DPOTrainer",
           "tokens/s", [x["tokens_per_s"] for x in k], [x["tokens_per_s"] for x in p],
           kiln_mem=kiln_mem, peer_mem=peer_mem, goal=">= 1.5x, <= 0.6x memory", note=note)


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--child":
        side, tmp, mode, steps, warmup = sys.argv[2:]
        fn = {"kiln": run_kiln, "peer": run_peer}[side]
        print(json.dumps(fn(Path(tmp), mode == "precomputed", int(steps), int(warmup))))
    else:
        main()
