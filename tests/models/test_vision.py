"""The Qwen3.5 vision tower (kiln/models/qwen3_5_vision.py) against transformers' Qwen3_5(Moe)ForConditionalGeneration:
logits, loss and every gradient bit for bit with two images of different grids in a left-padded batch (the
learned positions resampled to each, both rotary axes, the merger, MRoPE positions); export byte-identical and
verify-export feeding images; bad image inputs by message."""

from __future__ import annotations

import pytest
import torch
import transformers

from kiln.errors import ConfigError, KilnError
from kiln.interop.export import export_model
from kiln.interop.verify import compare_models, verify_export
from kiln.models import AutoConfig, AutoModelForImageTextToText
from kiln.models.qwen3_5_vision import image_positions, position_taps
from kiln.models.tasks import get_task
from tests.models.causal_cases import same
from tests.models.parity import same_gradients

transformers.logging.set_verbosity_error()
ARCH = {"qwen3_5": "Qwen3_5ForConditionalGeneration", "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration"}


def _pair(model_type: str, tiny_factory):
    src = tiny_factory(model_type, "causal-lm")
    return src, AutoModelForImageTextToText.from_pretrained(src), getattr(transformers, ARCH[model_type]).from_pretrained(src)


def _batch(model) -> dict:
    batch = model.example_image_batch()
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return {**batch, "labels": labels.masked_fill(batch["input_ids"] == model.image_token_id, -100)}


@pytest.mark.parametrize("model_type", list(ARCH))
def test_image_text_logits_loss_and_gradients_bit_identical(model_type, tiny_factory):
    _, ours, hf = _pair(model_type, tiny_factory)
    batch = _batch(ours)
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 6, 8]] and bool((batch["attention_mask"] == 0).any())
    a, b = ours.train()(**batch), hf.train()(**batch)
    same(a.logits, b.logits, "logits")
    same(a.loss, b.loss, "loss")
    a.loss.backward()
    b.loss.backward()
    same_gradients(ours, hf, ours.family, "causal-lm", model_type)
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in ours.visual.parameters())
    # mm_token_type_ids are read from the placeholders when not given
    no_types = {k: v for k, v in batch.items() if k != "mm_token_type_ids"}
    with torch.no_grad():
        same(ours(**no_types).logits, a.logits.detach(), "logits without mm_token_type_ids")
        # control: the images swapped between the rows' placeholders changes the logits
        swapped = dict(batch, pixel_values=batch["pixel_values"].flip(0))
        assert not torch.equal(ours(**swapped).logits, a.logits.detach())
    if model_type == "qwen3_5_moe":
        with torch.no_grad():
            a, b = ours(**batch, output_router_logits=True), hf(**batch, output_router_logits=True)
        same(a.aux_loss, b.aux_loss, "aux loss")
        same(a.loss, b.loss, "loss with the aux loss")


def test_positions_and_resampling_match_transformers(tiny_factory):
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights

    _, ours, hf = _pair("qwen3_5", tiny_factory)
    batch = _batch(ours)
    want, deltas = hf.model.get_rope_index(batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"],
                                           attention_mask=batch["attention_mask"])
    got, our_deltas = image_positions(batch["input_ids"], batch["mm_token_type_ids"], batch["image_grid_thw"],
                                      batch["attention_mask"], 2)
    same(got, want, "mrope positions")
    same(our_deltas, deltas, "rope deltas")
    grids = torch.tensor([[1, 2, 2], [1, 10, 6], [2, 4, 14]])  # smaller, larger and wider than the 4x4 table
    for a, b in zip(position_taps(grids, 4, 2), get_vision_interpolation_indices_and_weights(
            grids, 4, mode="bilinear", align_corners=True, spatial_merge_size=2)):
        same(a, b, "resampling taps")


@pytest.mark.parametrize("model_type", list(ARCH))
def test_export_is_byte_identical_and_verify_feeds_images(model_type, tiny_factory, tmp_path):
    src, ours, _ = _pair(model_type, tiny_factory)
    checks = verify_export(export_model(ours, tmp_path / "export"), source=src)
    assert all(c.ok for c in checks), [c.line() for c in checks if not c.ok]
    assert any(c.name == "tensors equal source" for c in checks)
    assert sum(c.name.startswith("batch 2 ") for c in checks) == 2  # the image batch: logits and loss
    # ...through the class that takes pixel_values (the causal-LM Auto class maps to a text-only one)
    assert checks[0].name == f"transformers loads {ARCH[model_type]}"
    # control: against the text-only class an image batch is a failed check, not text compared as text
    text_only = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    got = compare_models(ours.eval(), text_only, get_task("causal-lm"), ours.config, [ours.example_image_batch()])
    assert [(c.name, c.ok) for c in got] == [("batch 0 images", False)]


def test_bad_image_inputs_by_message(tiny_factory):
    _, ours, _ = _pair("qwen3_5", tiny_factory)
    batch = ours.example_image_batch()
    with pytest.raises(KilnError, match="16 image placeholder tokens .* give 20 features"):
        ours(**dict(batch, image_grid_thw=torch.tensor([[1, 4, 4], [1, 8, 8]]),
                    pixel_values=torch.randn(16 + 64, 96), mm_token_type_ids=None))
    with pytest.raises(KilnError, match=r"pixel_values has shape \(10, 96\)"):
        ours(**dict(batch, pixel_values=torch.randn(10, 96)))
    with pytest.raises(KilnError, match="multiples of spatial_merge_size"):
        ours(**dict(batch, image_grid_thw=torch.tensor([[1, 4, 4], [1, 3, 16]])))
    with pytest.raises(KilnError, match="image_grid_thw has 3 images but input_ids hold fewer image runs"):
        ours(**dict(batch, pixel_values=None, image_grid_thw=torch.tensor([[1, 4, 4], [1, 6, 8], [1, 2, 2]])))
    with pytest.raises(KilnError, match="image_grid_thw beside pixel_values"):
        ours(**dict(batch, image_grid_thw=None))
    with pytest.raises(ConfigError, match="has no vision tower"):
        AutoModelForImageTextToText.from_config(AutoConfig.for_model(
            "qwen3_5_text", vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=1,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, layer_types=["full_attention"]))


@pytest.mark.parametrize("model_type", list(ARCH))
def test_greedy_generation_with_images_equals_transformers(model_type, tiny_factory):
    _, ours, hf = _pair(model_type, tiny_factory)
    batch = ours.example_image_batch()
    images = {k: batch[k] for k in ("pixel_values", "image_grid_thw", "mm_token_type_ids")}
    a = ours.generate(batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=20,
                      eos_token_id=None, pad_token_id=0, prompt_inputs=images)
    b = hf.eval().generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **images,
                           max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert a.shape == (2, batch["input_ids"].shape[1] + 20)
    assert torch.equal(a, b), (a[:, -20:].tolist(), b[:, -20:].tolist())
    # control: the same prompts without their images (placeholders read as text, text positions) change the tokens
    text_only = ours.generate(batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=20,
                              eos_token_id=None, pad_token_id=0)
    assert not torch.equal(text_only, a)


def test_kiln_generate_with_an_image(tiny_factory, tmp_path):
    from PIL import Image
    from typer.testing import CliRunner

    from kiln.cli.main import app
    from kiln.data.images import QwenImageProcessor
    from kiln.pipelines import generate

    src, ours, hf = _pair("qwen3_5", tiny_factory)
    rng = torch.Generator().manual_seed(1)
    Image.fromarray((torch.rand(20, 28, 3, generator=rng) * 255).byte().numpy()).save(tmp_path / "photo.png")
    r = CliRunner().invoke(app, ["generate", str(src), "the cat", "--image", str(tmp_path / "photo.png"), "-n", "6"])
    assert r.exit_code == 0, r.output
    assert r.output.strip() == ("the cat" + generate(ours, "the cat", 6, images=[tmp_path / "photo.png"])).strip()
    # the same prompt through transformers: the tokens kiln generated
    ids, inputs = ours.image_prompt([tmp_path / "photo.png"], QwenImageProcessor(patch_size=4, merge_size=2,
                                                                                   min_pixels=8 * 8))
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 8]]  # 20x28 -> 16x32 (round half to even): 4x8 patches
    prompt = torch.tensor([ids + ours.tokenizer.backend.encode("the cat", add_special_tokens=False).ids])
    a = ours.generate(prompt, max_new_tokens=6, eos_token_id=None, prompt_inputs=inputs)
    types = (prompt == ours.image_token_id).long()  # as transformers' processor writes them (kiln reads the ids)
    b = hf.eval().generate(input_ids=prompt, **inputs, mm_token_type_ids=types, max_new_tokens=6, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    assert torch.equal(a, b)
    r = CliRunner().invoke(app, ["generate", str(src), "the cat", "--image", str(tmp_path / "none.png")])
    assert r.exit_code != 0 and "none.png does not exist" in r.output


def test_lora_on_the_tower_and_freezing_it(tiny_factory):
    """LoRA reaches the vision tower's Linears by name (`qkv`, the merger's fc), and `train.freeze = ["visual"]`
    keeps the whole tower fixed while the language model trains on image rows."""
    from kiln.models.common.lora import LoraConfig, apply_lora
    from kiln.train.freeze import freeze

    src, ours, _ = _pair("qwen3_5", tiny_factory)
    chosen = apply_lora(ours, LoraConfig(r=2, alpha=4, targets=["qkv", "linear_fc2", "q_proj"]))
    assert "visual.blocks.0.attn.qkv" in chosen and "visual.merger.linear_fc2" in chosen
    assert "model.layers.1.self_attn.q_proj" in chosen
    batch = _batch(ours)
    ours.train()(**batch).loss.backward()
    tower = {n: p for n, p in ours.named_parameters() if n.startswith("visual.") and p.requires_grad}
    assert tower and all(".lora_" in n and p.grad is not None and bool(p.grad.abs().sum() > 0)
                         for n, p in tower.items() if "lora_B" in n), sorted(tower)

    model = AutoModelForImageTextToText.from_pretrained(src)
    frozen = freeze(model, ["visual"])
    assert frozen and all(n.startswith("visual.") for n in frozen)
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == {n for n, _ in
                                                                                model.visual.named_parameters(prefix="visual")}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model.train()(**batch).loss.backward()
    opt.step()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed and not any(n.startswith("visual.") for n in changed)
