"""Image-text LoRA SFT of a Qwen3.5-shaped model through `kiln train` vs transformers + peft, same rows, CPU.

The model (qwen3_5, random weights built by transformers and saved once): a vision tower of 4 blocks (width
256, 4 heads, 16-pixel patches, 2x2 merge) and a text model of hidden 256, 4 layers (3 Gated DeltaNet + 1
gated attention, Qwen3.5's 3:1 schedule), vocabulary 32,768. The data: scikit-learn's bundled handwritten
digits (real images) upscaled to 128x128 or 128x192 (8x8 or 8x12 patches: 16 or 24 image tokens), each a
chat: the image and "what digit is this? answer in a sentence." -> "The digit is 7, written by hand in ink."
(loss on the reply), 96 rows, a byte-level tokenizer with the vision tokens. LoRA r=16, alpha=32 on the
language model's attention, DeltaNet projections and MLPs (the tower frozen, as peft leaves it); AdamW
lr 1e-4; batch 4 rows.

Both sides train on the same batches: kiln runs what `kiln train` runs with `data.pack = false` (one chat per
row, its fast path: chunked delta rule, fused loss); the peer encodes the same chats with the same processor
(kiln's encoding), draws its batches through kiln's Loader with the run's seed and length grouping (so the very
rows kiln draws, padded to their longest), passes pixel_values, image_grid_thw and mm_token_type_ids to
Qwen3_5ForConditionalGeneration (+ peft) and steps torch AdamW. Each side in its own process; rounds
interleave; tokens/s counts real tokens (image placeholders included), forward + backward + optimizer step.
Ratios last.

    python benchmarks/bench_vlm_sft.py [--steps 2] [--warmup 1] [--rounds 2]
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
from common import interleaved, peak_mb_above, report, rss_kb, setup_torch

TEXT = dict(vocab_size=32768, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
            linear_key_head_dim=64, linear_value_head_dim=64, max_position_embeddings=1024,
            layer_types=["linear_attention"] * 3 + ["full_attention"], pad_token_id=0, eos_token_id=2)
VISION = dict(depth=4, hidden_size=256, intermediate_size=768, num_heads=4, patch_size=16, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=256, num_position_embeddings=64)
TOKENS = dict(vision_start_token_id=3, image_token_id=4, vision_end_token_id=5, video_token_id=32767)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
           "gate_proj", "up_proj", "down_proj"]
BATCH, MAX_LENGTH, LR, RECORDS, SEED = 8, 512, 1e-4, 96, 42
QUESTION = "what digit is this? answer in a sentence."


def prepare(tmp: Path) -> None:
    """The images, chats.jsonl, the tokenizer and the random model directory (once per benchmark run)."""
    import numpy as np
    import torch
    import transformers
    from PIL import Image
    from sklearn.datasets import load_digits

    from kiln.data.bpe import train_bpe
    from kiln.data.images import QwenImageProcessor

    digits = load_digits()
    (tmp / "images").mkdir()
    rows = []
    for i in range(RECORDS):
        img = Image.fromarray((digits.images[i] * (255 / 16)).round().astype(np.uint8), mode="L")
        img.resize((128, 192) if i % 2 else (128, 128), Image.Resampling.BICUBIC).save(tmp / "images" / f"{i}.png")
        rows.append({"messages": [
            {"role": "user", "content": [{"type": "image", "image": f"images/{i}.png"}, {"type": "text", "text": QUESTION}]},
            {"role": "assistant", "content": f"The digit is {digits.target[i]}, written by hand in ink."}]})
    (tmp / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (tmp / "text.txt").write_text("\n".join([QUESTION, "The digit is 0123456789, written by hand in ink."]))
    train_bpe([tmp / "text.txt"], tmp / "model", vocab_size=300, min_frequency=1,
              extra_special_tokens=("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    config = transformers.Qwen3_5Config(text_config=TEXT, vision_config=VISION, tie_word_embeddings=False, **TOKENS)
    transformers.Qwen3_5ForConditionalGeneration(config).save_pretrained(tmp / "model")
    processor = QwenImageProcessor(patch_size=16, merge_size=2, min_pixels=128 * 128)
    (tmp / "model" / "preprocessor_config.json").write_text(json.dumps(processor.to_dict()))


def toml(tmp: Path, steps: int) -> Path:
    out = tmp / f"run-{time.time_ns()}"
    path = tmp / f"{out.name}.toml"
    path.write_text(f"""[model]
path = "{tmp / 'model'}"
task = "causal-lm"
[data]
train = "{tmp / 'chats.jsonl'}"
max_length = {MAX_LENGTH}
pack = false
[train]
out_dir = "{out}"
steps = {steps}
batch_size = {BATCH}
lr = {LR}
seed = {SEED}
save_at_end = false
progress = false
[lora]
r = 16
alpha = 32
targets = {json.dumps(TARGETS)}
""")
    return path


def run_kiln(tmp: Path, steps: int, warmup: int) -> dict:
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
            real = record["tokens_per_s"] * seconds  # unpacked rows: tokens are the attention mask's
            stamps.append((time.perf_counter(), real))

    trainer = build_trainer(load_run_config(toml(tmp, steps + warmup)))
    trainer.callbacks.append(Clock())
    trainer.fit()
    shutil.rmtree(trainer.out_dir, ignore_errors=True)
    timed = stamps[warmup - 1:]
    tokens = sum(n for _, n in timed[1:])
    return {"tokens_per_s": tokens / (timed[-1][0] - timed[0][0]), "peak_mb": peak_mb_above(base)}


def run_peer(tmp: Path, steps: int, warmup: int) -> dict:
    import peft
    import torch
    import transformers

    from kiln.data.images import QwenImageProcessor
    from kiln.data.loader import Loader
    from kiln.data.records import read_records
    from kiln.data.sft import encode_sft
    from kiln.data.sft_images import ImageTokens
    from kiln.hub import Tokenizer

    setup_torch()
    transformers.logging.set_verbosity_error()
    base = rss_kb()
    spec = ImageTokens(QwenImageProcessor.for_model(tmp / "model"), TOKENS["image_token_id"], "<|image_pad|>",
                       "<|vision_start|>", "<|vision_end|>", TOKENS["vision_start_token_id"], tmp)
    examples, _ = encode_sft(read_records(tmp / "chats.jsonl"), Tokenizer.from_dir(tmp / "model"), MAX_LENGTH,
                             "assistant", pack=False, images=spec)
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tmp / "model")
    model = peft.get_peft_model(model, peft.LoraConfig(r=16, lora_alpha=32, target_modules=TARGETS, lora_dropout=0.0,
                                                       task_type="CAUSAL_LM"))
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    loader = Loader(examples, BATCH, seed=SEED, pad_id=TEXT["pad_token_id"], group_by_length=True)  # kiln's batches
    stamps = []
    for _step in range(steps + warmup):
        batch = loader.next_batch()
        types = (batch["input_ids"] == TOKENS["image_token_id"]).long()
        loss = model(**batch, mm_token_type_ids=types, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        float(loss)  # a real loop logs its loss
        stamps.append((time.perf_counter(), int(batch["attention_mask"].sum())))
    timed = stamps[warmup - 1:]
    tokens = sum(n for _, n in timed[1:])
    return {"tokens_per_s": tokens / (timed[-1][0] - timed[0][0]), "peak_mb": peak_mb_above(base)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-vlm-") as tmp:
        prepare(Path(tmp))
        res = interleaved(__file__, a.rounds, tmp, str(a.steps), str(a.warmup))
    k, p = res["kiln"], res["peer"]
    print(f"Qwen3.5 image-text shape (tower 4 x 256, text 3 DeltaNet + 1 attention, hidden 256, vocab 32,768); LoRA "
          f"SFT on digit chats with 128x128 / 128x192 images, the same batches of {BATCH} chats on both sides")
    report("image-text LoRA SFT (kiln train, Qwen3.5 shape)", "transformers+peft", "tokens/s",
           [x["tokens_per_s"] for x in k], [x["tokens_per_s"] for x in p],
           kiln_mem=min(x["peak_mb"] for x in k), peer_mem=min(x["peak_mb"] for x in p), goal=">= 1.3x")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        side, tmp, steps, warmup = sys.argv[2:]
        print(json.dumps({"kiln": run_kiln, "peer": run_peer}[side](Path(tmp), int(steps), int(warmup))))
    else:
        main()
