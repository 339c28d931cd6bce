"""Multi-turn GRPO with a tool environment: `kiln train` with [grpo] env vs TRL 1.16's GRPOTrainer with
`environment_factory`, the same environment class (TRL's shape: reset(**row), a public `add` tool method,
get_reward()), same model, data and budgets, CPU.

The model: Qwen3 layout with the real Qwen3 vocabulary size (151,936), hidden 512, 4 layers, tied embeddings,
random weights built by transformers and saved once; the tokenizer: a 600-token byte-level BPE trained on the
prompts as TRL's Qwen2.5 chat template renders them with the tool's schema (~232 tokens a prompt), that template
in its config (it renders tools; both sides parse its `<tool_call>` layout). Settings: 2 prompts x
4 generations a step, 32 tokens per episode (TRL's max_completion_length; kiln's max_new_tokens and
max_episode_tokens), up to 2 tool rounds (TRL's max_tool_calling_iterations; kiln's max_turns = 3), temperature 1,
dapo, beta 0, one iteration, AdamW lr 1e-6, constant schedule, fp32. Random weights almost never write a tool call
or an end token, so on both sides each episode is one turn of 32 tokens: this measures the rollout and update
machinery of the multi-turn path on equal work, not tool latency. tokens/s counts prompt + completion tokens per
step; peak memory is the RSS high-water mark above the process's baseline. Each side in its own process; rounds
interleave. Ratios last.

    python benchmarks/bench_agent_grpo.py [--steps 2] [--warmup 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_grpo import SIZE
from common import interleaved, peak_mb_above, report, rss_kb, setup_torch

PROMPTS, GENERATIONS, LR, ROWS, TOKENS, TOOL_ROUNDS = 2, 4, 1e-6, 64, 32, 2

ENV = '''
class Calculator:
    def reset(self, **row):
        self.answer, self.calls = int(row["answer"]), 0

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return float(self.calls > 0)
'''


def prepare(tmp: Path) -> None:
    import torch
    import transformers

    from kiln.data.bpe import train_bpe

    rng = random.Random(0)
    rows = []
    for _ in range(ROWS):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Use the add tool."}],
                     "answer": str(a + b)})
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    template = (resources.files("trl") / "chat_templates" / "qwen2_5.jinja").read_text()
    sys.path.insert(0, str(tmp))
    (tmp / "bench_env.py").write_text(ENV, encoding="utf-8")
    from bench_env import Calculator
    from transformers.utils import get_json_schema

    from kiln.hub import ChatTemplate

    # the BPE learns the rendered prompts, tools block included (else that block is ~1 token a byte on both sides)
    tools = [get_json_schema(Calculator.add)]
    (tmp / "text.jsonl").write_text("".join(json.dumps({"text": ChatTemplate(template).render(r["prompt"], tools=tools,
                                                                                            add_generation_prompt=True)})
                                            + "\n" for r in rows))
    train_bpe([tmp / "text.jsonl"], tmp / "model", vocab_size=600, min_frequency=1)
    cfg = json.loads((tmp / "model" / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (tmp / "model" / "tokenizer_config.json").write_text(json.dumps(cfg))
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZE)).save_pretrained(tmp / "model")


def run_kiln(tmp: Path, steps: int, warmup: int, grpo: str = "") -> dict:
    """`grpo`: more [grpo] keys (benchmarks/bench_grpo_async.py's async = true)."""
    import torch  # noqa: F401

    from kiln.train import Callback
    from kiln.train.config import load_run_config
    from kiln.train.run import build_trainer

    setup_torch()
    base = rss_kb()
    stamps: list[tuple[float, int]] = []

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
max_length = 512
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
env = "bench_env:Calculator"
num_generations = {GENERATIONS}
max_new_tokens = {TOKENS}
max_episode_tokens = {TOKENS}
max_turns = {TOOL_ROUNDS + 1}
loss_type = "dapo"
{grpo}
""")
    trainer = build_trainer(load_run_config(cfg))
    trainer.callbacks.append(Clock())
    trainer.fit()
    shutil.rmtree(trainer.out_dir, ignore_errors=True)
    timed = stamps[warmup - 1:] if warmup else [(stamps[0][0], 0), *stamps]
    tokens = sum(n for _, n in timed[1:])
    return {"tokens_per_s": tokens / (timed[-1][0] - timed[0][0]), "peak_mb": peak_mb_above(base),
            "tokens_per_step": tokens / (len(timed) - 1)}


def run_peer(tmp: Path, steps: int, warmup: int) -> dict:
    import torch  # noqa: F401
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    setup_torch()
    transformers.logging.set_verbosity_error()
    base = rss_kb()
    sys.path.insert(0, str(tmp))
    from bench_env import Calculator  # the same class kiln imports

    stamps: list[tuple[float, int]] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append((time.perf_counter(), int(state.num_input_tokens_seen)))

    rows = [json.loads(line) for line in (tmp / "prompts.jsonl").read_text().splitlines()]
    args = GRPOConfig(output_dir=str(tmp / f"trl-{time.time_ns()}"), per_device_train_batch_size=PROMPTS * GENERATIONS,
                      num_generations=GENERATIONS, max_completion_length=TOKENS, temperature=1.0, top_p=1.0,
                      top_k=0, loss_type="dapo", beta=0.0, num_iterations=1, learning_rate=LR, weight_decay=0.0,
                      lr_scheduler_type="constant", max_grad_norm=1.0, max_steps=steps + warmup, use_cpu=True,
                      report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0,
                      dataloader_num_workers=0, bf16=False, fp16=False, max_tool_calling_iterations=TOOL_ROUNDS)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp / "model")
    tok = transformers.AutoTokenizer.from_pretrained(tmp / "model")
    trainer = GRPOTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                          environment_factory=Calculator, callbacks=[Clock()])
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
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-agent-") as tmp:
        prepare(Path(tmp))
        res = interleaved(__file__, a.rounds, tmp, str(a.steps), str(a.warmup),
                          describe=lambda out: f"{out['tokens_per_s']:8.1f} tokens/s ({out['tokens_per_step']:.0f} "
                                               f"tokens/step), peak +{out['peak_mb']:.0f} MB")
    k, p = res["kiln"], res["peer"]
    print(f"Qwen3 shape, vocab 151,936, hidden 512, 4 layers; multi-turn GRPO with a TRL environment class, "
          f"{PROMPTS} prompts x {GENERATIONS} generations, {TOKENS} tokens an episode, dapo, beta 0")
    report("multi-turn GRPO generation + update (kiln [grpo] env, Qwen3 shape)", "TRL 1.16 GRPOTrainer "
           "environment_factory", "tokens/s", [x["tokens_per_s"] for x in k], [x["tokens_per_s"] for x in p],
           kiln_mem=min(x["peak_mb"] for x in k), peer_mem=min(x["peak_mb"] for x in p), goal=">= 2x")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        side, tmp, steps, warmup = sys.argv[2:]
        fn = {"kiln": run_kiln, "peer": run_peer}[side]
        print(json.dumps(fn(Path(tmp), int(steps), int(warmup))))
    else:
        main()
