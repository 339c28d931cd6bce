"""Image-text SFT (kiln.data.sft_images + the sft recipe) on a tiny Qwen3.5 image-text model and real images
(scikit-learn's digits at two sizes): the encoded rows against transformers' model (unpacked: logits' loss bit
for bit; packed, with transformers given per-sample positions from its own get_rope_index: equal too), packed =
unpacked within fp32 rounding on the DeltaNet hybrid, `kiln train` learns; bad rows by message."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln.data.images import QwenImageProcessor
from kiln.data.loader import pad_collate
from kiln.data.records import read_records
from kiln.data.sft import encode_sft, image_chat_prompt
from kiln.errors import KilnError
from kiln.interop.tiny import TINY
from tests.parallel.sft_runs import launch, losses, run_toml

PIL = pytest.importorskip("PIL.Image")
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")  # ids 3, 4, 5 after the 3 chat tokens
VOCAB = 304  # the tokenizer's 300 and room for a video id no text produces


def model_config(full_attention: bool = False) -> dict:
    # 128 positions: room for `kiln chat`'s two image turns on the engine, which holds a sequence to the model's
    # max_position_embeddings (transformers' loop does not)
    text = {**TINY["qwen3_5"]["text_config"], "vocab_size": VOCAB, "pad_token_id": 0, "eos_token_id": 2,
            "max_position_embeddings": 128}
    if full_attention:  # transformers keeps packed samples apart only in attention (its DeltaNet runs on across)
        text["layer_types"] = ["full_attention", "full_attention"]
    return {**TINY["qwen3_5"], "text_config": text, "vision_start_token_id": 3, "image_token_id": 4,
            "vision_end_token_id": 5, "video_token_id": VOCAB - 1, "tie_word_embeddings": False}


def chat(image: str, digit: int, extra: str = "") -> dict:
    return {"messages": [{"role": "user", "content": [{"type": "image", "image": image},
                                                      {"type": "text", "text": "what digit is this?" + extra}]},
                         {"role": "assistant", "content": str(digit)}]}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """digits/<i>.png (16x16 or 24x16 grey), chats.jsonl (one image per chat, a text-only chat among them), a
    tokenizer with the vision tokens."""
    from sklearn.datasets import load_digits

    from kiln.data.bpe import train_bpe

    d = tmp_path_factory.mktemp("vlm")
    digits = load_digits()
    (d / "digits").mkdir()
    rows = []
    for i in range(16):
        img = PIL.fromarray((digits.images[i] * (255 / 16)).round().astype(np.uint8), mode="L")
        img.resize((16, 24) if i % 3 == 0 else (16, 16)).save(d / "digits" / f"{i}.png")
        rows.append(chat(f"digits/{i}.png", int(digits.target[i])))
    rows.insert(5, {"messages": [{"role": "user", "content": "say 3"}, {"role": "assistant", "content": "3"}]})
    (d / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (d / "text.txt").write_text("what digit is this?\nsay 0 1 2 3 4 5 6 7 8 9\n")
    train_bpe([d / "text.txt"], d / "tok", vocab_size=300, min_frequency=1, extra_special_tokens=VISION_TOKENS)
    return d


def _model_dir(d: Path, name: str, full_attention: bool) -> Path:
    """A random tiny Qwen3_5ForConditionalGeneration saved by transformers, with the tokenizer beside it."""
    import shutil

    import transformers

    out = d / name
    if not out.exists():
        torch.manual_seed(0)
        config = transformers.Qwen3_5Config(**model_config(full_attention))
        transformers.Qwen3_5ForConditionalGeneration(config).save_pretrained(out)
        for f in (d / "tok").iterdir():
            shutil.copy(f, out)
        processor = QwenImageProcessor(patch_size=4, merge_size=2, min_pixels=64)  # what [data] sets in _toml
        (out / "preprocessor_config.json").write_text(json.dumps(processor.to_dict()))
    return out


def _hybrid(d: Path):
    """The tiny image-text model with its DeltaNet layer, built by kiln (no transformers peer needed)."""
    from kiln.hub import Tokenizer
    from kiln.models.auto import AutoConfig, from_config

    model = from_config(AutoConfig.for_model("qwen3_5", **model_config()), task="causal-lm", seed=0)
    model.tokenizer = Tokenizer.from_dir(d / "tok")
    return model


def _encode(model, d: Path, pack: bool, max_length: int = 64, records=None):
    """The sft recipe's encoding of chats.jsonl (or `records`) for `model`, as [data] image_min_pixels = 64 sets it."""
    from types import SimpleNamespace

    from kiln.train.recipes.sft import image_tokens

    cfg = SimpleNamespace(data=SimpleNamespace(image_min_pixels=64, image_max_pixels=None, max_image_pixels=None),
                          model=SimpleNamespace(path=None, tokenizer=d / "tok"))
    return encode_sft(records or read_records(d / "chats.jsonl"), model.tokenizer, max_length, pack=pack,
                      images=image_tokens(cfg, model, d))


def _toml(d: Path, name: str, steps: int, parallel: dict | None = None, batch_size: int = 4, **data) -> Path:
    """A from-config image-text SFT run on chats.jsonl (the processor's resize floor at 64 pixels)."""
    return run_toml(d, name, parallel or {}, family="qwen3_5", config=model_config(),
                    data={"train": str(d / "chats.jsonl"), "max_length": 64, "image_min_pixels": 64, **data},
                    train={"steps": steps, "save_every": 1000, "warmup_steps": 0, "seed": 3, "batch_size": batch_size})


def _hf_packed_positions(hf, batch, row_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(4, B, T) from transformers' own get_rope_index run on each packed sample alone (text row first)."""
    out = torch.zeros(3, *row_ids.shape, dtype=torch.long)
    grids = iter(batch["image_grid_thw"])
    for b in range(row_ids.shape[0]):
        starts = [0] + [i for i in range(1, row_ids.shape[1]) if positions[b, i] != positions[b, i - 1] + 1]
        for s, e in zip(starts, starts[1:] + [row_ids.shape[1]]):
            ids = row_ids[b:b + 1, s:e]
            n = int(((ids == 4).long().diff(prepend=torch.zeros(1, 1, dtype=torch.long)) == 1).sum())
            grid = torch.stack([next(grids) for _ in range(n)]) if n else None
            types = (ids == 4).long()
            if grid is None:
                out[:, b, s:e] = torch.arange(e - s)
            else:
                out[:, b:b + 1, s:e] = hf.model.get_rope_index(ids, types, grid)[0]
    return torch.cat([positions[None], out])


@torch.no_grad()
def test_image_rows_give_transformers_loss_packed_and_unpacked(data):
    import transformers

    from kiln.models import AutoModelForImageTextToText

    src = _model_dir(data, "full", full_attention=True)
    ours = AutoModelForImageTextToText.from_pretrained(src).train()
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(src).train()
    examples, stats = _encode(ours, data, pack=False)
    assert stats.samples == 17 and stats.truncated == 0
    # the image run: one placeholder per merged patch (16x16 -> 4x4 patches of 4 -> 2x2 merged), no loss on it
    first = examples[0]
    assert first["image_grid_thw"].tolist() == [[1, 6, 4]] and int((first["input_ids"] == 4).sum()) == 6
    assert bool((first["labels"][first["input_ids"] == 4] == -100).all())
    assert examples[5]["pixel_values"].shape == (0, 96)  # the text-only chat
    batch = pad_collate(examples[:8])
    types = (batch["input_ids"] == 4).long()
    a = ours(**batch)
    b = hf(**batch, mm_token_type_ids=types)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.logits, b.logits)

    rows, _ = _encode(ours, data, pack=True)
    assert len(rows) < 17 and sum(len(r["image_grid_thw"]) for r in rows) == 16
    packed = pad_collate(rows[:2])
    assert "attention_mask" not in packed
    a = ours(**packed)
    positions = _hf_packed_positions(hf, packed, packed["input_ids"], packed["position_ids"])
    b = hf(**{**packed, "position_ids": positions}, mm_token_type_ids=(packed["input_ids"] == 4).long(),
           use_cache=False)  # transformers keeps packed samples apart only without a cache
    assert torch.equal(a.loss, b.loss), (a.loss, b.loss)
    # control: the positions as one sample per row (images counted on from the previous sample) change the loss
    flat = torch.arange(packed["input_ids"].shape[1]).expand_as(packed["input_ids"])
    wrong = _hf_packed_positions(hf, packed, packed["input_ids"], flat)
    types = (packed["input_ids"] == 4).long()
    assert not torch.equal(hf(**{**packed, "position_ids": wrong}, mm_token_type_ids=types, use_cache=False).loss,
                           b.loss)


def test_packed_equals_unpacked_on_the_deltanet_hybrid(data):
    ours = _hybrid(data).train()
    rows, _ = _encode(ours, data, pack=True)
    samples, _ = _encode(ours, data, pack=False)
    packed = pad_collate(rows)
    n = sum(int((r["position_ids"] == 0).sum()) for r in rows)  # samples in the packed rows (padding tails too)
    assert n >= 17
    with torch.no_grad():
        a = ours(**packed).loss
        b = ours(**pad_collate(samples)).loss
    # the same targets in another arrangement: equal up to fp32 summation order (~1e-7 relative per add)
    assert abs(float(a) - float(b)) <= 1e-5 * float(b), (float(a), float(b))


def test_kiln_train_learns_image_rows(data):
    from typer.testing import CliRunner

    from kiln.cli.main import app
    from kiln.train.metrics import read_metrics

    r = CliRunner().invoke(app, ["train", "--config", str(_toml(data, "train", 8))])
    assert r.exit_code == 0, r.output
    losses = [m["loss"] for m in read_metrics(data / "train" / "metrics.jsonl") if "loss" in m]
    assert len(losses) == 8 and sum(losses[-3:]) < 0.8 * sum(losses[:3]), losses  # 16.3 -> 12.2 seen
    model = sorted((data / "train").glob("ckpt-*"))[-1] / "model"
    pre = json.loads((model / "preprocessor_config.json").read_text())
    assert pre["min_pixels"] == 64 and pre["patch_size"] == 4  # the processor it trained with goes along
    import transformers  # and transformers reads it as kiln does

    image = PIL.open(data / "digits" / "0.png").convert("RGB")
    theirs = transformers.AutoImageProcessor.from_pretrained(model, backend="pil")(images=[image], return_tensors="pt")
    ours = QwenImageProcessor.for_model(model)([image])
    assert ours["image_grid_thw"].tolist() == [[1, 6, 4]] and torch.equal(ours["pixel_values"], theirs["pixel_values"])


def test_lora_on_image_rows_merges_into_an_export_transformers_reads(data, tmp_path):
    """LoRA on the language model and the tower's attention, 2 steps on image rows; `kiln export` merges the
    adapters into a directory (the processor it trained with beside them) whose
    Qwen3_5ForConditionalGeneration gives kiln's logits on an image batch."""
    import transformers
    from safetensors.torch import load_file
    from typer.testing import CliRunner

    from kiln.cli.main import app
    from kiln.models import AutoModelForImageTextToText

    toml = _toml(data, "lora", 2)
    toml.write_text(toml.read_text() + '[lora]\nr = 4\nalpha = 8\ntargets = ["q_proj", "in_proj_qkv", "gate_proj", "qkv"]\n')
    r = CliRunner().invoke(app, ["train", "--config", str(toml)])
    assert r.exit_code == 0, r.output
    ckpt = sorted((data / "lora").glob("ckpt-*"))[-1]
    adapter = load_file(str(ckpt / "model" / "adapter_model.safetensors"))
    assert any(".visual." in k for k in adapter) and all(bool(v.abs().sum() > 0) for v in adapter.values())
    r = CliRunner().invoke(app, ["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "merged")])
    assert r.exit_code == 0, r.output
    processor = json.loads((ckpt / "model" / "preprocessor_config.json").read_text())
    assert processor["min_pixels"] == 64  # [data]'s, not the default: the processor it trained with goes along
    assert json.loads((tmp_path / "merged" / "preprocessor_config.json").read_text()) == processor
    ours = AutoModelForImageTextToText.from_pretrained(ckpt / "model").eval()  # base + adapters
    theirs = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(tmp_path / "merged").eval()
    batch = pad_collate(_encode(ours, data, pack=False)[0][:4])
    with torch.no_grad():
        want = ours(**batch).logits
        got = theirs(**batch, mm_token_type_ids=(batch["input_ids"] == 4).long()).logits
    # merging W + BA rounds once per weight (fp32): a few ulps of the logits' scale
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bad_image_rows_by_message(data, tmp_path):
    ours = _hybrid(data)

    def encode(rows):
        f = tmp_path / "rows.jsonl"
        f.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return _encode(ours, data, pack=False, records=read_records(f))

    with pytest.raises(KilnError, match=r"rows.jsonl:2: 1 image part\(s\) but 2 image placeholder\(s\) .*more "
                                        r"placeholders than image parts"):
        encode([chat("digits/1.png", 1), chat("digits/1.png", 1, extra=" <|image_pad|>")])
    with pytest.raises(KilnError, match=r"rows.jsonl:1: messages\[0\].content\[0\]: image .*missing.png does not exist"):
        encode([chat("missing.png", 1)])
    with pytest.raises(KilnError, match=r"rows.jsonl:1: messages\[0\].content\[1\] must be"):
        encode([{"messages": [{"role": "user", "content": [{"type": "image", "image": "digits/1.png"},
                                                          {"type": "audio"}]}]}])
    with pytest.raises(KilnError, match=r"rows.jsonl:1: messages\[0\].content is a list of parts .* need an image-text"):
        f = tmp_path / "rows.jsonl"
        f.write_text(json.dumps(chat("digits/1.png", 1)) + "\n")
        encode_sft(read_records(f), ours.tokenizer, 64)  # a text-only model's encoding
    # cut by max_length inside the image: the image goes whole, with its vision start
    (cut,), stats = _encode(ours, data, pack=False, max_length=8, records=read_records(f))
    assert stats.truncated == 1 and len(cut["input_ids"]) < 8 and 4 not in cut["input_ids"].tolist()
    assert cut["input_ids"][-1] != 3 and cut["image_grid_thw"].shape == (0, 3) and cut["pixel_values"].shape == (0, 96)
    # a template that drops the system message (and the image in it)
    ours.tokenizer.config["chat_template"] = ("{% for m in messages %}{% if m.role != 'system' %}<|im_start|>"
                                              "{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}")
    system = {"role": "system", "content": [{"type": "image", "image": "digits/2.png"}]}
    row = chat("digits/1.png", 1)
    with pytest.raises(KilnError, match=r"rows.jsonl:1: 2 image part\(s\) but 1 image placeholder\(s\) .*more "
                                        r"image parts than placeholders"):
        encode([{"messages": [system] + row["messages"]}])


def test_kiln_chat_with_images_equals_transformers_generate(data):
    """`kiln chat DIR --image A`, then `/image B` between turns: each image goes before the text of the message
    typed next, greedy; each reply is the one transformers' generate gives for the same conversation (the whole
    conversation, both images, re-encoded each turn). A missing `/image` file is told and the chat goes on."""
    import transformers
    from typer.testing import CliRunner

    from kiln.cli.main import app
    from kiln.hub.chat import parse_reply
    from kiln.models import AutoModelForImageTextToText

    src = _model_dir(data, "full", full_attention=True)
    first, second = data / "digits" / "0.png", data / "digits" / "1.png"  # 16x24 and 16x16: grids 6x4 and 4x4
    typed = f"what digit is this?\n/image {data / 'none.png'}\n/image {second}\nand this one?\n\n"
    r = CliRunner().invoke(app, ["chat", str(src), "--image", str(first), "-n", "6"], input=typed)
    assert r.exit_code == 0, r.output
    assert f"error: /image: image file {data / 'none.png'} does not exist" in r.output
    shown = [line.split("bot> ", 1)[1] for line in r.output.splitlines() if "bot> " in line]
    ours = AutoModelForImageTextToText.from_pretrained(src)
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(src).eval()
    spec = ours.image_tokens(model_dir=src)
    messages = []
    for image, text, bot in zip((first, second), ("what digit is this?", "and this one?"), shown, strict=True):
        messages.append({"role": "user", "content": [{"type": "image", "image": str(image)},
                                                     {"type": "text", "text": text}]})
        ids, inputs = image_chat_prompt(ours.tokenizer, messages, spec)
        assert inputs["image_grid_thw"].tolist() == [[1, 6, 4], [1, 4, 4]][:len(messages) // 2 + 1]
        prompt = torch.tensor([ids])
        want = hf.generate(input_ids=prompt, **inputs, mm_token_type_ids=(prompt == 4).long(), max_new_tokens=6,
                           do_sample=False)[0, prompt.shape[1]:]
        got = ours.generate(prompt, max_new_tokens=6, prompt_inputs=inputs)[0, prompt.shape[1]:]
        assert torch.equal(got, want), (got.tolist(), want.tolist())
        reply = parse_reply(ours.tokenizer.decode(want.tolist()))
        printable = lambda s: "".join(c for c in s if c.isprintable()).rstrip()  # noqa: E731 (the console drops some)
        assert printable(bot) == printable(reply["content"]), r.output
        messages.append(reply)
    r = CliRunner().invoke(app, ["chat", str(src), "--image", str(data / "none.png")], input="hi\n\n")
    assert r.exit_code != 0 and "none.png does not exist" in r.output


def test_kiln_generate_with_an_image_runs_on_the_engine(data, monkeypatch):
    """`kiln generate DIR TEXT --image A` (engvis): the image goes through the generation engine (its admission makes
    the image's features once) and the greedy continuation is the one transformers' generate gives."""
    import transformers
    from typer.testing import CliRunner

    import kiln.engine.engine as engine_module
    from kiln.cli.main import app
    from kiln.models import AutoModelForImageTextToText

    src = _model_dir(data, "full", full_attention=True)
    admitted = []
    real = engine_module.prompt_images
    monkeypatch.setattr(engine_module, "prompt_images", lambda *a: admitted.append(a[2]) or real(*a))
    picture, text = data / "digits" / "3.png", "what digit is this?"
    r = CliRunner().invoke(app, ["generate", str(src), text, "--image", str(picture), "-n", "6"])
    assert r.exit_code == 0, r.output
    assert [x["image_grid_thw"].tolist() for x in admitted] == [[[1, 6, 4]]]  # (16 x 24 pixels)
    ours = AutoModelForImageTextToText.from_pretrained(src)
    hf = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(src).eval()
    ids, inputs = ours.image_prompt([picture], model_dir=src)
    prompt = torch.tensor([ids + ours.tokenizer.backend.encode(text, add_special_tokens=False).ids])
    want = hf.generate(input_ids=prompt, **inputs, mm_token_type_ids=(prompt == 4).long(), max_new_tokens=6,
                       do_sample=False)[0, prompt.shape[1]:]
    assert r.output.strip() == (text + ours.tokenizer.decode(want.tolist())).strip()


def test_batches_without_images_reach_the_tower_when_asked(data):
    """touch_every_parameter (what the Trainer sets on a model with a trainable tower): a batch without images
    gives the same loss, and every tower parameter a zero gradient instead of none."""
    model = _hybrid(data).train()
    batch = pad_collate(_encode(model, data, pack=False)[0][5:6])  # the text-only chat
    assert batch["image_grid_thw"].shape == (0, 3)
    plain = model(**batch).loss
    plain.backward()
    assert all(p.grad is None for p in model.visual.parameters())
    model.touch_every_parameter = True
    touched = model(**batch).loss
    touched.backward()
    assert torch.equal(touched, plain)
    assert all(p.grad is not None and not bool(p.grad.any()) for p in model.visual.parameters())


@pytest.mark.slow
def test_two_processes_with_rows_without_images_equal_one(data):
    """FSDP over two processes where a step's rows on one rank (or both) hold no image: without a gradient for
    the tower there, the ranks' reductions differ (FSDP's reduce-scatter failed; DDP's 'Expected to have
    finished reduction' before the fix too). The Trainer has such a model reach the tower with a zero on those
    batches (touch_every_parameter), so the run goes on and its losses are the one-process run's."""
    from kiln.train.config import load_run_config
    from kiln.train.run import build_trainer

    text = [{"messages": [{"role": "user", "content": f"say {i}"}, {"role": "assistant", "content": str(i)}]}
            for i in range(6)]
    rows = [chat(f"digits/{i}.png", i) for i in range(2)] + text
    (data / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mixed = {"train": str(data / "mixed.jsonl"), "pack": False}
    build_trainer(load_run_config(_toml(data, "one", 3, batch_size=4, **mixed))).fit()
    name = "two-fsdp"
    r = launch(_toml(data, name, 3, {"fsdp": True}, batch_size=2, **mixed))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    torch.testing.assert_close(torch.tensor(losses(data / name)), torch.tensor(losses(data / "one")),
                               rtol=1e-5, atol=1e-6)
