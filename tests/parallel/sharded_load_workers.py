"""Spawned ranks for the sharded-load tests: the same checkpoint loaded whole then sharded, and built on meta,
sharded, then read slice by slice; every tensor this rank holds is compared."""

from __future__ import annotations

import json
import os
import resource

import torch
from torch.distributed.tensor import DTensor

from kiln.hub import index as weights  # where a read into place lives (SpanReader)
from kiln.models.auto import load_config, load_whole
from kiln.models.common.lora import LoraConfig, apply_lora, has_adapter
from kiln.models.loading import read as sharded_load
from kiln.models.loading.carried import HOLDERS
from kiln.parallel.apply import parallelize
from kiln.parallel.sharded_load import empty_pretrained, init_adapters, loaded_bytes, read_shards
from kiln.train.config import ParallelSection

MODES = {"fsdp": dict(fsdp=True), "fsdp-lora": dict(fsdp=True), "fsdp-adapter": dict(fsdp=True), "pp": dict(pp=2, microbatches=2),
         "pp-fsdp": dict(pp=2, microbatches=2, fsdp=True), "tp": dict(tp=2), "ep": dict(ep=2), "tp-fsdp": dict(tp=2, fsdp=True),
         "ep-fsdp": dict(ep=2, fsdp=True), "ep-fsdp-2": dict(ep=2, fsdp=True)}
# an FP8 release read to dequantize (the default), each rank its pieces of the FP8 weights and their scale blocks
MODES.update({f"{mode}-deq": MODES[mode] for mode in ("fsdp", "tp", "ep")})


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float8 tensor as its bytes (torch.equal has no float8 kernel); others as they are."""
    return t.view(torch.uint8) if t.dtype.is_floating_point and t.element_size() == 1 else t


def compare_many(rank: int, world: int, jobs: list[tuple], out: str) -> None:
    """`compare` for each (model_dir, mode, tag[, quantize[, task, labels]]) in one spawn (starting the ranks costs
    more than the tiny loads)."""
    for model_dir, mode, tag, *rest in jobs:
        compare(rank, world, model_dir, mode, out, tag, *rest)


def compare(rank: int, world: int, model_dir: str, mode: str, out: str, tag: str | None = None,
            quantize: str | None = None, task: str = "causal-lm", labels: list[str] | None = None) -> None:
    """Whole load then `mode`'s plans vs built on meta, the plans, then the read; to OUT/<tag>-rank<r>.json.
    `quantize`: "nf4" | "fp4" at load. `q4_reads`: (file, offset, bytes) of each read of a 4-bit weight's rows;
    `reads`: the same of every other read from the files; `torch_loads`: the map_location of each torch.load the
    build on meta and the read made (a .bin's pickle read onto "meta" only: no tensor data).
    `task` (and `labels`) other than the checkpoint's: a head the checkpoint lacks (kiln.models.loading.fresh),
    built by `lean_pretrained` as `kiln train` builds it (so is a directory with an adapter beside it); under LoRA both models then take two steps (dropout on)
    from the generator state each load left (`rng_equal`: the same state), and `steps` holds both runs' losses."""
    from kiln.models.loading import q4 as sharded_q4
    from kiln.parallel.sharded_load import lean_pretrained

    sharded_q4.CHUNK_VALUES = 101 * 64  # quantized at load: several chunks per rank's run of a weight, as at real size

    parallel = ParallelSection(**MODES[mode])
    changes = {"labels": labels} if labels else {}
    targets = ["q_proj", "v_proj", "gate_proj"] if task == "causal-lm" else ["q_proj", "v_proj", "up_proj"]
    lora = LoraConfig(r=4, alpha=8, dropout=0.0 if task == "causal-lm" else 0.3, targets=targets) \
        if mode.endswith("-lora") else None
    with open(os.path.join(model_dir, "config.json")) as f:  # an FP8 release: kept FP8, a frozen base
        fp8 = "keep" if "quantization_config" in json.load(f) and not mode.endswith("-deq") else "dequantize"
    source = load_config(model_dir)[2]
    fresh = source is not None and source != task  # a head the checkpoint lacks: drawn from the seed
    adapter = has_adapter(model_dir)  # a PEFT adapter beside the weights: put on as the whole load puts it
    whole = load_whole(model_dir, task=task, seed=5, fp8=fp8, quantize=quantize, **changes)
    whole_bytes = sum(t.nbytes for t in whole.state_dict().values())  # the model one process holds
    if lora:
        apply_lora(whole, lora)
    after_whole = torch.get_rng_state()
    parallelize(whole, parallel, world_size=world, device=torch.device("cpu"))
    torch.manual_seed(321)  # what a load draws it draws from its seed, whatever happened since
    torch_loads, load = [], torch.load
    torch.load = lambda *a, **k: (torch_loads.append(str(k.get("map_location"))), load(*a, **k))[1]
    try:
        lean = lean_pretrained(model_dir, task, 5, fp8=fp8, quantize=quantize, **changes) if fresh or adapter else \
            empty_pretrained(model_dir, task=task, fp8=fp8, quantize=quantize)
    finally:
        torch.load = load
    if lora:
        apply_lora(lean, lora)
        torch.manual_seed(123)  # init_adapters draws from its own seed, whatever happened since
        init_adapters(lean, "cpu", seed=5)
    after_lean = torch.get_rng_state()
    parallelize(lean, parallel, world_size=world, device=torch.device("cpu"))
    read_whole = []  # the tensors read whole (one checkpoint tensor at a time), then cut to this rank's piece
    q4_reads = []
    reads = []  # (file, offset, bytes) of the reads into place (kiln.models.loading.read, kiln.hub.index)
    fill, dequantized, read_into = sharded_load._fill, sharded_load.read_dequantized, sharded_q4.read_into
    sharded_load._fill = lambda name, *args, **kw: fill(name, *args, **kw) and read_whole.append(name)
    sharded_load.read_dequantized = lambda name, *args: dequantized(name, *args) and read_whole.append(name)
    sharded_q4.read_into = lambda f, offset, t: (q4_reads.append((f.name, offset, t.nbytes)), read_into(f, offset, t))[1]
    plain = lambda f, offset, t: (reads.append((f.name, offset, t.nbytes)), read_into(f, offset, t))[1]  # noqa: E731
    sharded_load.read_into = weights.read_into = plain
    torch.load = lambda *a, **k: (torch_loads.append(str(k.get("map_location"))), load(*a, **k))[1]
    try:
        read_shards(lean, model_dir)
    finally:
        sharded_load._fill, sharded_load.read_dequantized, sharded_q4.read_into = fill, dequantized, read_into
        sharded_load.read_into = weights.read_into = read_into
        torch.load = load
    a, b = whole.state_dict(), lean.state_dict()
    problems = [k for k in a if k not in b] + [k for k in b if k not in a]
    if fresh and whole.load_report.initialized != lean.load_report.initialized:  # (a stage reports others ignored)
        problems.append(f"initialized: {whole.load_report.initialized} vs {lean.load_report.initialized}")
    for k in a.keys() & b.keys():
        x, y = _local(a[k]), _local(b[k])
        if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(_bits(x), _bits(y)):
            problems.append(f"{k}: {x.dtype}{tuple(x.shape)} vs {y.dtype}{tuple(y.shape)}")
        if isinstance(a[k], DTensor) != isinstance(b[k], DTensor) or (
                isinstance(a[k], DTensor) and a[k].placements != b[k].placements):
            problems.append(f"{k}: placements differ")
    # what the family's own load decided from the checkpoint (a fused expert layout, a release's naming): the
    # names and dtypes this rank's model writes back under (FP8 ones: gloo moves no float8 to gather them)
    if mode == "fsdp" and fp8 != "keep":
        def written(m):
            return {k: str(v.dtype) for k, v in m.hf_state_dict().items()}

        a_hf, b_hf = written(whole), written(lean)
        problems += [f"written {k}: {a_hf.get(k)} vs {b_hf.get(k)}" for k in a_hf.keys() | b_hf.keys()
                     if a_hf.get(k) != b_hf.get(k)]
    steps = [_two_steps(m, state, task, rank) for m, state in ((whole, after_whole), (lean, after_lean))] \
        if lora and fresh else []  # after the comparison: the steps change the weights
    with open(os.path.join(out, f"{tag or mode}-rank{rank}.json"), "w") as f:
        experts = {k: _local(t) for k, t in b.items() if ".experts." in k}
        json.dump({"problems": sorted(problems), "tensors": len(a), "bytes": loaded_bytes(lean),
                   "read_whole": read_whole, "q4_reads": q4_reads, "reads": reads, "torch_loads": torch_loads,
                   "expert_bytes": sum(t.nbytes for t in experts.values()),
                   "expert_dtypes": sorted({str(t.dtype) for t in experts.values()}),
                   "fp8_split": sum(isinstance(t, DTensor) and any(p.is_shard() for p in t.placements) and
                                    (t.dtype == torch.float8_e4m3fn or k.endswith("_scale_inv")) for k, t in b.items()),
                   "whole_expert_bytes": sum(t.numel() * t.element_size() for k, t in a.items()
                                             if ".experts." in k),
                   "embedding_sharded": isinstance(dict(lean.named_parameters()).get("model.embed_tokens.weight"),
                                                   DTensor),
                   # what the family carries beside the model (MTP layers): by name; the lean model's bytes of them
                   "carried": [sorted(f"{h}.{n}" for h in HOLDERS for n in getattr(m, h, None) or {})
                               for m in (whole, lean)],
                   "carried_bytes": sum(t.nbytes for h in HOLDERS for t in (getattr(lean, h, None) or {}).values()
                                        if not t.is_meta),
                   "whole_bytes": whole_bytes, "steps": steps, "rng_equal": torch.equal(after_whole, after_lean),
                   "initialized": lean.load_report.initialized, "lora_tensors": sum(".lora_" in k for k in b),
                   "fresh_bytes": {k: [_local(b[k]).nbytes, a[k].numel() * a[k].element_size()] for k in b
                                   if fresh and k in _kiln_names(lean)},  # [this rank's, the whole tensor's]
                   "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}, f)



def _kiln_names(model) -> set[str]:
    """The kiln names of the tensors its load reported newly initialised."""
    keymap = model.family.keymap(model.task)
    return {k for k in model.state_dict() if (keymap.hf_name(k) or k) in model.load_report.initialized}


def _two_steps(model, state: torch.Tensor, task: str, rank: int) -> list[float]:
    """Two SGD steps of a LoRA model in train mode (dropout drawing) from generator `state`; the losses."""
    torch.set_rng_state(state)
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    g = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(2):
        ids = torch.randint(1, 99, (2, 9), generator=g)
        y = torch.randint(0, 3, (2,), generator=g) if task == "sequence-classification" else ids
        loss = model(ids, labels=y).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def save_sharded_runs(rank: int, world: int, jobs: list[tuple[str, str]]) -> None:
    """For each (model_dir, ckpt): an FSDP2 run's model as `kiln train` builds it (read shard by shard where it
    can, else loaded whole), saved as a sharded checkpoint with no step taken (its export must write what a
    one-process export of the source does). One spawn for all (starting the ranks costs more than the work)."""
    from kiln.parallel.checkpoint import save_sharded
    from kiln.parallel.sharded_load import lean_pretrained

    for model_dir, ckpt in jobs:
        model = lean_pretrained(model_dir, "causal-lm", None)
        lean = model is not None
        model = model if lean else load_whole(model_dir, task="causal-lm")
        parallelize(model, ParallelSection(fsdp=True), world_size=world, device=torch.device("cpu"))
        if lean:
            read_shards(model, model_dir)
        save_sharded(ckpt, model)


# 4-bit bases: q_proj 24 x 41 (984 values: 15.4 blocks of 64), gate/up 401 x 41 (16,441 values, odd: 257 blocks, the
# last of 57, so two nested absmax groups); on 2 ranks their bytes start and end inside blocks
ODD_Q4 = dict(vocab_size=99, hidden_size=41, intermediate_size=401, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=6, max_position_embeddings=64)


def q4_checkpoints(root) -> dict:
    """name -> directory: the bf16 checkpoint "bf16" (several files), and the bitsandbytes-4bit directories written
    from it, "bnb-nf4" (double-quantized absmax) and "bnb-fp4" (without)."""
    from kiln.models.auto import AutoConfig, from_config
    from kiln.models.common.quant4 import quantize_model

    model = from_config(AutoConfig.for_model("qwen3", **ODD_Q4), task="causal-lm", seed=0).to(torch.bfloat16)
    model.save_pretrained(root / "bf16", max_shard_bytes=40_000)
    out = {"bf16": root / "bf16"}
    for quant, double in (("nf4", True), ("fp4", False)):
        q = load_whole(root / "bf16", task="causal-lm")
        quantize_model(q, quant, double_quant=double)
        q.save_pretrained(root / f"bnb-{quant}", max_shard_bytes=40_000)
        out[f"bnb-{quant}"] = root / f"bnb-{quant}"
    return out


def with_adapter(path, base):
    """`base` saved again with a trained-looking PEFT adapter beside it (on q_proj and down_proj: columns and rows under tp), under `path`."""
    model = load_whole(base, task="causal-lm")
    apply_lora(model, LoraConfig(r=4, alpha=8, dropout=0.0, targets=["q_proj", "down_proj"]))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.normal_(generator=torch.Generator().manual_seed(len(n)))
    model.save_pretrained(path, max_shard_bytes=8_000)
    assert (path / "adapter_model.safetensors").is_file()
    return path


def bin_release(src, out, max_shard_bytes: int | None = None):
    """`src` (an HF directory) again with its weights as transformers' save_pretrained(safe_serialization=False)
    wrote them: pytorch_model.bin, or pytorch_model-0000i-of-0000n.bin shards and pytorch_model.bin.index.json."""
    import shutil

    from kiln.hub.weights import load_weights, save_bin_weights

    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy(f, out / f.name)
    save_bin_weights(out, load_weights(src), max_shard_bytes)
    return out
