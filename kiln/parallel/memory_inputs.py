"""The inputs of `kiln plan` (kiln.parallel.memory): the model's dimensions from config.json, the run's
settings, and the parameters a run holds, made from the checkpoint's safetensors headers (no weights),
whose shapes are checked against config.json. No torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from kiln.errors import ConfigError, WeightsError
from kiln.parallel import memory_q4

# a main block's index; a release's MTP module under `mtp.` (Qwen3.5's mtp.layers.0, DeepSeek-V4's) is no block of
# the model: FSDP2 shards it with the root, as it does every module outside the blocks
_LAYER = re.compile(r"^(?!mtp\.)(?:.*\.)?layers\.(\d+)\.")
# The Linears a tensor-parallel plan splits (column: q/k/v, gate/up; row: o, down); experts are not split by tp.
_TP_LINEARS = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_b_proj",
               "kv_b_proj", "embed_tokens", "lm_head"}
MLP_TARGETS = {"gate_proj", "up_proj"}
QKV_TARGETS = {"q_proj", "k_proj", "v_proj"}


@dataclass(frozen=True)
class ModelDims:
    """What the activation formula needs from config.json."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0
    qk_norm: bool = False
    # multi-head latent attention (DeepSeek-V3, GLM-5): a query head's width (qk_nope + qk_rope) and a value head's,
    # which size q_proj's rows and o_proj's columns; 0: head_dim
    q_head_dim: int = 0
    v_head_dim: int = 0
    # q_proj emits a sigmoid output gate per head beside the query (twice the rows): declared by the family
    # (FamilyConfig.attn_output_gate: Qwen3-Next, Qwen3.5), not by config.json
    output_gate: bool = False

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any], source: str = "config.json", output_gate: bool = False
                    ) -> ModelDims:
        cfg = dict(cfg.get("text_config") or {}, **{k: v for k, v in cfg.items() if k != "text_config"}) \
            if isinstance(cfg.get("text_config"), dict) else dict(cfg)

        def get(*names: str, default: Any = None) -> Any:
            for n in names:
                if cfg.get(n) is not None:
                    return cfg[n]
            if default is None:
                raise ConfigError(f"{source}: no {' / '.join(names)}; kiln plan needs it for the activation estimate")
            return default

        hidden = int(get("hidden_size", "d_model", "dim"))
        heads = int(get("num_attention_heads", "n_heads"))
        return cls(hidden=hidden, layers=int(get("num_hidden_layers", "n_layers")), heads=heads,
                   kv_heads=int(get("num_key_value_heads", default=heads)),
                   head_dim=int(get("head_dim", default=hidden // heads)),
                   intermediate=int(get("intermediate_size", "hidden_dim", default=4 * hidden)),
                   vocab=int(get("vocab_size")),
                   experts=int(get("num_experts", "n_routed_experts", "num_local_experts", default=0)),
                   top_k=int(get("num_experts_per_tok", default=0)),
                   moe_intermediate=int(get("moe_intermediate_size", default=0)),
                   # DeepSeek-V3's n_shared_experts fused into one MLP of moe_intermediate_size each
                   shared_intermediate=int(get("shared_expert_intermediate_size", default=0))
                   or int(get("n_shared_experts", default=0)) * int(get("moe_intermediate_size", default=0)),
                   q_head_dim=int(get("qk_nope_head_dim", default=0)) + int(get("qk_rope_head_dim", default=0)),
                   v_head_dim=int(get("v_head_dim", default=0)), output_gate=output_gate)


@dataclass(frozen=True)
class Param:
    """One tensor the run holds: a checkpoint tensor or a LoRA adapter."""
    name: str
    numel: int
    itemsize: int
    trainable: bool
    block: int | None = None      # its layer index, None outside the blocks
    expert: bool = False          # a routed expert's (split by ep)
    tp: bool = False              # split by tensor parallelism
    module: str = ""              # the Linear it belongs to (leaf name), for the LoRA activation terms
    whole: bool = False           # a buffer FSDP2 leaves whole on every rank (a 4-bit weight's quant state)
    q4_shape: tuple[int, int] | None = None  # a 4-bit weight's packed bytes: the (out, in) it dequantizes to
    # a tensor the family carries beside the model (an MTP layer's, kiln.parallel.sharded_carried): never trained;
    # a read shard by shard holds it by reference (no bytes), a whole load whole on every rank
    carried: bool = False

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True)
class RunSettings:
    nproc: int = 1
    device: str = "cpu"                       # cpu or cuda
    batch_size: int = 1                       # per process, per micro-batch
    seq_len: int = 128
    precision: str = "fp32"
    exact: bool = False
    lora_r: int | None = None                 # None: full fine-tune
    lora_targets: tuple[str, ...] | str = ("q_proj", "v_proj")
    dp: int = 0
    tp: int = 1
    ep: int = 1
    pp: int = 1
    cp: int = 1
    fsdp: bool = False
    offload: bool = False
    param_dtype: str | None = None
    reduce_dtype: str = "fp32"
    sequence_parallel: bool = True
    activation_checkpointing: str = "none"
    checkpoint_every: int = 1
    microbatches: int = 0
    pp_schedule: str = "1f1b"
    pp_stages: tuple[int, ...] | None = None
    keep_grads: bool = False                  # [parallel.cadence]: gradients zeroed, not freed, between steps
    fp8: str = "dequantize"                   # model.fp8: an FP8 checkpoint dequantized to bf16, or kept FP8
    quantize: str | None = None               # model.quantize: "nf4" | "fp4", the Linears quantized at load
    q4_compute: str | None = None             # a 4-bit base's compute dtype (bf16, fp16, fp32); None: no 4-bit base
    # why this checkpoint loads whole on every rank whatever the plans (kiln.parallel.sharded_load.read_plan: an FP8
    # or 4-bit .bin, a .bin carrying an MTP layer, ...); None: the plans that split the weights read shards
    loads_whole: str | None = None

    def degrees(self) -> dict[str, int]:
        rest = self.tp * self.ep * self.pp * self.cp
        dp = self.dp or (self.nproc // rest if self.nproc % rest == 0 else 0)
        if dp < 1 or dp * rest != self.nproc:
            raise ConfigError(f"parallel degrees dp ({self.dp}) x tp ({self.tp}) x ep ({self.ep}) x pp ({self.pp}) x "
                             f"cp ({self.cp}) do not multiply to --nproc {self.nproc}")
        return {"dp": dp, "tp": self.tp, "ep": self.ep, "pp": self.pp, "cp": self.cp}

    @property
    def reads_shards(self) -> bool:
        """The plans split the weights, so each rank reads its share (kiln.train.recipes.base.shards_weights) and
        holds what the family carries (MTP layers) by reference; one process, DDP and a checkpoint that `loads_whole`
        load whole."""
        return self.nproc > 1 and (self.fsdp or self.tp > 1 or self.ep > 1 or self.pp > 1) \
            and self.precision != "fp8" and self.loads_whole is None

    def describe(self) -> str:
        d = self.degrees()
        parts = [f"{k}={v}" for k, v in d.items() if v > 1 or k == "dp"]
        if self.fsdp:
            parts.append("fsdp" + (" +offload" if self.offload else ""))
        if self.activation_checkpointing != "none":
            parts.append(f"ac={self.activation_checkpointing}")
        return " ".join(parts)


# ---- parameters from headers ------------------------------------------------------------------------
def _module_of(name: str) -> str:
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else parts[0]


def _lora_match(name: str, targets: tuple[str, ...] | str) -> bool:
    """kiln.models.common.lora's rule: a target matches a module name or its '.'-suffix; all-linear: every
    Linear but the LM head (2-D weights here, the embedding excluded)."""
    module = name.rsplit(".", 1)[0]
    if targets == "all-linear" or targets == ("all-linear",):
        return _module_of(name) not in ("lm_head", "embed_tokens") and not module.endswith("embeddings")
    return any(module == t or module.endswith("." + t) for t in targets)


def params_from_headers(tensors: Iterable[Any], settings: RunSettings,
                        q4_shapes: Mapping[str, tuple[int, ...]] | None = None,
                        carried: Iterable[str] = ()) -> list[Param]:
    """The run's parameters: every checkpoint tensor (`TensorHeader`-like: name, shape, dtype, nbytes, numel),
    trainable when the run is a full fine-tune, plus LoRA A (r, in) and B (out, r) for each targeted weight
    (in the base's compute dtype: an FP8 base's adapters are bf16), everything else frozen under LoRA.

    A 4-bit base (kiln.parallel.memory_q4): with `q4_shapes` (a bitsandbytes directory: packed weight name ->
    the shape its quant-state JSON gives) its packed weights and quant state as stored; with `settings.quantize`
    the Linears quantized at load become their packed bytes and quant state. Frozen; adapters over them float32.

    `carried`: the checkpoint tensors the family carries beside the model (kiln.parallel.sharded_load.carried_keys),
    frozen, without adapters, marked `carried`."""
    from kiln.hub.headers import FLOAT_DTYPES  # kiln.hub: below parallel in the layers

    out: list[Param] = []
    lora = settings.lora_r is not None
    tensors = list(tensors)
    fp8 = any(t.dtype.startswith("F8") and t.name.endswith(".weight") for t in tensors)
    if q4_shapes:
        q4 = memory_q4.bnb_weights({t.name: t for t in tensors}, q4_shapes)
    else:
        q4 = memory_q4.quantized_at_load(tensors) if settings.quantize else {}
    carried = set(carried)
    for t in tensors:
        m = _LAYER.search(t.name)
        block = int(m.group(1)) if m else None
        if t.name in carried:
            out.append(Param(t.name, t.numel, t.nbytes // max(t.numel, 1), False, block, module=_module_of(t.name),
                             carried=True))
            continue
        if q4_shapes and memory_q4.is_state(t.name):  # a bitsandbytes directory's quant state, held as stored
            out.append(Param(t.name, t.numel, t.nbytes // max(t.numel, 1), False, block,
                             module=_module_of(t.name.split(".weight.")[0] + ".weight"), whole=True))
            continue
        if t.name in q4:
            out += _q4_params(t, q4[t.name], block, settings, bool(q4_shapes))
            continue
        if fp8 and settings.fp8 == "dequantize" and t.name.endswith("_scale_inv"):
            continue  # dequantized on load: the block scales are folded into the weights and dropped
        module = _module_of(t.name)
        expert = ".experts." in t.name
        is_float = t.dtype in FLOAT_DTYPES
        item = t.nbytes // max(t.numel, 1)
        if t.dtype.startswith("F8") and settings.fp8 == "dequantize":
            item = 2  # to the checkpoint's other dtype (bf16 in the FP8 releases)
        weight2d = t.name.endswith(".weight") and len(t.shape) == 2
        kept_fp8 = item == 1 and is_float  # an FP8 weight kept FP8 (model.fp8 = "keep") is a frozen base
        out.append(Param(t.name, t.numel, item, trainable=is_float and not lora and not kept_fp8, block=block,
                         expert=expert,
                         tp=module in _TP_LINEARS and not expert, module=module))
        if lora and weight2d and _lora_match(t.name, settings.lora_targets):
            rows, cols = t.shape
            adapter_item = item if item >= 2 else 2
            stem = t.name[: -len(".weight")]
            out.append(Param(stem + ".lora_A.weight", settings.lora_r * cols, adapter_item, True, block, expert,
                             tp=False, module=module))
            out.append(Param(stem + ".lora_B.weight", rows * settings.lora_r, adapter_item, True, block, expert,
                             tp=False, module=module))
    return out


def _q4_params(t: Any, w: Any, block: int | None, settings: RunSettings, stored: bool) -> list[Param]:
    """A 4-bit weight's packed bytes (FSDP2 shards them), and unless `stored` (a bitsandbytes directory lists its
    own) its quant state, whole on every rank; float32 LoRA adapters where targeted."""
    module = _module_of(t.name)
    expert = ".experts." in t.name
    out = [Param(t.name, -(-w.numel // 2), 1, False, block, expert, module=module, q4_shape=w.shape)]
    if not stored:
        dtype = {"BF16": "bfloat16", "F16": "float16"}.get(t.dtype, "float32")
        size = memory_q4.json_bytes(w, settings.quantize or "nf4", dtype)
        for suffix, nbytes in memory_q4.state_bytes(w, size).items():
            out.append(Param(t.name + suffix, nbytes, 1, False, block, expert, module=module, whole=True))
    if settings.lora_r is not None and _lora_match(t.name, settings.lora_targets):
        rows, cols = w.shape
        stem = t.name[: -len(".weight")]
        out.append(Param(stem + ".lora_A.weight", settings.lora_r * cols, 4, True, block, expert, module=module))
        out.append(Param(stem + ".lora_B.weight", rows * settings.lora_r, 4, True, block, expert, module=module))
    return out


def check_shapes(tensors: Mapping[str, Any], dims: ModelDims, source: str = "config.json") -> ModelDims:
    """The headers' shapes against config.json (embedding, head, attention and MLP Linears, layer count);
    returns `dims` with what only the headers say (per-head q/k norms). A disagreement is a WeightsError
    naming the tensor, its file, both shapes and the config fields behind the expected one."""
    q, kv, h = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim, dims.hidden
    cfg = f"hidden_size={h}, num_attention_heads={dims.heads}, num_key_value_heads={dims.kv_heads}, " \
          f"head_dim={dims.head_dim}"
    q_cfg = o_cfg = cfg
    o = q
    if dims.q_head_dim:  # latent attention: no k_proj / v_proj; a query head qk_nope + qk_rope wide
        q, q_cfg = dims.heads * dims.q_head_dim, f"hidden_size={h}, num_attention_heads={dims.heads}, " \
                                                 f"qk_nope_head_dim + qk_rope_head_dim={dims.q_head_dim}"
    if dims.output_gate:  # [query | gate] per head
        q, q_cfg = 2 * q, q_cfg + " (query and output gate: twice the rows)"
    if dims.v_head_dim:  # and o_proj reads the heads' values, v_head_dim each
        o, o_cfg = dims.heads * dims.v_head_dim, f"hidden_size={h}, num_attention_heads={dims.heads}, " \
                                                 f"v_head_dim={dims.v_head_dim}"
    expect: dict[str, tuple[tuple[int, ...], str]] = {
        "embed_tokens": ((dims.vocab, h), f"vocab_size={dims.vocab}, hidden_size={h}"),
        "lm_head": ((dims.vocab, h), f"vocab_size={dims.vocab}, hidden_size={h}"),
        "q_proj": ((q, h), q_cfg), "k_proj": ((kv, h), cfg), "v_proj": ((kv, h), cfg), "o_proj": ((h, o), o_cfg)}
    for name, t in tensors.items():
        if not name.endswith(".weight"):
            continue
        module = _module_of(name)
        want = expect.get(module)
        if module in ("gate_proj", "up_proj", "down_proj"):
            inter, field_ = dims.intermediate, f"intermediate_size={dims.intermediate}"
            if ".experts." in name:
                inter, field_ = dims.moe_intermediate, f"moe_intermediate_size={dims.moe_intermediate}"
            elif ".shared_expert." in name or ".shared_experts." in name:
                inter, field_ = dims.shared_intermediate, (
                    f"shared_expert_intermediate_size={dims.shared_intermediate}" if ".shared_expert." in name
                    else f"n_shared_experts x moe_intermediate_size={dims.shared_intermediate}")
            if inter:
                want = ((h, inter) if module == "down_proj" else (inter, h), f"hidden_size={h}, {field_}")
        if want is not None and tuple(t.shape) != want[0]:
            raise WeightsError(f"{t.file}: tensor {name} has shape {list(t.shape)} but {source} ({want[1]}) "
                               f"implies {list(want[0])}")
    layers = {int(m.group(1)) for name in tensors if (m := _LAYER.search(name))}
    if layers and max(layers) + 1 < dims.layers:
        raise WeightsError(f"the checkpoint holds {max(layers) + 1} layers (model.layers.0..{max(layers)}) but "
                           f"{source} says num_hidden_layers={dims.layers}")
    return replace(dims, qk_norm=any(_module_of(n) == "q_norm" for n in tensors))
