"""4-bit bases in `kiln plan` (kiln.parallel.memory): what a QLoRA run holds for its NF4 / FP4 Linears.

Two ways a run gets a 4-bit base: `[model] quantize = "nf4" | "fp4"` on a bf16/fp32 checkpoint (quantized at load,
double-quantized), or a bitsandbytes-4bit directory (config.json `quantization_config.quant_method =
"bitsandbytes"`), read as it is. Either way a weight of n values is held as (kiln.models.common.quant4.Linear4):

- the packed bytes, ceil(n / 2) uint8: a frozen parameter, which FSDP2 shards like any other (a run of bytes
  per rank, kiln.parallel.sharded_q4);
- its quant state, buffers FSDP2 leaves whole on every rank: absmax, one per block of 64 values (one byte
  double-quantized, else float32: n / 64 or n / 16 bytes), the 16-entry float32 code, with double quant the
  nested absmax (float32, one per 256 blocks) and the 256-entry nested code, and the quant-state JSON.

Which Linears: `quant4.quantizable`'s, read off the headers: every 2-D `.weight` of the backbone (`model.`) but
the embedding, the head and routed experts (stacked, not Linears); a bitsandbytes directory says which itself
(the tensors with a quant state). The LoRA adapters over them are float32, as PEFT makes them.

Per matmul each weight is dequantized into the compute dtype, forward and backward (`quant4.matmul_weight`): on
CPU into one buffer per weight shape kept for the thread's life (all of them live at once), through chunk
temporaries of `quant4._CHUNK_BYTES` packed bytes (int32 index + int64 value pairs + the chunk's absmax: the
torch path's; the C kernel of kiln.hub.native4 needs none, but whether it builds shows only at run time: 6 MiB
counted), beside the float32 adapter path's scratch (`quant4.scratch`: x as float32, the update in float32 and in the compute
dtype, each grown to the largest Linear); on a GPU a fresh dequantized tensor and its whole-weight temporaries per
matmul, the largest weight's at a time. No torch here.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

BLOCKSIZE, NESTED_BLOCKSIZE = 64, 256          # kiln.hub.bnb4
CHUNK_BYTES = 1 << 19                          # kiln.models.common.quant4._CHUNK_BYTES
CHUNK_VALUES = 1 << 18                         # kiln.parallel.sharded_q4.CHUNK_VALUES
QUANTIZE_BYTES_PER_VALUE = 30                  # bnb4.quantize's temporaries per value (sharded_q4's measure)
STATE_SUFFIXES = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", ".quant_state.bitsandbytes__nf4",
                  ".quant_state.bitsandbytes__fp4")
_HALF = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass(frozen=True)
class Q4Weight:
    """One weight held in 4 bits: its logical shape and how its absmax is stored."""
    shape: tuple[int, int]
    double_quant: bool

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def state_bytes(w: Q4Weight, json_bytes: int) -> dict[str, int]:
    """The quant-state buffers of one weight by suffix (Linear4's buffers), bytes."""
    blocks = -(-w.numel // BLOCKSIZE)
    out = {".absmax": blocks * (1 if w.double_quant else 4), ".quant_map": 16 * 4}
    if w.double_quant:
        out[".nested_absmax"] = -(-blocks // NESTED_BLOCKSIZE) * 4
        out[".nested_quant_map"] = 256 * 4
    out[".quant_state"] = json_bytes
    return out


def json_bytes(w: Q4Weight, quant_type: str, dtype: str) -> int:
    """The length of the quant-state JSON bnb4.Quant4.state_json writes (the offset, a float's repr, taken at
    a typical 20 characters; the real one differs by a few bytes)."""
    out: dict[str, Any] = {"quant_type": quant_type, "blocksize": BLOCKSIZE, "dtype": dtype, "shape": list(w.shape)}
    if w.double_quant:
        out.update(nested_blocksize=NESTED_BLOCKSIZE, nested_dtype="float32", nested_offset=0.012345678901234567)
    return len(json.dumps(out).encode("utf-8"))


def quantized_at_load(tensors: Iterable[Any]) -> dict[str, Q4Weight]:
    """The checkpoint weights `[model] quantize` turns 4-bit (quant4.quantizable from the headers): every 2-D
    float `.weight` under `model.` but the embedding, the head and routed experts; double-quantized."""
    out = {}
    for t in tensors:
        module = t.name.rsplit(".", 2)[-2] if t.name.count(".") >= 1 else ""
        if (t.name.startswith("model.") and t.name.endswith(".weight") and len(t.shape) == 2
                and t.dtype in ("BF16", "F16", "F32") and module not in ("embed_tokens", "lm_head")
                and not module.endswith("embeddings") and ".experts." not in t.name):
            out[t.name] = Q4Weight((int(t.shape[0]), int(t.shape[1])), True)
    return out


def bnb_weights(tensors: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Q4Weight]:
    """A bitsandbytes-4bit directory's 4-bit weights: each packed `<m>.weight` with a quant state, its logical
    shape from that state's JSON (`shapes`, read by the caller)."""
    out = {}
    for name, shape in shapes.items():
        if len(shape) != 2:
            continue  # kiln holds 4-bit weights in Linears only; the load names any other
        out[name] = Q4Weight((int(shape[0]), int(shape[1])), f"{name}.nested_absmax" in tensors)
    return out


def is_state(name: str) -> bool:
    """A quant-state tensor of a bitsandbytes directory (`<m>.weight.absmax`, ...)."""
    return ".weight." in name and name.endswith(STATE_SUFFIXES)


def compute_dtype(hf_config: Mapping[str, Any], quantize: str | None, tensors: Iterable[Any]) -> str | None:
    """The 4-bit base's compute dtype (bf16 / fp16 / fp32): a bitsandbytes directory's bnb_4bit_compute_dtype
    (float32 when unset, as bitsandbytes), or the stored dtype of the weights quantized at load; None: no 4-bit."""
    q = hf_config.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == "bitsandbytes":
        return _HALF.get(str(q.get("bnb_4bit_compute_dtype") or "float32").removeprefix("torch."), "fp32")
    if quantize:
        weights = quantized_at_load(tensors)
        dtypes = {t.dtype for t in tensors if t.name in weights}
        return {"BF16": "bf16", "F16": "fp16"}.get(next(iter(sorted(dtypes)), "F32"), "fp32")
    return None


def scratch_bytes(weights: Iterable[tuple[tuple[int, int], float]], cb: int, tokens: float, adapted: Iterable[
                  tuple[int, int]], device: str) -> float:
    """The dequantization scratch while training: `weights` the (shape, share) of this rank's 4-bit weights
    (share 0: not on this pipeline stage), `adapted` the (out, in) of those with LoRA adapters, `cb` the compute
    dtype's bytes, `tokens` per micro-batch."""
    shapes = {shape for shape, f in weights if f > 0}
    if not shapes:
        return 0.0
    if device != "cpu":  # a fresh dequantized weight with its whole-weight temporaries (int32 + int64 per byte)
        n = max(a * b for a, b in shapes)
        return n * cb + (n // 2) * 12 + -(-n // BLOCKSIZE) * 4
    buffers = sum(a * b * cb for a, b in shapes)  # quant4.matmul_weight: one per (shape, dtype), all kept
    largest = max(-(-a * b // 2) for a, b in shapes)
    chunk = min(largest, max(NESTED_BLOCKSIZE * BLOCKSIZE // 2, CHUNK_BYTES))  # packed bytes per chunk
    temporaries = chunk * (4 + 8) + chunk // (BLOCKSIZE // 2) * 4
    adapted = list(adapted)
    lora = 0.0
    if adapted:  # qlora.QLoraUpdateFn's scratch: "lora_x" (T, in) and "lora_up" (T, out) float32, "lora_up_x" (T, out)
        lora = tokens * (max(i for _, i in adapted) * 4 + max(o for o, _ in adapted) * (4 + cb))
    return buffers + temporaries + lora


def load_transient(largest: int, stored_item: int, world: int, quantize: bool) -> float:
    """What a weight's quantize at load holds beside the model (sharded_q4._quantize_rows): one chunk of stored
    values and bnb4.quantize's temporaries of it, the float32 absmax of every block of the weight, and (sharded)
    the all-gathered pieces and their concatenation. 0 for a bitsandbytes directory (read as bytes)."""
    if not quantize or not largest:
        return 0.0
    values = min(CHUNK_VALUES, largest)
    absmax = -(-largest // BLOCKSIZE) * 4
    return values * (stored_item + QUANTIZE_BYTES_PER_VALUE) + absmax * (1 + (world + 1 if world > 1 else 0))
