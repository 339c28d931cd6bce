"""`kiln plan`: each rank's predicted peak memory for a run config, from the checkpoint's headers only.

Reads config.json, the shard index and each safetensors file's header (never the weights), applies the
run's [train], [lora] and [parallel] settings (kiln.parallel.memory) and prints one column per kind of
rank: the sharded-load design, and what kiln's current loader (every rank reads the whole checkpoint)
needs. When the peak does not fit --gpu-memory (or, on a cpu run, the host's memory shared by the
processes), it names the largest term, lists the [parallel] settings over the same processes that fit,
and exits non-zero. Nothing here imports torch at module import.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def plan(config: Path = typer.Option(..., "--config", "-c", help="The run TOML."),
         nproc: int = typer.Option(1, "--nproc", help="Processes the run is launched on "
                                                      "(kiln launch --nproc-per-node)."),
         gpu_memory: Optional[str] = typer.Option(None, "--gpu-memory", help="Memory of one GPU, e.g. 80GiB; "
                                                  "the plan is then for device cuda."),
         set_: list[str] = typer.Option([], "--set", help="Override a run-config key: section.key=value; "
                                                          "repeatable."),
         alternatives_shown: int = typer.Option(8, "--show", help="At most this many fitting alternatives.")) -> None:
    """Predict each rank's peak memory (weights, gradients, optimizer, activations, communication) and
    whether the run fits; without a fit, the [parallel] settings that would."""
    from kiln.errors import ConfigError, KilnError
    from kiln.hub.config import read_config
    from kiln.hub.headers import read_headers
    from kiln.models.auto import family_for
    from kiln.parallel.memory import (TERMS, ModelDims, RunSettings, alternatives, check_shapes, fmt_bytes,
                                      params_from_headers, parse_size, plan_memory)
    from kiln.train.config import load_run_config, parse_override

    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    cfg = load_run_config(config, [parse_override(a) for a in set_])
    if cfg.model.path is None or not Path(cfg.model.path).is_dir():
        raise ConfigError(f"{config}: model.path must be a local HF model directory for kiln plan "
                          f"(got {cfg.model.path or 'model.family, built from scratch'})")
    model_dir = Path(cfg.model.path)
    hf_config = read_config(model_dir)
    dims = ModelDims.from_config(hf_config, str(model_dir / "config.json"))
    tensors, sizes = read_headers(model_dir)
    dims = check_shapes(tensors, dims, str(model_dir / "config.json"))
    device = "cuda" if gpu_memory is not None or cfg.train.device.startswith("cuda") else "cpu"
    par, lora = cfg.parallel, cfg.lora
    family_plan = family_for(hf_config.get("model_type"), str(model_dir / "config.json")).parallel_plan
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
        fp8=cfg.model.fp8)
    params = params_from_headers(tensors.values(), settings)
    designed = plan_memory(params, dims, settings, sizes)
    today = plan_memory(params, dims, settings, sizes, today=True)
    if device == "cpu":
        limit, where = _host_memory() // nproc, f"host memory / {nproc} process(es)"
    else:
        limit, where = parse_size(gpu_memory or "80GiB"), "GPU memory"

    n_params = sum(t.numel for t in tensors.values())
    typer.echo(f"{model_dir.name}: {n_params / 1e9:.3f}B parameters, checkpoint {fmt_bytes(designed.checkpoint_bytes)} "
               f"in {len(sizes)} file(s); {'LoRA r=' + str(lora.r) if lora else 'full fine-tune'}, batch "
               f"{settings.batch_size} x {settings.seq_len} tokens, precision {settings.precision}, device {device}")
    typer.echo(f"plan: {settings.describe()} on {nproc} process(es)")
    if cfg.train.freeze and lora is None:
        typer.echo(f"note: train.freeze {cfg.train.freeze} is not modelled: counted as a full fine-tune (an upper bound)")
    columns = [*designed.ranks, *today.ranks]
    width = max(14, *(len(r.rank) + 2 for r in columns))
    typer.echo("term".ljust(15) + "".join(r.rank.rjust(width) for r in columns))
    for term in TERMS:
        if any(term in r.terms for r in columns):
            typer.echo(term.ljust(15) + "".join(fmt_bytes(r.terms.get(term, 0)).rjust(width) for r in columns))
    typer.echo("total".ljust(15) + "".join(fmt_bytes(r.total).rjust(width) for r in columns))
    if not settings.keep_grads:
        typer.echo("(gradients and activations never peak together: the total counts the larger of the two)")
    typer.echo(f"while loading: {fmt_bytes(designed.peak.load_peak)} per rank reading only its share; today's loader "
               f"{fmt_bytes(today.peak.load_peak)} (every rank reads all {fmt_bytes(designed.checkpoint_bytes)})")
    if device != "cpu":
        typer.echo(f"host memory while loading: {fmt_bytes(designed.peak.host_load)} per rank (each tensor passes "
                   f"from the file through one host buffer to the GPU); today's loader {fmt_bytes(today.peak.host_load)}")
    if any(r.host for r in designed.ranks):
        host = designed.peak.host
        typer.echo(f"offloaded to host memory per rank: {fmt_bytes(sum(host.values()))} "
                   f"({', '.join(f'{k} {fmt_bytes(v)}' for k, v in host.items())})")
    peak = designed.peak
    verdict = "fits" if peak.total <= limit else "does NOT fit"
    typer.echo(f"peak {fmt_bytes(peak.total)} per rank {verdict} in {fmt_bytes(limit)} ({where}); today's loader "
               f"peaks at {fmt_bytes(today.peak.total)}")
    if peak.total <= limit:
        return
    fits = alternatives(params, dims, settings, sizes, limit, experts=dims.experts)
    largest = peak.largest
    message = (f"the plan needs {fmt_bytes(peak.total)} per rank ({peak.rank}) but has {fmt_bytes(limit)} "
               f"({where}); its largest term is {largest} ({fmt_bytes(peak.terms[largest])})")
    if fits:
        typer.echo(f"[parallel] settings on {nproc} process(es) that fit:")
        for alt in fits[:alternatives_shown]:
            typer.echo(f"  {alt.settings.describe():40s} peak {fmt_bytes(alt.peak.total)}")
        message += f"; {len(fits)} [parallel] setting(s) on {nproc} process(es) fit (listed above)"
    else:
        message += f"; no [parallel] setting on {nproc} process(es) fits: more processes, a smaller batch or " \
                   f"data.max_length, or [lora]"
    raise KilnError(message)


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)
