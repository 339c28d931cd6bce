"""Predicted peak memory of each rank of a run, from the checkpoint's headers, config.json and the run settings.

A pure function (`plan_memory`): no torch, no weights. Its inputs are the tensors' shapes and dtypes
(kiln.hub.headers), the model's dimensions (`ModelDims`, from config.json) and the run (`RunSettings`,
from the run TOML); its output a `MemoryPlan` whose `RankMemory` rows list the terms of one rank:

- weights: the tensors this rank holds, in their stored dtypes (LoRA adapters in the base's compute dtype),
  divided as the plans divide them: FSDP2 over dp (x cp; x ep for the non-expert tensors), tp by columns
  or rows (embedding and head by vocabulary), ep by experts, pp by stage (embedding on the first, head last);
- gradients and optimizer state: for trainable tensors only, sharded like their weights. kiln's AdamW
  steps the parameters in their own dtype: two moments of the parameter's dtype plus a 4-byte step per
  tensor, and no fp32 master copy (torch.optim.AdamW keeps its state in the parameter's dtype);
- activations: the tensors autograd saves for the backward, per token and block, from the formula in
  `block_activation_bytes` (derived op by op for kiln's decoder blocks and checked against a count of the
  saved tensors in tests/parallel/test_memory_plan.py), times the tokens and blocks in flight, with
  activation checkpointing as configured; plus the loss path;
- communication: DDP's gradient buckets (a second copy of the gradients), FSDP2's gathered blocks (the
  current and the prefetched one, and the root's embedding and head for the whole forward) and one
  block's unsharded gradients in the reduce dtype, tp/ep/pp exchange buffers;
- autocast: train.precision bf16/fp16 over fp32 weights keeps a half-precision copy of every Linear
  weight for the forward;
- dequant: a 4-bit base's per-matmul dequantization buffers (kiln.parallel.memory_q4; its weights count as
  packed bytes, sharded under FSDP2, and quant state, whole on every rank);
- load: the transient of reading the checkpoint. In the sharded-load design one tensor at a time; in
  today's loader (every rank reads all of it, `today=True`) every tensor copied out plus the file mapped
  while it is read;
- allocator: on a CPU run, what glibc's heap keeps of the blocks' freed activations (a measured share of them);
- runtime: the interpreter, torch and kiln themselves (host), or the CUDA context (device).

Gradients and activations are listed both, but the total counts only the larger: they do not coexist.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from kiln.errors import ConfigError
from kiln.parallel import memory_q4
from kiln.parallel.memory_hybrid import HybridDims, deltanet_block_bytes, gated_attention_extra
from kiln.parallel.memory_inputs import (
    MLP_TARGETS,
    QKV_TARGETS,
    ModelDims,
    Param,
    RunSettings,
    check_shapes,
    params_from_headers,
)

__all__ = [
    "MemoryPlan",
    "ModelDims",
    "Param",
    "RankMemory",
    "RunSettings",
    "alternatives",
    "block_activation_bytes",
    "check_shapes",
    "fmt_bytes",
    "params_from_headers",
    "parse_size",
    "plan_memory",
]

GiB = 1024 ** 3
MiB = 1024 ** 2
# What a run costs before any real weights (python, torch, kiln, tokenizer, data, loader): the peak RSS of
# `kiln train` (2 steps of 4 x 256 tokens) on a 2-layer, 32-wide Qwen3 here was 399 MiB (full), 408 MiB (LoRA).
RUNTIME_CPU = 408 * MiB
CUDA_CONTEXT = 512 * MiB              # a CUDA context and cuBLAS workspaces on an H100 (order of magnitude)
LOSS_CHUNK = 64 * MiB                 # kiln.models.common.loss: fp32 logits of one chunk of rows
HOST_STAGE = 64 * MiB                 # kiln.parallel.sharded_stage.HostStage: a GPU read's host buffer
# Peak RSS beyond the live bytes on a CPU run, as a share of the activations: glibc's heap keeps what the
# many small activation tensors free. Measured on a 0.22B Qwen3 (bf16, 4 x 256 tokens): 0.24 GiB over
# 0.60 GiB (LoRA) and 0.33 GiB over 1.08 GiB (full) between default malloc and MALLOC_MMAP_THRESHOLD_=65536.
ALLOCATOR_SHARE = 0.35

TERMS = ("weights", "gradients", "optimizer", "activations", "communication", "autocast", "dequant", "load",
         "allocator", "runtime")


@dataclass
class RankMemory:
    """One rank's predicted peak, by term (bytes); `host` holds what FSDP offload keeps off the device. Terms are
    estimates (fractions of a byte per token add up): whole bytes once `memory_plan` has rounded them."""
    rank: str
    terms: dict[str, float] = field(default_factory=dict)
    host: dict[str, float] = field(default_factory=dict)
    keep_grads: bool = False
    load_peak: int = 0            # the peak while the checkpoint is read, before training (runtime included)
    backward_comm: int = 0        # the part of "communication" that exists only in the backward (FSDP's unit gradients)
    host_load: int = 0            # a device run: host memory while loading (the runtime, and what the read stages)

    @property
    def total(self) -> float:
        """The peak: every term, but gradients and activations do not peak together (kiln zeroes gradients
        with set_to_none, and the backward frees each block's activations as it makes its gradients), so
        only the larger of the two counts (both where the engine keeps zeroed gradients: cadence). FSDP's
        unsharded unit gradients (`backward_comm`) side with the gradients: they exist while a unit's
        gradients are reduced, in the backward."""
        t = self.terms
        return sum(t.values()) - (0 if self.keep_grads else
                                  min(t.get("activations", 0), t.get("gradients", 0) + self.backward_comm))

    @property
    def largest(self) -> str:
        return max(self.terms, key=lambda k: self.terms[k])


@dataclass
class MemoryPlan:
    settings: RunSettings
    ranks: list[RankMemory]
    checkpoint_bytes: int

    @property
    def peak(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)


# ---- activations ------------------------------------------------------------------------------------
def block_activation_bytes(d: ModelDims, cb: int, full: bool, targets: set[str], r: int,
                           moe: bool = False, down_bytes: int | None = None) -> int:
    """Bytes autograd saves per token in one decoder block, by the ops of kiln's blocks.

    `cb` is the compute dtype's bytes; the norms keep their input in fp32 (4 bytes) and their rstd.
    Full fine-tune (every weight trainable): per RMSNorm its fp32 input, the normalized tensor (for the
    weight's gradient) and its output (for the Linears' weight gradients); q/k norms the same per head;
    the rotary outputs and SDPA's output and log-sum-exp; v; gate, up, SiLU(gate) and their product.
    Frozen base (LoRA): no weight gradients, so the norms keep only their input, and their output where
    a LoRA A reads it; the MLP's product only where down_proj has an adapter; each adapter keeps its
    A output (r values) for B's gradient, in `down_bytes` each (default `cb`; float32 over a 4-bit base,
    kiln.models.common.qlora).
    """
    q, kv, i = d.heads * d.head_dim, d.kv_heads * d.head_dim, d.intermediate
    if moe:  # routed experts on top_k copies of the token, the shared expert, and the router's fp32 scores
        i = d.top_k * d.moe_intermediate + d.shared_intermediate
    norm_in = 4
    qn = (norm_in + (cb if full else 0)) if d.qk_norm else 0     # q_norm / k_norm input (+ normalized)
    b = 2 * 4                                                     # the two norms' rstd
    b += d.heads * (4 + (4 if d.qk_norm else 0)) + d.kv_heads * (4 if d.qk_norm else 0)  # lse; q/k rstd
    b += q * (qn + 2 * cb)                                        # (q_norm), rope out, SDPA out
    b += kv * (qn + cb) + kv * cb                                 # k: (k_norm), rope out; v
    if full:
        b += d.hidden * 2 * (norm_in + 2 * cb)                    # two norms: input, normalized, output
        b += 4 * cb * i                                           # gate, up, silu(gate), product
    else:
        b += d.hidden * (2 * norm_in + cb * bool(targets & QKV_TARGETS) + cb * bool(targets & MLP_TARGETS))
        b += 3 * cb * i + cb * i * ("down_proj" in targets)
        b += r * (cb if down_bytes is None else down_bytes) * len(targets)
    if moe:
        b += d.experts * 4 * 2 + d.top_k * d.hidden * cb * 2      # router softmax in/out; tokens dispatched, combined
    if d.output_gate:  # Qwen3-Next / Qwen3.5 GatedAttention (kiln.parallel.memory_hybrid)
        b += gated_attention_extra(d, cb, full, targets)
    return b


# ---- the plan ---------------------------------------------------------------------------------------
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _stage_blocks(layers: int, pp: int, stages: tuple[int, ...] | None) -> list[range]:
    sizes = list(stages) if stages else [layers // pp + (1 if s < layers % pp else 0) for s in range(pp)]
    out, start = [], 0
    for n in sizes:
        out.append(range(start, start + n))
        start += n
    return out


def plan_memory(params: list[Param], dims: ModelDims, settings: RunSettings, file_sizes: Mapping[str, int],
                today: bool = False, runtime: int | None = None, hybrid: HybridDims | None = None) -> MemoryPlan:
    """Each distinct rank's predicted peak (pp stages differ; the ranks of one stage are alike).

    `today` predicts kiln's current loader (every rank reads the whole checkpoint, then the plans shard it)
    instead of the sharded-load design, as it does for a checkpoint that `settings.loads_whole` (every rank loads it
    whole). `runtime` overrides the runtime term (bytes). `hybrid`: the Gated DeltaNet layers of a Qwen3-Next /
    Qwen3.5 model (HybridDims.from_config), whose blocks have their own formula and each block's LoRA targets its
    own Linears."""
    s = settings
    today = today or s.loads_whole is not None
    deg = s.degrees()
    dp, tp, ep, pp, cp = deg["dp"], deg["tp"], deg["ep"], deg["pp"], deg["cp"]
    lora = s.lora_r is not None
    ckpt_bytes = sum(file_sizes.values())
    # the compute dtype: autocast's, else the stored weights' (an FP8 base computes in bf16)
    stored = max((p.itemsize for p in params if p.name.endswith(".weight") and p.itemsize <= 4), default=4)
    cb = 2 if s.precision in ("bf16", "fp16", "fp8") else max(2, min(stored, 4))
    if s.fsdp and s.param_dtype:
        cb = _DTYPE_BYTES[s.param_dtype] if s.precision == "fp32" else cb
    if s.q4_compute and s.precision == "fp32":  # a 4-bit base computes in its compute dtype (quant4.linear4)
        cb = _DTYPE_BYTES[s.q4_compute]
    q4 = [p for p in params if p.q4_shape is not None]
    adapted_stems = {p.name[: -len(".lora_A.weight")] for p in params if p.name.endswith(".lora_A.weight")}
    adapted = [p.q4_shape for p in q4 if p.q4_shape is not None and p.name[: -len(".weight")] in adapted_stems]
    targets = set()
    if lora:
        targets = {p.module for p in params if p.name.endswith("lora_A.weight") and p.block is not None}
    moe_blocks = {p.block for p in params if p.expert and p.block is not None}
    stages = _stage_blocks(dims.layers, pp, s.pp_stages)
    micro = s.microbatches or (2 * pp if pp > 1 else 1)
    rows = s.batch_size / micro if pp > 1 else s.batch_size
    tokens = rows * s.seq_len / cp
    sharded_fsdp = s.fsdp and dp * cp * (ep if ep > 1 else 1) > 1
    reads_shards = s.reads_shards and not today  # what the family carries: by reference, else whole on each rank

    tied = not any(p.block is None and p.module == "lm_head" for p in params)

    def share(p: Param, stage: int) -> float:
        """The fraction of `p` one rank of `stage` holds."""
        if p.carried:  # not a parameter: no plan splits it
            return 0.0 if reads_shards else 1.0
        if pp > 1:
            if p.block is not None and p.block not in stages[stage] and p.block < dims.layers:
                return 0.0
            # a tied head is the embedding: the last stage keeps a copy of it (kiln.parallel.pipeline)
            if p.block is None and p.module == "embed_tokens" and stage != 0 and not (tied and stage == pp - 1):
                return 0.0
            if p.block is None and p.module != "embed_tokens" and stage != pp - 1:
                return 0.0
        f = 1.0
        if p.tp and tp > 1:
            f /= tp
        if p.expert and ep > 1:
            f /= ep
        if s.fsdp and not replicated(p):
            f /= dp * cp if (p.expert or ep == 1) else dp * cp * ep
        return f

    def replicated(p: Param) -> bool:
        """A frozen tensor outside the blocks: FSDP's root leaves it whole (kiln.parallel.fsdp.replicated_root)."""
        if p.whole:  # a buffer (a 4-bit weight's quant state): FSDP2 shards parameters only
            return True
        return p.block is None and not p.trainable and not (p.tp and tp > 1) and not (p.expert and ep > 1) and (
            s.param_dtype is None or p.itemsize == _DTYPE_BYTES[s.param_dtype])

    lora_in_block: dict[int, set[str]] = {}  # a hybrid's blocks differ: each its own adapted modules
    for p in params:
        if hybrid is not None and p.block is not None and p.name.endswith("lora_A.weight"):
            lora_in_block.setdefault(p.block, set()).add(p.module)
    ranks = []
    for stage in range(pp):
        shares = [(p, share(p, stage)) for p in params]
        weights = sum(p.nbytes * f for p, f in shares)
        trainable = [(p, f) for p, f in shares if p.trainable and f > 0]
        grads = sum(p.nbytes * f for p, f in trainable)
        optim = sum(2 * p.nbytes * f + 4 for p, f in trainable)
        # activations: the tokens in flight times the blocks of this stage
        blocks = list(stages[stage])
        per_block = {}
        for b in blocks:
            tb = targets if hybrid is None else lora_in_block.get(b, set())
            if hybrid is not None and b in hybrid.linear_layers:
                a = deltanet_block_bytes(dims, hybrid, cb, not lora, tb, s.lora_r or 0, s.seq_len,
                                         down_bytes=4 if q4 else None, exact=s.exact)
                if b in moe_blocks:  # Qwen3-Next: the experts in place of the dense MLP, as the attention blocks count them
                    a += (block_activation_bytes(dims, cb, not lora, tb, s.lora_r or 0, moe=True)
                          - block_activation_bytes(dims, cb, not lora, tb, s.lora_r or 0))
            else:
                a = block_activation_bytes(dims, cb, not lora, tb, s.lora_r or 0, moe=b in moe_blocks,
                                           down_bytes=4 if q4 else None)
            if tp > 1:  # heads and MLP columns split; the norms' rows only with sequence parallelism
                norm_part = dims.hidden * (2 * 4 + (2 * (4 + 2 * cb) if not lora else 0))
                a = (a - norm_part) / tp + (norm_part / tp if s.sequence_parallel else norm_part)
            per_block[b] = a * tokens
        in_flight = 1
        if pp > 1:
            in_flight = micro if s.pp_schedule == "gpipe" else min(micro, pp - stage)
        if s.activation_checkpointing == "block":
            kept = [b for i, b in enumerate(blocks) if i % s.checkpoint_every == 0]
            saved = sum(v for b, v in per_block.items() if b not in kept) + len(kept) * tokens * dims.hidden * cb
            acts = saved * in_flight + max(per_block.values(), default=0)  # one block recomputed in the backward
        elif s.activation_checkpointing == "selective":
            # matmul and attention outputs kept, elementwise work recomputed
            q, kv = dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim
            sel = cb * (2 * q + 2 * kv + 3 * dims.hidden + 2 * dims.intermediate) + 4 * dims.heads
            acts = sel * tokens * len(blocks) * in_flight + max(per_block.values(), default=0)
        else:
            acts = sum(per_block.values()) * in_flight
        block_acts = acts  # the many small tensors glibc's heap keeps a share of (the loss path's are mapped)
        last = stage == pp - 1
        head = [p for p in params if p.block is None and p.module in ("lm_head", "embed_tokens")]
        head_trained = any(p.trainable for p in head)
        if last:
            vocab_local = dims.vocab / (tp if tp > 1 else 1)
            acts += tokens * 16 + tokens * dims.hidden * (4 + (2 * cb if not lora else 0))  # ids, labels; final norm
            if s.exact:  # the whole logits and their fp32 copy
                acts += tokens * dims.vocab * (cb + 4)
            else:  # kiln.models.common.loss.linear_cross_entropy, which makes the gradients in the forward:
                rows_ = min(tokens, LOSS_CHUNK // 4 // vocab_local)
                # one chunk's logits (compute dtype, then fp32) and their gradient cast back to the compute dtype
                chunk = rows_ * vocab_local * (4 + (2 * cb if cb < 4 else 0))
                if head_trained:  # the head's fp32 weight gradient, and (half-precision head) each chunk's
                    acts += 4 * vocab_local * dims.hidden  # product in its dtype and its fp32 copy
                    chunk += vocab_local * dims.hidden * (cb + 4) if cb < 4 else 0
                acts += chunk
        # communication buffers
        comm = grad_unit = 0.0
        if s.fsdp and sharded_fsdp:  # FSDP2: one block gathered and the next prefetched, the root (embedding,
            # head) gathered through the whole forward, and the largest unit's unsharded gradients in the reduce dtype
            gather = cb if s.param_dtype else None
            by_block: dict[int, list[Param]] = {}
            for p in params:
                if p.block is not None and (pp == 1 or p.block in stages[stage]) and not p.whole and not p.carried:
                    by_block.setdefault(p.block, []).append(p)
            root = [p for p in params
                    if p.block is None and share(p, stage) > 0 and not replicated(p) and not p.carried]

            def whole(p: Param) -> float:  # this rank's tp/ep piece of `p`, before FSDP splits it
                return p.numel * share(p, stage) * dp * cp * (1 if p.expert or ep == 1 else ep)  # noqa: B023 - called only in this iteration

            biggest = max((sum(whole(p) * (p.itemsize if p.q4_shape else gather or p.itemsize) for p in ps)
                           for ps in by_block.values()), default=0)
            red = _DTYPE_BYTES[s.reduce_dtype]
            grad_unit = max((sum(whole(p) * (p.itemsize + red) for p in ps if p.trainable)
                             for ps in [*by_block.values(), root]), default=0)
            comm += 2 * biggest + sum(whole(p) * (gather or p.itemsize) for p in root) + grad_unit
        elif dp * cp > 1 and tp == 1 and ep == 1 and pp == 1 and not s.fsdp:
            comm += grads  # DDP's buckets: a flat copy of every gradient
        if tp > 1:
            comm += 2 * tokens * dims.hidden * cb
        if ep > 1:
            comm += 2 * tokens * dims.top_k * dims.hidden * cb
        if pp > 1:
            comm += 2 * rows * s.seq_len * dims.hidden * cb
        # autocast's half-precision copies of the Linear weights (fp32 weights, bf16/fp16 compute)
        autocast = 0.0
        if s.precision in ("bf16", "fp16") and not (s.fsdp and s.param_dtype):
            autocast = sum(p.numel * f * 2 for p, f in shares
                           if p.itemsize == 4 and p.name.endswith(".weight") and p.module.endswith("proj"))
        # load: the sharded design reads one tensor at a time; today every rank reads all of it
        # (what it adds above the training peak: the load happens before any gradient or activation exists).
        # A tensor stored as is goes straight from the file into its rows (read_shards' readinto); stacked
        # experts and tp's column slices pass through one whole checkpoint tensor (its copy or mapped pages)
        piece = max((p.nbytes * f for p, f in shares), default=0)
        biggest_tensor: float = max((p.nbytes for p, f in shares if f > 0 and (p.expert or (p.tp and tp > 1))), default=0)
        # 4-bit: a weight quantized at load passes through a chunk of its stored values and its whole absmax
        # (memory_q4.load_transient); training dequantizes each weight per matmul (memory_q4.scratch_bytes)
        q4_here = [(p.q4_shape, f) for p, f in shares if p.q4_shape is not None]
        largest_q4 = max((a * b for (a, b), f in q4_here if f > 0), default=0)
        biggest_tensor = max(biggest_tensor, memory_q4.load_transient(
            largest_q4, _DTYPE_BYTES.get(s.q4_compute or "", 2), dp * cp if sharded_fsdp else 1, bool(s.quantize)))
        dequant = memory_q4.scratch_bytes(q4_here, cb, tokens, adapted, s.device)
        load = max(0.0, biggest_tensor - ((grads + acts if s.keep_grads else max(grads, acts)) + optim + comm
                                          + autocast + dequant))
        # glibc keeps freed heap memory: the many small activation tensors leave ~35% of their bytes resident;
        # the loss path's (vocabulary x rows, vocabulary x hidden) buffers are above glibc's mmap threshold (its
        # adaptive ceiling 32 MiB; 4 MiB on sharded ranks, kiln.parallel.memory_heap) and go back when freed
        allocator = ALLOCATOR_SHARE * block_acts if s.device == "cpu" else 0.0
        r = RankMemory(f"stage {stage}" if pp > 1 else "every rank", keep_grads=s.keep_grads,
                       backward_comm=round(grad_unit))
        r.terms = {"weights": weights, "gradients": grads, "optimizer": optim, "activations": acts,
                   "communication": comm, "autocast": autocast, **({"dequant": dequant} if q4 else {}),
                   "load": load, "allocator": allocator,
                   "runtime": runtime if runtime is not None else (RUNTIME_CPU if s.device == "cpu" else CUDA_CONTEXT)}
        r.load_peak = int(r.terms["runtime"] + weights + biggest_tensor)
        if s.device != "cpu":  # each piece from the file through one host buffer; a tensor step's sources whole
            r.host_load = int(RUNTIME_CPU + max(min(HOST_STAGE, piece), biggest_tensor))
        if today:
            full = sum(p.nbytes for p in params if not p.name.endswith(("lora_A.weight", "lora_B.weight")))
            r = _today(r, file_sizes, full, piece, host=s.device == "cpu")
        if s.offload and s.fsdp and s.device != "cpu":
            r.host = {k: r.terms.pop(k) for k in ("weights", "gradients", "optimizer")}
        r.terms = {k: round(v) for k, v in r.terms.items()}
        r.host = {k: round(v) for k, v in r.host.items()}
        ranks.append(r)
    return MemoryPlan(s, ranks, ckpt_bytes)


def _today(r: RankMemory, file_sizes: Mapping[str, int], full_bytes: int, piece: float, host: bool) -> RankMemory:
    """kiln's loader today: each rank copies every tensor out of each file while that file is mapped
    (hub/weights.load_weights, files in sorted order), then builds the whole model and shards it. The peak
    is the largest of: the read (tensors so far + the mapped file + its copy; host memory), the sharding (whole model
    + one tensor's share: measured, FSDP2 frees each whole tensor as it makes its shard) and training; the
    load term is what the first two add above training."""
    read, done = 0, 0
    for name in sorted(file_sizes):
        # while a file is read: the copies of the files before it, its mapped pages and the copies made of them
        read = max(read, done + 2 * file_sizes[name])
        done += file_sizes[name]
    if not host:  # the file is read into host memory; the device sees the whole model moved onto it
        r.host_load = int(RUNTIME_CPU + read)
        read = 0
    train = r.total - r.terms["load"] - r.terms["runtime"]
    sharding = full_bytes + piece  # the plans shard tensor by tensor: the whole model + one tensor's share
    r.terms["load"] = max(0, read - train, sharding - train)
    r.load_peak = int(r.terms["runtime"] + max(read, sharding))
    r.rank += " (today's loader)"
    return r


def alternatives(params: list[Param], dims: ModelDims, settings: RunSettings, file_sizes: Mapping[str, int],
                 limit: int, runtime: int | None = None, experts: int = 0, tensor_parallel: bool = True,
                 hybrid: HybridDims | None = None) -> list[MemoryPlan]:
    """The [parallel] settings over the same process count whose plan fits `limit` bytes, the simplest first;
    tp > 1 only for a family with a tensor-parallel plan (`tensor_parallel`: kiln.parallel.tp refuses the rest)."""
    n = settings.nproc
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    found = []
    for tp in divisors:
        if dims.heads % tp or dims.kv_heads % tp or (tp > 1 and not tensor_parallel):
            continue
        for ep in divisors:
            if ep > 1 and (not experts or experts % ep):
                continue
            for pp in divisors:
                if tp * ep * pp > n or n % (tp * ep * pp) or pp > dims.layers or (pp > 1 and (tp > 1 or ep > 1)):
                    continue
                for fsdp in (False, True):
                    for ac in ("none", "selective", "block"):
                        for offload in ((False, True) if fsdp and settings.device != "cpu" else (False,)):
                            alt = replace(settings, dp=0, tp=tp, ep=ep, pp=pp, cp=1, fsdp=fsdp, offload=offload,
                                          activation_checkpointing=ac, checkpoint_every=1, pp_stages=None)
                            plan = plan_memory(params, dims, alt, file_sizes, runtime=runtime, hybrid=hybrid)
                            if plan.peak.total <= limit:
                                found.append(plan)
    def change(p: MemoryPlan) -> int:  # the simplest changes first: fsdp, checkpointing, then tp/ep, pp, offload
        a = p.settings
        return (a.fsdp + (a.activation_checkpointing != "none") + 2 * (a.tp > 1) + 2 * (a.ep > 1) + 3 * (a.pp > 1)
                + 4 * a.offload)

    return sorted(found, key=lambda p: (change(p), p.peak.total))


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= 0.1 * GiB else f"{n / MiB:.1f} MiB"


def parse_size(text: str) -> int:
    """'80GiB', '80 GB', '512MiB', '1e9' -> bytes (GB = 10^9, GiB = 2^30)."""
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ConfigError(f"--gpu-memory {text!r}: expected a size such as 80GiB, 80GB or 512MiB")
    value, unit = float(m.group(1)), (m.group(2) or "B").upper().removesuffix("B") or ""
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "KI": 2 ** 10, "MI": 2 ** 20, "GI": 2 ** 30,
             "TI": 2 ** 40}[unit]
    return math.floor(value * scale)
