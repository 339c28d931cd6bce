"""`kiln plan`: each rank's predicted peak memory for a run config, from the checkpoint's headers only.

Reads config.json, the shard index and each safetensors file's header (of .bin weights, their pickle read onto
the meta device; never the weights), applies the run's [train], [lora] and [parallel] settings
(kiln.parallel.memory) and prints one column per kind of rank: the sharded-load design, and what kiln's
current loader (every rank reads the whole checkpoint) needs; a checkpoint no read takes shard by shard (an FP8 or
4-bit .bin, a .bin carrying an MTP layer: kiln.parallel.sharded_load.read_plan) loads whole on every rank, and its
one column says so, with why. When the peak does not fit --gpu-memory (or,
on a cpu run, the host's memory shared by the processes), it names the largest term, lists the [parallel]
settings over the same processes that fit, and exits non-zero. Nothing here imports torch at module import.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def read_q4_shapes(source, tensors: dict) -> dict[str, tuple[int, ...]]:
    """A bitsandbytes-4bit directory's packed weights -> the shape each dequantizes to, from their quant-state
    JSON tensors (a few hundred bytes each; no weights read); empty for any other directory. `source`: the
    directory, or its kiln.hub.index.CheckpointIndex (safetensors or .bin alike: each file's header read once)."""
    import json

    from kiln.errors import WeightsError
    from kiln.hub.index import CheckpointIndex
    from kiln.parallel.memory_q4 import is_state

    index = source if isinstance(source, CheckpointIndex) else CheckpointIndex(Path(source))
    model_dir = index.root
    states = [k for k in tensors if is_state(k) and ".quant_state." in k]
    out: dict[str, tuple[int, ...]] = {}
    for key in states:
        raw = bytes(index.read(key).tolist())
        try:
            out[key.split(".quant_state.")[0]] = tuple(int(d) for d in json.loads(raw.decode("utf-8"))["shape"])
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise WeightsError(f"{model_dir / tensors[key].file}: tensor {key!r} is not bitsandbytes' quant-state "
                               f"JSON with a shape ({e!r})") from None
    return out


def plan_inputs(cfg, nproc: int, device: str, source: str = "run config") -> tuple:
    """(params, dims, settings, file sizes, tensors) of a run config for `plan_memory`, from the model
    directory's config.json, headers and (a 4-bit directory) quant-state JSON."""
    from dataclasses import replace

    from kiln.errors import ConfigError
    from kiln.hub.config import read_config
    from kiln.hub.index import CheckpointIndex
    from kiln.models.auto import family_for
    from kiln.models.loading.carried import carried_keys
    from kiln.parallel.memory import ModelDims, RunSettings, check_shapes, params_from_headers
    from kiln.parallel.memory_q4 import compute_dtype
    from kiln.parallel.sharded_load import read_plan

    if cfg.model.path is None or not Path(cfg.model.path).is_dir():
        raise ConfigError(f"{source}: model.path must be a local HF model directory for kiln plan "
                          f"(got {cfg.model.path or 'model.family, built from scratch'})")
    model_dir = Path(cfg.model.path)
    hf_config = read_config(model_dir)
    family = family_for(hf_config.get("model_type"), str(model_dir / "config.json"))
    dims = ModelDims.from_config(hf_config, str(model_dir / "config.json"), family.config_cls.attn_output_gate)
    index = CheckpointIndex(model_dir)  # every header read once, for the sizes and read_plan alike
    tensors, sizes = index.headers()
    q4_shapes = read_q4_shapes(index, tensors)
    logical = {k: replace(t, shape=q4_shapes[k]) if k in q4_shapes else t for k, t in tensors.items()}
    dims = check_shapes(logical, dims, str(model_dir / "config.json"))
    par, lora = cfg.parallel, cfg.lora
    family_plan = family.parallel_plan
    # a family whose residual cannot split along the sequence (DeepSeek-V4) keeps it whole whatever the key says
    sequence_parallel = par.sequence_parallel and (family_plan is None or family_plan.sequence_parallel)
    settings = RunSettings(
        nproc=nproc, device=device, batch_size=cfg.train.batch_size, seq_len=cfg.data.max_length,
        precision=cfg.train.precision, exact=cfg.train.exact, lora_r=lora.r if lora else None,
        lora_targets=(lora.targets if isinstance(lora.targets, str) else tuple(lora.targets)) if lora else (),
        dp=par.dp, tp=par.tp, ep=par.ep, pp=par.pp, cp=par.cp, fsdp=par.fsdp, offload=par.offload,
        param_dtype=par.param_dtype, reduce_dtype=par.reduce_dtype, sequence_parallel=sequence_parallel,
        activation_checkpointing=par.activation_checkpointing, checkpoint_every=par.checkpoint_every,
        microbatches=par.microbatches, pp_schedule=par.pp_schedule,
        pp_stages=tuple(par.pp_stages) if par.pp_stages else None, keep_grads=par.cadence is not None,
        fp8=cfg.model.fp8, quantize=None if q4_shapes else cfg.model.quantize,
        q4_compute=compute_dtype(hf_config, cfg.model.quantize, tensors.values()))
    # what the family carries beside the model (an MTP layer) is not trained, and a read shard by shard does not
    # hold it (a whole load holds it whole), unless [moe] mtp_weight makes it live: parameters like any other, less
    # what the live layer drops. A checkpoint no read takes shard by shard loads whole on every rank (`loads_whole`)
    empty, load_plan = read_plan(index, cfg.model.task, cfg.model.fp8, cfg.model.quantize)  # the plan every load reads
    settings = replace(settings, loads_whole=load_plan.whole)
    carried, dropped = carried_keys(empty, getattr(getattr(cfg, "moe", None), "mtp_weight", 0) > 0, tensors) \
        if empty is not None else (set(), set())
    params = params_from_headers([t for k, t in tensors.items() if k not in dropped], settings, q4_shapes, carried)
    return params, dims, settings, sizes, tensors


def plan(config: Path = typer.Option(..., "--config", "-c", help="The run TOML."),
         nproc: int = typer.Option(1, "--nproc", help="Processes the run is launched on "
                                                      "(kiln launch --nproc-per-node)."),
         gpu_memory: str | None = typer.Option(None, "--gpu-memory", help="Memory of one GPU, e.g. 80GiB; "
                                                  "the plan is then for device cuda."),
         set_: list[str] = typer.Option([], "--set", help="Override a run-config key: section.key=value; "
                                                          "repeatable."),
         alternatives_shown: int = typer.Option(8, "--show", help="At most this many fitting alternatives.")) -> None:
    """Predict each rank's peak memory (weights, gradients, optimizer, activations, communication) and
    whether the run fits; without a fit, the [parallel] settings that would."""
    from kiln.errors import ConfigError, KilnError
    from kiln.parallel.memory import TERMS, alternatives, fmt_bytes, parse_size, plan_memory
    from kiln.train.config import load_run_config, parse_override

    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    cfg = load_run_config(config, [parse_override(a) for a in set_])
    device = "cuda" if gpu_memory is not None or cfg.train.device.startswith("cuda") else "cpu"
    params, dims, settings, sizes, tensors = plan_inputs(cfg, nproc, device, str(config))
    model_dir, lora = Path(cfg.model.path), cfg.lora
    from kiln.hub.config import read_config
    from kiln.parallel.memory_hybrid import HybridDims

    hybrid = HybridDims.from_config(read_config(model_dir))  # Gated DeltaNet layers (Qwen3-Next / 3.5), or None
    designed = plan_memory(params, dims, settings, sizes, hybrid=hybrid)
    today = plan_memory(params, dims, settings, sizes, today=True, hybrid=hybrid)
    if device == "cpu":
        limit, where = _host_memory() // nproc, f"host memory / {nproc} process(es)"
    else:
        limit, where = parse_size(gpu_memory or "80GiB"), "GPU memory"

    from kiln.parallel.memory_q4 import is_state

    q4_shapes = {p.name: p.q4_shape for p in params if p.q4_shape is not None}  # packed: count what they hold
    n_params = sum(q4_shapes[k][0] * q4_shapes[k][1] if k in q4_shapes else 0 if is_state(k) else t.numel
                   for k, t in tensors.items())
    typer.echo(f"{model_dir.name}: {n_params / 1e9:.3f}B parameters, checkpoint {fmt_bytes(designed.checkpoint_bytes)} "
               f"in {len(sizes)} file(s); {'LoRA r=' + str(lora.r) if lora else 'full fine-tune'}, batch "
               f"{settings.batch_size} x {settings.seq_len} tokens, precision {settings.precision}, device {device}")
    typer.echo(f"plan: {settings.describe()} on {nproc} process(es)")
    whole = settings.loads_whole
    if whole:  # the designed column is then today's loader: every rank reads the whole checkpoint
        typer.echo(f"loads whole on every rank (no read takes it shard by shard): {whole}")
        for r in designed.ranks:
            r.rank = r.rank.replace("(today's loader)", "(whole load)")
    from kiln.models.auto import family_for

    family = family_for(read_config(model_dir).get("model_type"))
    caveat = family.config_cls.plan_activations_caveat
    if caveat:
        typer.echo(f"note: this family's activations are partly estimated: {caveat}")
    if cfg.train.freeze and lora is None:
        typer.echo(f"note: train.freeze {cfg.train.freeze} is not modelled: counted as a full fine-tune (an upper bound)")
    columns = [*designed.ranks, *([] if whole else today.ranks)]
    width = max(14, *(len(r.rank) + 2 for r in columns))
    typer.echo("term".ljust(15) + "".join(r.rank.rjust(width) for r in columns))
    for term in TERMS:
        if any(term in r.terms for r in columns):
            typer.echo(term.ljust(15) + "".join(fmt_bytes(r.terms.get(term, 0)).rjust(width) for r in columns))
    typer.echo("total".ljust(15) + "".join(fmt_bytes(r.total).rjust(width) for r in columns))
    if not settings.keep_grads:
        typer.echo("(gradients and activations never peak together: the total counts the larger of the two)")
    if whole:
        typer.echo(f"while loading: {fmt_bytes(designed.peak.load_peak)} per rank, every rank reading all "
                   f"{fmt_bytes(designed.checkpoint_bytes)} (a whole load)")
    else:
        typer.echo(f"while loading: {fmt_bytes(designed.peak.load_peak)} per rank reading only its share; today's "
                   f"loader {fmt_bytes(today.peak.load_peak)} (every rank reads all "
                   f"{fmt_bytes(designed.checkpoint_bytes)})")
    if device != "cpu" and whole:
        typer.echo(f"host memory while loading: {fmt_bytes(designed.peak.host_load)} per rank (the whole checkpoint "
                   f"read into host memory, then moved to the GPU)")
    elif device != "cpu":
        typer.echo(f"host memory while loading: {fmt_bytes(designed.peak.host_load)} per rank (each tensor passes "
                   f"from the file through one host buffer to the GPU); today's loader {fmt_bytes(today.peak.host_load)}")
    q4 = [p for p in params if p.q4_shape is not None]
    if q4:
        packed = sum(p.nbytes for p in q4)
        state = sum(p.nbytes for p in params if p.whole)
        kind = settings.quantize + " quantized at load" if settings.quantize else "bitsandbytes-4bit directory"
        sharded = " (packed bytes sharded over FSDP2's ranks, quant state whole on each)" if settings.fsdp else ""
        typer.echo(f"4-bit base ({kind}, compute {settings.q4_compute}): {len(q4)} Linears held 4-bit, packed "
                   f"{fmt_bytes(packed)} + quant state {fmt_bytes(state)} in all{sharded}; dequantization "
                   f"scratch {fmt_bytes(designed.peak.terms.get('dequant', 0))} per rank")
    carried = [p for p in params if p.carried]
    if carried:
        held = "not held (each rank reads its share and keeps a reference)" if settings.reads_shards \
            else "held whole on each rank, not trained"
        typer.echo(f"carried beside the model (multi-token prediction; [moe] mtp_weight trains it): {len(carried)} "
                   f"tensors, {fmt_bytes(sum(p.nbytes for p in carried))}, {held}")
    if any(r.host for r in designed.ranks):
        host = designed.peak.host
        typer.echo(f"offloaded to host memory per rank: {fmt_bytes(sum(host.values()))} "
                   f"({', '.join(f'{k} {fmt_bytes(v)}' for k, v in host.items())})")
    peak = designed.peak
    verdict = "fits" if peak.total <= limit else "does NOT fit"
    typer.echo(f"peak {fmt_bytes(peak.total)} per rank {verdict} in {fmt_bytes(limit)} ({where})"
               + ("" if whole else f"; today's loader peaks at {fmt_bytes(today.peak.total)}"))
    if peak.total <= limit:
        return
    tensor_parallel = family.parallel_plan is not None and family.parallel_plan.tensor_parallel
    fits = alternatives(params, dims, settings, sizes, limit, experts=dims.experts, tensor_parallel=tensor_parallel,
                        hybrid=hybrid)
    largest = peak.largest
    message = (f"the plan needs {fmt_bytes(peak.total)} per rank ({peak.rank}) but has {fmt_bytes(limit)} "
               f"({where}); its largest term is {largest} ({fmt_bytes(peak.terms[largest])})")
    if fits:
        typer.echo(f"[parallel] settings on {nproc} process(es) that fit:")
        for alt in fits[:alternatives_shown]:
            typer.echo(f"  {alt.settings.describe():40s} peak {fmt_bytes(alt.peak.total)}")
        message += f"; {len(fits)} [parallel] setting(s) on {nproc} process(es) fit (listed above)"
    else:
        # CPU processes share the host's memory: more of them leaves each less (issue 41)  # sweep
        more = "fewer processes (they share the host's memory)" if device == "cpu" else "more processes"
        message += f"; no [parallel] setting on {nproc} process(es) fits: {more}, a smaller batch or " \
                   f"data.max_length, or [lora]"
    raise KilnError(message)


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)
