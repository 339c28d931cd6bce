"""Inputs and the exact comparison shared by the causal-LM parity tests (not a test module)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import kiln.engine  # noqa: F401  (kiln models generate on the engine, which registers itself on import)


def batches() -> list[dict]:
    """One short row; a batch with labels; the same with right and left padding (padding has no loss)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(4, 99, (3, 13), generator=g)
    attn = torch.ones_like(ids)
    attn[1, 9:] = 0   # right padding
    attn[2, :4] = 0   # left padding
    labels = ids.clone()
    labels[attn == 0] = -100
    labels[0, :5] = -100  # a prompt part without loss
    return [{"input_ids": ids[:1, :6]}, {"input_ids": ids, "labels": labels},
            {"input_ids": ids, "attention_mask": attn, "labels": labels}]


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    """Bit-identical: same shape, dtype and values (rtol = atol = 0)."""
    assert a.shape == b.shape and a.dtype == b.dtype, what
    torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def changed_copy(src: Path, dst: Path, change: Callable[[str, torch.Tensor, torch.Generator], torch.Tensor | None]) -> Path:
    """A copy of the checkpoint `src` at `dst` in which `change(name, tensor, generator)` replaces tensors
    (None: kept); one seeded generator serves every call, in the file's order."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = load_file(str(dst / "model.safetensors"))
    g = torch.Generator().manual_seed(11)
    for k, v in weights.items():
        new = change(k, v, g)
        if new is not None:
            weights[k] = new
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def model_pair(src: Path, eos: bool = True):
    """(kiln, transformers) causal LMs loaded from `src`; eos=False: both generate the full length (random
    tiny models emit the EOS id early). Both realigned (kiln.interop.verify.realign): compared bit for bit."""
    import transformers

    from kiln.interop.verify import realign
    from kiln.models import AutoModelForCausalLM

    ours, hf = AutoModelForCausalLM.from_pretrained(src), transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    if not eos:
        ours.config.eos_token_id = hf.generation_config.eos_token_id = None
    realign(ours, hf)
    return ours, hf


def same_greedy_tokens(ours, hf, inputs: list[dict], new: int = 20) -> torch.Tensor:
    """`new` greedy tokens (no EOS stop) from kiln's and transformers' generate are equal, for each input;
    returns the last input's generated rows."""
    for kw in inputs:
        a = ours.generate(**kw, max_new_tokens=new, eos_token_id=None, pad_token_id=0)
        b = hf.generate(**kw, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert a.shape == (kw["input_ids"].shape[0], kw["input_ids"].shape[1] + new)
        if not torch.equal(a, b):
            near_tie_at_parting(hf, kw, a, b)
    return a


def near_tie_at_parting(hf, kw: dict, a: torch.Tensor, b: torch.Tensor) -> None:
    """kiln's generate runs on the generation engine, whose logits are the training forward's to fp32 rounding
    (its batch-invariant kernels sum in another order): two greedy runs may part only where transformers' own
    top two logits are that close. Checked at the first token where they part (after it the prompts differ)."""
    width = kw["input_ids"].shape[1]
    for r in range(a.shape[0]):
        cols = (a[r] != b[r]).nonzero()
        if not len(cols):
            continue
        c = int(cols[0])
        mask = kw.get("attention_mask")
        m = None if mask is None else torch.cat([mask[r:r + 1], torch.ones(1, c - width, dtype=mask.dtype)], 1)
        with torch.no_grad():
            logits = hf(b[r:r + 1, :c], attention_mask=m).logits[0, -1].float()
        gap = float(logits.max() - logits[a[r, c]])
        # fp32 rounding of a few thousand-term sums over the tiny model, times 10 for headroom
        bound = 64 * torch.finfo(torch.float32).eps * float(logits.abs().max()) * 10
        assert gap <= bound, (f"row {r} parts at token {c}: kiln chose {int(a[r, c])}, transformers "
                              f"{int(b[r, c])}, {gap:.3g} below its best (bound {bound:.3g})", a.tolist(), b.tolist())
