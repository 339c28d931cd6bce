"""Tensors a checkpoint lacks (a new head) on a model built from its load plan (kiln.models.loading.plan).

A whole load (`kiln.models.auto.load_pretrained(seed=...)`) seeds the generator, loads the checkpoint's tensors and
initialises those it lacks and the source architecture does not owe (`PreTrainedModel._match_hf`'s fresh ones: the
`lm_head` of a causal LM on a base checkpoint, a classifier on an encoder's) module by module, children first, each
by the generic init then its family's own, as transformers does (`kiln.models.pretrained.draw_fresh`), in the load's
compute dtype. `init_fresh` makes the same draws on the meta-built model: the same modules, in the same order, from
the same seed, whole on the CPU (a classifier is small, `num_labels x hidden`; an untied `lm_head` is one
vocabulary-sized tensor, held whole on each rank until the plans shard it). The values are then
real before the plans: a plan shards them as it shards LoRA's adapters, and `read_shards` keeps them (each rank its
piece); a one-process read copies them to the device. The generator state after the draws is kept in the model's
`deferred_read.fresh_rng` so that `init_adapters` draws the LoRA adapters from where a whole load leaves the
generator, not from the bare seed. A PEFT adapter saved beside the checkpoint (`with_adapter`) is put on as the whole load puts it: its
adapters drawn (then overwritten) as `load_adapter` draws them, its tensors read whole (an adapter is small).

Not taken (False, and the caller loads whole): a new head on a family with its own load (its fresh init runs on the
whole model), a fresh buffer, and a tensor the checkpoint owes but lacks (the whole load names it). FP8 and 4-bit
bases are taken: the draws' dtype is the one the whole load picks from the weights its `load_hf_state_dict` takes
(FP8 pairs, scales and packed bytes say nothing about it), and a head is no backbone Linear (never quantized at load).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kiln.models.common.pretrained import PreTrainedModel, draw_fresh


def init_fresh(model: PreTrainedModel, missing: list[str], seed: int | None,
               match: tuple[dict[str, torch.Tensor], list[str]] | None) -> bool:
    """Initialise `missing` (the model's tensors no checkpoint tensor fills; the model built on meta) as a whole
    load with `seed` initialises them. `match`: (tensors used, fresh names) of the whole load's own matching
    (`PreTrainedModel._match_hf`) run on the headers as its `load_hf_state_dict` takes them (an FP8 base's
    prepared, a bitsandbytes directory's quant state read in; before a quantize at load), None where it failed
    (the whole load raises it, with its message). False when this read cannot (see the module's docstring)."""
    if type(model).load_hf_state_dict is not PreTrainedModel.load_hf_state_dict or model.deferred_read is None \
            or match is None:
        return False
    params = dict(model.named_parameters())
    if any(n not in params for n in missing):
        return False  # a buffer: a whole load leaves it as built
    used, fresh = match
    if sorted(fresh) != sorted(missing):
        return False
    # the load's compute dtype, as PreTrainedModel.load_hf_state_dict picks it
    dtype = next((v.dtype for k, v in used.items() if v.dtype.is_floating_point and v.element_size() > 1
                  and not k.endswith("_scale_inv")), torch.float32)
    if seed is not None:
        torch.manual_seed(seed)  # load_pretrained's first step: nothing draws before the fresh init
    draw_fresh(model, set(fresh), dtype)  # the whole load's draws (_materialise_fresh), on the fresh tensors only
    model.tie_weights()
    keymap = model.family.keymap(model.task)
    model.deferred_read.fresh_names = [keymap.hf_name(k) or k for k in fresh]  # the whole load's report of them
    model.deferred_read.fresh_rng = torch.get_rng_state()
    return True


def with_adapter(model: PreTrainedModel, path: Any, seed: int | None) -> bool:
    """Put the PEFT LoRA adapter saved beside the checkpoint on the meta-built model as a whole load puts it
    (`load_adapter`): its adapters on the modules it names, drawn as `apply_lora` draws them on the loaded model
    (`init_adapters`: from the seed, past a new head's draws), then its tensors, read whole (an adapter is small),
    in their place; real before the plans, which shard them as they shard trained adapters. The generator state
    after is kept (`deferred_read.fresh_rng`) for the next adapters' draws (an FP8 or 4-bit base's too: put on
    its modules as `load_adapter` puts it after the whole load's FP8 modules or quantize). True at once when there is
    no adapter; False on a model not built from a plan."""
    from kiln.models.common.lora import adapter_state, apply_adapter, has_adapter

    if not has_adapter(path):
        return True
    if model.deferred_read is None:
        return False
    tensors = apply_adapter(model, path)
    init_adapters(model, "cpu", seed)
    with torch.no_grad():
        for name, value in adapter_state(model, path, tensors).items():
            model.get_parameter(name).copy_(value)
    model.deferred_read.fresh_rng = torch.get_rng_state()
    return True


def start_draws(model: nn.Module, seed: int | None, device: torch.device | str) -> None:
    """Put the generator where a whole load with `seed` leaves it (after the fresh tensors' draws, if any), and the
    fresh tensors (CPU, whole, before any plan) on `device`: what `init_adapters` draws next, it draws as
    `apply_lora` does on the whole-loaded model."""
    deferred = getattr(model, "deferred_read", None)
    state = deferred.fresh_rng if deferred is not None else None
    if state is None:
        if seed is not None:
            torch.manual_seed(seed)
        return
    torch.set_rng_state(state)
    for p in model.parameters():  # the fresh tensors, an adapter read beside the weights (those to draw are meta)
        if not p.is_meta:
            p.data = p.data.to(device)


def init_adapters(model: nn.Module, device: torch.device | str, seed: int | None) -> int:
    """Materialise and initialise the LoRA adapters of a model built on meta, before any plan shards them,
    drawing exactly what `apply_lora` draws on a loaded model right after `load_pretrained(seed=seed)`
    (a checkpoint without new tensors draws nothing before). Returns how many modules it initialised."""
    from kiln.models.common.lora import LoraLinear
    from kiln.models.common.lora_experts import ExpertLora

    adapters = [m for m in model.modules() if isinstance(m, (LoraLinear, ExpertLora)) and m.lora_A.weight.is_meta]
    start_draws(model, seed, device)  # the seed, then past a new head's draws
    for m in adapters:
        m.lora_A.to_empty(device=device)
        m.lora_B.to_empty(device=device)
        # the draws of LoraLinear.__init__ on a real base: each nn.Linear's own init, then reset_lora
        m.lora_A.reset_parameters()
        m.lora_B.reset_parameters()
        m.reset_lora()
    return len(adapters)

