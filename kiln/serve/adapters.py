"""Several LoRA adapters over one base: one model per adapter whose base tensors ARE the base model's tensors.

The engine runs one model, so each adapter gets its own Engine over its own module tree: a copy of the base's
modules that shares every parameter and buffer with the base (no second copy of the weights), with the adapter's
LoraLinears put on it. A request naming an adapter is computed exactly as that adapter loaded alone would compute it
(the same code, the same tensors); only the adapters' small matrices and each engine's KV cache are extra memory.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

from kiln.errors import KilnError
from kiln.models.common.lora import has_adapter, load_adapter, lora_config_of
from kiln.models.common.pretrained import PreTrainedModel


def parse_lora_flags(flags: list[str]) -> dict[str, Path]:
    """`--lora NAME=ADAPTER_DIR` flags as {name: directory}; a bad flag, a repeated name or a missing adapter named."""
    out: dict[str, Path] = {}
    for flag in flags:
        name, sep, path = flag.partition("=")
        if not sep or not name or not path:
            raise KilnError(f"--lora {flag!r}: want NAME=ADAPTER_DIR (a PEFT adapter directory)")
        if name in out:
            raise KilnError(f"--lora: the name {name!r} is given twice")
        if not has_adapter(path):
            raise KilnError(f"--lora {name}={path}: no adapter_config.json there (want a PEFT LoRA adapter directory)")
        out[name] = Path(path)
    return out


def adapter_model(base: PreTrainedModel, adapter_dir: Path, name: str) -> PreTrainedModel:
    """`base` with the adapter of `adapter_dir` on a copy of its modules that shares all of base's tensors."""
    if lora_config_of(base) is not None:
        raise KilnError(f"--lora {name}: the base model carries a LoRA adapter of its own; serve adapters over a plain "
                        "base (export the merged model first: kiln export)")
    shared: dict[int, object] = {id(t): t for t in itertools.chain(base.parameters(), base.buffers())}
    if base.tokenizer is not None:
        shared[id(base.tokenizer)] = base.tokenizer
    model = copy.deepcopy(base, memo=shared)
    try:
        load_adapter(model, adapter_dir)
    except (RuntimeError, ValueError) as e:  # shapes or names that do not fit this base
        raise KilnError(f"--lora {name}={adapter_dir}: does not fit the base model ({e})") from None
    return model.eval()
