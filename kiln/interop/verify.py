"""verify-export: load a directory into transformers and into kiln, run fixed inputs, demand equality.

Every head output (and the loss, with labels) must have max abs diff = 0, and transformers must
report zero missing, unexpected or mismatched keys. Both models' weights sit on 64-byte boundaries while
they run (`realign`): a BLAS may pick its kernel, and so its summation order, by an operand's address.
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.errors import KilnError
from kiln.hub import Tokenizer, load_weights
from kiln.hub.fp8 import scheme_from_config
from kiln.interop.fp8_verify import load_transformers_fp8
from kiln.models.auto import load_config, load_pretrained
from kiln.models.tasks import Task, get_task

OUTPUTS = ("last_hidden_state", "pooler_output", "logits", "start_logits", "end_logits", "loss")
PROMPTS = [
    "Paris is the capital of France.",
    "The king and the queen walked by the river at night.",
    "a dog",
]


@dataclass
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  {self.name}: {self.detail}"


def _batches(tokenizer: Tokenizer | None, vocab_size: int, use_types: bool, seed: int = 0) -> list[dict]:
    """A short unpadded batch, a padded batch, and (where token types exist) a padded pair batch."""
    if tokenizer is not None:
        mask = tokenizer.mask_token
        prompts = [p.replace("capital", mask) if mask else p for p in PROMPTS]
        batches = [tokenizer.encode(prompts[:1]), tokenizer.encode(prompts)]
        if use_types:
            batches.append(tokenizer.encode(prompts, pairs=list(reversed(prompts))))
    else:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(5, vocab_size, (3, 11), generator=g)
        attn = torch.ones_like(ids)
        attn[1, 7:] = 0
        attn[2, 4:] = 0
        batches = [{"input_ids": ids[:1], "attention_mask": attn[:1]}, {"input_ids": ids, "attention_mask": attn}]
        if use_types:
            types = torch.zeros_like(ids)
            types[:, 5:] = 1
            batches.append({"input_ids": ids, "attention_mask": attn, "token_type_ids": types * attn})
    for b in batches:
        if not use_types:
            b.pop("token_type_ids", None)
    return batches


def _value(out, name: str):
    return getattr(out, name, None) if not isinstance(out, dict) else out.get(name)


ALIGN = 64  # bytes: PyTorch's CPU allocator starts every block here, so a fresh copy lands on it


def realign(*models: torch.nn.Module) -> int:
    """Copy each CPU parameter and buffer that does not start on a 64-byte boundary into a fresh block that
    does; the number moved. Why: both loaders hand back weights at whatever address their read left them
    (transformers and kiln alike: 8-byte aligned safetensors offsets, blocks cut from one read buffer), and
    MKL's single-row product (a `Linear(dim, 1)` such as Qwen's `shared_expert_gate`, a GEMV) sums in another
    order when the weight is not 16-byte aligned on some CPUs (AMD EPYC with AVX-512: a few 1e-7 apart;
    with `MKL_CBWR` set, or on CPUs whose kernel ignores alignment, the same). Equal values at equal
    alignment leave the comparison to the operations alone, whichever kernels the CPU selects."""
    moved = 0
    for model in models:
        for t in [*model.parameters(), *model.buffers()]:
            if t.device.type == "cpu" and t.layout == torch.strided and t.numel() and t.data_ptr() % ALIGN:
                t.data = t.data.clone()  # same strides, a fresh (aligned) allocation
                moved += 1
    return moved


def compare_models(kiln_model, hf_model, task: Task, config, batches: list[dict], seed: int = 0,
                   device: torch.device | str = "cpu") -> list[Check]:
    """Run each batch (with labels where the head has a loss) through both models, which sit on `device`;
    diff every output. Both models' weights are realigned first (`realign`)."""
    realign(kiln_model, hf_model)
    accepted = set(inspect.signature(hf_model.forward).parameters)
    g = torch.Generator().manual_seed(seed)
    checks = []
    for i, batch in enumerate(batches):
        inputs = {k: v for k, v in batch.items() if k in accepted}
        if "pixel_values" in batch and "pixel_values" not in inputs:  # an image batch must reach it as one
            checks.append(Check(f"batch {i} images", False, f"{type(hf_model).__name__} takes no pixel_values"))
            continue
        inputs.update(task.verify_labels(batch, config, g))
        inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in inputs.items()}
        with torch.no_grad():
            ours, theirs = kiln_model(**inputs), hf_model(**inputs)
        for name in OUTPUTS:
            a, b = _value(ours, name), _value(theirs, name)
            if b is None:  # transformers does not return it for this head (kiln may, e.g. hidden states)
                continue
            if a is None or b is None or a.shape != b.shape:
                checks.append(Check(f"batch {i} {name}", False, f"kiln {None if a is None else tuple(a.shape)} "
                                                                   f"vs transformers {None if b is None else tuple(b.shape)}"))
                continue
            diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
            checks.append(Check(f"batch {i} {name}", diff == 0.0 and a.dtype == b.dtype,
                                f"shape {tuple(a.shape)} {str(a.dtype).replace('torch.', '')}, max abs diff {diff:g}"))
    return checks


def compare_weights(exported: str | os.PathLike, source: str | os.PathLike) -> Check:
    """Same tensor names, dtypes and bytes in both directories."""
    a, b = load_weights(exported), load_weights(source)
    if set(a) != set(b):
        only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
        return Check("tensors equal source", False, f"only in export: {only_a[:5]}, only in source: {only_b[:5]}")
    bad = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
           or not torch.equal(a[k].view(torch.uint8) if a[k].dtype.is_floating_point else a[k],
                              b[k].view(torch.uint8) if b[k].dtype.is_floating_point else b[k])]
    return Check("tensors equal source", not bad, f"{len(a)} tensors, names/dtypes/bytes identical" if not bad
                 else f"differ: {bad[:5]}")


def _beyond_the_layers(unexpected: list[str], layers: int | None) -> tuple[list[str], int]:
    """Split off the multi-token-prediction layers DeepSeek-style checkpoints keep after the last decoder
    layer (`model.layers.{n}.*`, n >= num_hidden_layers): transformers skips them only at the index of the
    full-size release (61, 78), so a smaller export reports them as unexpected though nothing is wrong."""
    if layers is None:
        return list(unexpected), 0
    beyond = [k for k in unexpected if (m := re.match(r"(?:model\.)?layers\.(\d+)\.", k)) and int(m.group(1)) >= layers]
    return [k for k in unexpected if k not in beyond], len(beyond)


def verify_export(model_dir: str | os.PathLike, source: str | os.PathLike | None = None,
                  device: str = "cpu") -> list[Check]:
    """All checks for one exported directory, both models run on `device` (cpu, cuda, cuda:1); the caller
    decides how to print them."""
    try:
        import transformers
    except ImportError:
        raise KilnError("verify-export needs transformers: pip install 'kiln[verify]'") from None
    model_dir = Path(model_dir)
    family, config, source_task = load_config(model_dir)
    task = get_task(source_task)
    kiln_model = load_pretrained(model_dir, task=task)
    # A model that takes images is checked against transformers' class that takes them too (for an image-text
    # causal LM, `...ForConditionalGeneration`): the text-only class the causal-LM Auto class maps it to drops
    # pixel_values from the signature, and the image batch would reach neither model as an image.
    auto = getattr(transformers, family.tasks[task].architecture) if getattr(kiln_model, "takes_images", False) \
        else getattr(transformers, task.hf_auto)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    scheme = scheme_from_config(config.extra, str(model_dir / "config.json"))
    if scheme is None:
        hf_model, info = auto.from_pretrained(str(model_dir), output_loading_info=True)
        how = ""
    else:  # block-scaled FP8: both sides compute with transformers' dequantization (kiln.interop.fp8_verify)
        hf_model, info, how = load_transformers_fp8(auto, model_dir, scheme)
        how = f" (FP8 dequantized by {how})"
    hf_model.eval()
    unexpected, mtp = _beyond_the_layers(info["unexpected_keys"], getattr(config, "num_hidden_layers", None))
    checks = [Check(f"transformers loads {type(hf_model).__name__}{how}",
                    not (info["missing_keys"] or unexpected or info["mismatched_keys"]),
                    f"missing {sorted(info['missing_keys'])[:5] or 0}, unexpected {sorted(unexpected)[:5] or 0}, "
                    f"mismatched {sorted(info['mismatched_keys'])[:5] or 0}"
                    + (f"; {mtp} multi-token-prediction tensors past the last layer kept (transformers does not "
                       f"load them)" if mtp else ""))]
    use_types = getattr(config, "type_vocab_size", 0) > 1
    batches = _batches(kiln_model.tokenizer, config.vocab_size, use_types) if hasattr(config, "vocab_size") else []
    own_batches = getattr(kiln_model, "verify_batches", None)
    if own_batches is not None:  # a model that takes images: its own inputs (FP8 releases too)
        batches = own_batches(batches)
    checks += compare_models(kiln_model.to(device), hf_model.to(device), task, config, batches, device=device)
    if source is not None:
        checks.append(compare_weights(model_dir, source))
    return checks
