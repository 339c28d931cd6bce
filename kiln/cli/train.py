"""`kiln train`, `kiln launch` (torchrun underneath) and `kiln plot`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Optional

import typer

from kiln.errors import KilnError


def train(config: Path = typer.Option(..., "--config", "-c", help="The run TOML."),
          resume: Optional[Path] = typer.Option(None, "--resume", help="A run directory to continue from its "
                                                                        "newest complete checkpoint.")) -> None:
    """Train as a run config says; with --resume, pick up exactly where RUN_DIR stopped."""
    from kiln.train.config import load_run_config
    from kiln.train.run import build_trainer

    cfg = load_run_config(config)
    _check_parallel(cfg.parallel)
    trainer = build_trainer(cfg, resume=resume).fit()
    if trainer.world.main:
        line = f"done: step {trainer.step}"
        if trainer.last_eval:
            line += ", " + ", ".join(f"{k} {v:.4f}" for k, v in trainer.last_eval.items())
        if trainer.skipped:
            line += f", {trainer.skipped} non-finite step(s) skipped"
        if trainer.best:
            line += f"; best {trainer.best['checkpoint']}"
        typer.echo(f"{line}; checkpoints in {trainer.out_dir}")


def _check_parallel(parallel) -> None:
    """Degrees against the world size torchrun gave us; plans the Trainer cannot run yet are refused, not ignored."""
    import os

    from kiln.dist.mesh import resolve_degrees

    degrees = resolve_degrees(parallel, int(os.environ.get("WORLD_SIZE", "1")))
    unwired = [k for k, on in (("tp", degrees.tp > 1), ("ep", degrees.ep > 1), ("fsdp", parallel.fsdp),
                               ("cadence", parallel.cadence is not None),
                               ("activation_checkpointing", parallel.activation_checkpointing != "none"),
                               ("compile", parallel.compile)) if on]
    if unwired:
        raise KilnError(f"parallel.{', parallel.'.join(unwired)}: not run by `kiln train` yet (only plain data "
                        f"parallelism is); apply them from Python with kiln.dist.parallelize(model, cfg.parallel)")


_TORCHRUN_FLAGS = ("nnodes", "node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint",
                   "rdzv_id", "max_restarts")


def launch(ctx: typer.Context,
           nproc_per_node: str = typer.Option("1", "--nproc-per-node", help="Processes on this node (or 'gpu')."),
           nnodes: Optional[str] = typer.Option(None, "--nnodes", help="Nodes, or MIN:MAX for elastic runs."),
           node_rank: Optional[int] = typer.Option(None, "--node-rank"),
           master_addr: Optional[str] = typer.Option(None, "--master-addr"),
           master_port: Optional[int] = typer.Option(None, "--master-port"),
           rdzv_backend: Optional[str] = typer.Option(None, "--rdzv-backend"),
           rdzv_endpoint: Optional[str] = typer.Option(None, "--rdzv-endpoint"),
           rdzv_id: Optional[str] = typer.Option(None, "--rdzv-id"),
           max_restarts: Optional[int] = typer.Option(None, "--max-restarts")) -> None:
    """Run a kiln command in N processes per node via torch.distributed.run: `kiln launch --nproc-per-node 2 -- train --config run.toml`."""
    command = list(ctx.args)
    if not command:
        raise KilnError("nothing to launch; put the kiln command after --, e.g. "
                        "kiln launch --nproc-per-node 2 -- train --config run.toml")
    argv = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc_per_node}"]
    values = locals()
    for name in _TORCHRUN_FLAGS:
        if values[name] is not None:
            argv.append(f"--{name.replace('_', '-')}={values[name]}")
    if nnodes is None and rdzv_endpoint is None and master_port is None:
        argv.append("--standalone")  # one node: torchrun picks a free port itself
    argv += ["-m", "kiln.cli.main", *command]
    code = subprocess.call(argv)
    if code != 0:
        raise typer.Exit(code)


def plot(run_dir: Path = typer.Argument(..., help="A run directory with metrics.jsonl."),
         out: Optional[Path] = typer.Option(None, "--out", help="PNG path (default RUN_DIR/curves.png).")) -> None:
    """Plot loss, learning rate and eval curves of a run as a PNG."""
    from kiln.train.plot import plot_run

    typer.echo(str(plot_run(run_dir, out)))


def register(app: typer.Typer) -> None:
    app.command("train")(train)
    app.command("launch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(launch)
    app.command("plot")(plot)
