"""GRPO (generation + update) through `kiln train` with [grpo] vs TRL 1.16's GRPOTrainer, same model, data and
settings, CPU.

The model: Qwen3 layout with the real Qwen3 vocabulary size (151,936), hidden 512, 4 layers, tied embeddings,
random weights built by transformers and saved once; both sides load that directory. The data: arithmetic
prompts ("What is 37 + 48? Answer with the number only.") with an `answer` column, tokenized by a byte-level
BPE trained on them (its ids sit inside the 151,936-id vocabulary; the softmax still runs over all of it).
The reward: one Python function, exact match against `answer`, given to both as is (TRL's signature).
Settings: 2 prompts x 4 generations a step, up to 32 new tokens, temperature 1, top-k/top-p off, loss_type
dapo, beta 0, one iteration, scale_rewards group, full fine-tuning, AdamW lr 1e-6, constant schedule, no
weight decay, gradient clipping at 1.0, fp32. Random weights almost never sample EOS, so both sides generate
every completion to full length and process the same tokens.

kiln runs what `kiln train --config run.toml` runs (its defaults: rollouts on the generation engine, kiln.engine:
one request per prompt with n = 4 sharing its prefill, continuous batching over a paged KV cache, the sampler's
log-probs at the temperature from the engine (no extra forward for the old policy), the trainer's log-probs chunked
through the LM head of the training forward, the tied embedding's gradient coalesced into the head's); TRL runs GRPOTrainer.train() with
transformers' generate (with num_iterations 1 it too skips the old policy's forward). tokens/s counts prompt +
completion tokens per step (TRL's num_input_tokens_seen, kiln's step tokens), generation and update together; peak
memory is the process's RSS high-water mark above its baseline. Each side runs in its own process; rounds
interleave. Ratios last.

Two more kiln sides, in the same rounds: `old`, kiln's loop before the engine (KV-cache decode of the left-padded
batch, the LM head at the last position through MKL's packed GEMM, the trainer's log-probs through the training
forward) as a copy kept in benchmarks/old_loop.py (the measured baseline: kiln retires the loop), installed in place
of the run's rollouts, and `exact`, the engine's rollouts with `exact_logprobs = true` (the
trainer's log-probs through the engine's kernels in one packed pass: logprob_gap 0). Each kiln side times its
rollouts (generation and rewards; GRPOEngine.rollout) and the rest of each step (the update: log-probs, loss,
backward, optimizer) apart: the engine's rollout against the old loop's (issue 39's goal: >= 2x), and the update
with the engine's kernels against the training forward (the price of logprob_gap 0).

    python benchmarks/bench_grpo.py [--steps 2] [--warmup 1] [--rounds 2] [--max-new-tokens 32]
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
from bench_dpo import floor_note
from common import interleaved, peak_mb_above, report, rss_kb, setup_torch

SIZE = dict(vocab_size=151936, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True,
            pad_token_id=0, eos_token_id=2)
PROMPTS, GENERATIONS, LR, ROWS = 2, 4, 1e-6, 64

REWARD = '''
def exact(prompts, completions, answer, **kwargs):
    return [float(c.strip() == str(a)) for c, a in zip(completions, answer)]
'''


def prepare(tmp: Path) -> int:
    """Prompts with answers, the reward module, the tokenizer and the random model directory."""
    import torch
    import transformers

    from kiln.data.bpe import train_bpe

    rng = random.Random(0)
    rows = []
    for _ in range(ROWS):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": f"What is {a} + {b}? Answer with the number only.", "answer": str(a + b)})
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (tmp / "text.jsonl").write_text("".join(json.dumps({"text": f"{r['prompt']} {r['answer']}"}) + "\n"
                                            for r in rows), encoding="utf-8")
    (tmp / "bench_rewards.py").write_text(REWARD, encoding="utf-8")
    train_bpe([tmp / "text.jsonl"], tmp / "model", vocab_size=400, min_frequency=1)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZE))
    model.save_pretrained(tmp / "model")
    return sum(p.numel() for p in model.parameters())  # the tied embedding and head once


KILN_SIDES = {"kiln": "", "old": "", "exact": "exact_logprobs = true"}  # `old`: old_loop.install()


def run_kiln(tmp: Path, steps: int, warmup: int, new_tokens: int, side: str = "kiln") -> dict:
    import torch  # noqa: F401  (imported before the baseline, as on the peer side)

    from kiln.train import Callback
    from kiln.train.config import load_run_config
    from kiln.train.recipes.grpo import GRPOEngine
    from kiln.train.run import build_trainer

    setup_torch()
    if side == "old":
        from old_loop import install

        install()  # this child's rollouts on the copy of kiln's earlier loop
    base = rss_kb()
    stamps: list[tuple[float, int]] = []
    rollouts: list[float] = []
    real = GRPOEngine.rollout

    def timed(self, run) -> None:  # this child's own clock around each rollout
        t = time.perf_counter()
        real(self, run)
        rollouts.append(time.perf_counter() - t)

    GRPOEngine.rollout = timed

    class Clock(Callback):
        def on_step(self, trainer, record):
            stamps.append((time.perf_counter(), int(record["tokens"])))

    out = tmp / f"run-{time.time_ns()}"
    cfg = tmp / f"{out.name}.toml"
    cfg.write_text(f"""[model]
path = "{tmp / 'model'}"
task = "causal-lm"
[data]
train = "{tmp / 'prompts.jsonl'}"
max_length = 64
[train]
out_dir = "{out}"
steps = {steps + warmup}
batch_size = {PROMPTS}
lr = {LR}
weight_decay = 0.0
schedule = "constant"
save_at_end = false
progress = false
[grpo]
rewards = ["bench_rewards:exact"]
num_generations = {GENERATIONS}
max_new_tokens = {new_tokens}
loss_type = "dapo"
{KILN_SIDES[side]}
""")
    trainer = build_trainer(load_run_config(cfg))
    trainer.callbacks.append(Clock())
    trainer.fit()
    shutil.rmtree(trainer.out_dir, ignore_errors=True)
    if not warmup:
        raise SystemExit("bench_grpo: kiln's sides need --warmup >= 1 (the first step's start is not stamped)")
    marks = stamps[warmup - 1:]
    tokens = sum(n for _, n in marks[1:])
    step_s = (marks[-1][0] - marks[0][0]) / (len(marks) - 1)
    rollout_s = sum(rollouts[warmup:]) / len(rollouts[warmup:])  # one rollout per step (num_iterations 1)
    return {"tokens_per_s": tokens / (marks[-1][0] - marks[0][0]), "peak_mb": peak_mb_above(base),
            "tokens_per_step": tokens / (len(marks) - 1), "rollout_s": rollout_s, "update_s": step_s - rollout_s}


def run_peer(tmp: Path, steps: int, warmup: int, new_tokens: int) -> dict:
    import torch  # noqa: F401
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    setup_torch()
    transformers.logging.set_verbosity_error()
    base = rss_kb()
    sys.path.insert(0, str(tmp))
    from bench_rewards import exact  # the same function kiln imports

    stamps: list[tuple[float, int]] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append((time.perf_counter(), int(state.num_input_tokens_seen)))

    rows = [json.loads(line) for line in (tmp / "prompts.jsonl").read_text().splitlines()]
    args = GRPOConfig(output_dir=str(tmp / f"trl-{time.time_ns()}"), per_device_train_batch_size=PROMPTS * GENERATIONS,
                      num_generations=GENERATIONS, max_completion_length=new_tokens, temperature=1.0, top_p=1.0,
                      top_k=0, loss_type="dapo", beta=0.0, num_iterations=1, learning_rate=LR, weight_decay=0.0,
                      lr_scheduler_type="constant", max_grad_norm=1.0, max_steps=steps + warmup, use_cpu=True,
                      report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
                      dataloader_num_workers=0, bf16=False, fp16=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp / "model")
    tok = transformers.AutoTokenizer.from_pretrained(tmp / "model")
    trainer = GRPOTrainer(model=model, reward_funcs=exact, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tok, callbacks=[Clock()])
    trainer.train()
    timed = stamps[warmup - 1:] if warmup else [(stamps[0][0], 0), *stamps]
    tokens = timed[-1][1] - timed[0][1]
    return {"tokens_per_s": tokens / (timed[-1][0] - timed[0][0]), "peak_mb": peak_mb_above(base),
            "tokens_per_step": tokens / (len(timed) - 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-grpo-") as tmp:
        n_params = prepare(Path(tmp))
        res = interleaved(__file__, a.rounds, tmp, str(a.steps), str(a.warmup), str(a.max_new_tokens),
                          sides=("peer", "kiln", "old", "exact"), describe=describe)
    k, p = res["kiln"], res["peer"]
    print(f"Qwen3 shape, vocab 151,936, hidden 512, 4 layers; GRPO full weights, {PROMPTS} prompts x {GENERATIONS} "
          f"generations, {a.max_new_tokens} new tokens, dapo, beta 0")
    best = {side: {key: min(x[key] for x in res[side]) for key in ("rollout_s", "update_s")}
            for side in KILN_SIDES}
    engine = min(best["kiln"]["rollout_s"], best["exact"]["rollout_s"])  # both sides roll out on the engine
    print(f"rollout per step: old loop {best['old']['rollout_s']:.2f} s, engine {engine:.2f} s; "
          f"engine / old speed {best['old']['rollout_s'] / engine:.3f}x (goal >= 2x)")
    print(f"update per step (log-probs, loss, backward, optimizer): training forward "
          f"{best['kiln']['update_s']:.2f} s, engine's kernels (exact_logprobs) {best['exact']['update_s']:.2f} s; "
          f"cost {best['exact']['update_s'] / best['kiln']['update_s']:.3f}x")
    kiln_mem, peer_mem = min(x["peak_mb"] for x in k), min(x["peak_mb"] for x in p)
    note = floor_note(n_params, [], kiln_mem, peer_mem)  # beta 0: no reference
    print(note)
    report("GRPO generation + update (kiln train [grpo], Qwen3 shape, vocab 151,936)", "TRL 1.16 GRPOTrainer",
           "tokens/s", [x["tokens_per_s"] for x in k], [x["tokens_per_s"] for x in p],
           kiln_mem=kiln_mem, peer_mem=peer_mem, goal=">= 2x, <= 0.6x memory", note=note)


def describe(out: dict) -> str:
    line = f"{out['tokens_per_s']:8.1f} tokens/s ({out['tokens_per_step']:.0f} tokens/step), peak +{out['peak_mb']:.0f} MB"
    if "rollout_s" in out:
        line += f"; rollout {out['rollout_s']:.2f} s/step, update {out['update_s']:.2f} s/step"
    return line


if __name__ == "__main__":
    if len(sys.argv) == 7 and sys.argv[1] == "--child":
        side, tmp, steps, warmup, new_tokens = sys.argv[2:]
        args = (Path(tmp), int(steps), int(warmup), int(new_tokens))
        print(json.dumps(run_peer(*args) if side == "peer" else run_kiln(*args, side=side)))
    else:
        main()
