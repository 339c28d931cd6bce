"""`kiln train`, `kiln launch` (torchrun underneath) and `kiln plot`."""

from __future__ import annotations

import contextlib
import inspect
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from kiln.cli.boundary import ERROR_DIR_ENV
from kiln.cli.common import EXIT_STOPPED, exit_codes, share_cores
from kiln.cli.lifeline import child_of_launcher
from kiln.constants import LAUNCH_CAUSE_FILE, LAUNCH_DIR_ENV, LAUNCHER_SIGNAL_FILE
from kiln.errors import KilnError


@exit_codes
def train(config: Path = typer.Option(..., "--config", "-c", help="The run TOML."),
          resume: Path | None = typer.Option(None, "--resume", help="A run directory to continue from its "
                                                                        "newest complete checkpoint."),
          set_: list[str] = typer.Option([], "--set", help="Override a run-config key: section.key=value "
                                                           "(a TOML value, or a plain string); repeatable."),
          **shortcut_values: Any) -> None:
    """Train as a run config says (with --set / named overrides on top); with --resume, pick up exactly
    where RUN_DIR stopped."""
    with _early_stop():  # sweep2: a SIGTERM / SIGINT before the trainer's own handlers: exit 75, not 143
        _train(config, resume, set_, shortcut_values)


class _StoppedEarly(BaseException):  # sweep2: not an Exception: no `except Exception` on the way swallows it
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextlib.contextmanager
def _early_stop():  # sweep2
    """While `kiln train` starts (config, data, model), SIGTERM / SIGINT end it at once with exit 75 and one line:
    no step was taken, so no checkpoint exists and the same command (without --resume) starts it again. The
    trainer's fit installs its own handlers over these (stop after the step, checkpoint) and puts them back."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def early(signum: int, frame: Any) -> None:
        raise _StoppedEarly(signum)

    previous = {s: signal.signal(s, early) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except _StoppedEarly as e:
        typer.echo(f"stopped by {signal.Signals(e.signum).name} before the first step; no checkpoint was written: "
                   "run the same command again (without --resume)", err=True)
        raise typer.Exit(EXIT_STOPPED) from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _train(config: Path, resume: Path | None, set_: list[str], shortcut_values: dict[str, Any]) -> None:
    from kiln.train.config import load_run_config, parse_override
    from kiln.train.recipes import shortcuts
    from kiln.train.run import build_trainer

    overrides = [parse_override(arg) for arg in set_]
    for s in shortcuts():  # after --set: a named flag wins over a --set of the same key
        value = shortcut_values.get(s.flag)
        if s.multiple:
            if value:
                overrides.append((s.key, list(value)))
        elif value is not None:
            overrides.append(parse_override(f"{s.key}={value}"))
    cfg = load_run_config(config, overrides)
    from kiln.parallel.memory_heap import lean_heap, pays_off
    from kiln.parallel.world import launched_world, leave_world

    if pays_off(cfg.parallel, launched_world().size):  # sharded ranks: large freed blocks back to the system
        lean_heap()  # before any weight is read (glibc's heap would keep the gathered shards' blocks)

    # a resume keeps the checkpoint's global batch, unless the command line names the batch size
    rescale = not any(key == "train.batch_size" for key, _ in overrides)
    trainer = build_trainer(cfg, resume=resume, keep_global_batch=rescale).fit()
    if trainer.stopped_by is not None:  # the trainer said where it stopped and how to resume
        folder = os.environ.get(LAUNCH_DIR_ENV)
        if folder:  # the stop is complete (checkpoint sealed): the launcher exits 75 however teardown goes
            with contextlib.suppress(OSError):
                (Path(folder) / f"stopped-{trainer.world.rank:05d}").write_text(str(trainer.step))
        leave_world(EXIT_STOPPED)  # a launched rank ends here
        raise typer.Exit(EXIT_STOPPED)
    if trainer.world.main:
        line = f"done: step {trainer.step}"
        if trainer.last_eval:
            line += ", " + ", ".join(f"{k} {v:.4f}" for k, v in trainer.last_eval.items())
        if trainer.skipped:
            line += f", {trainer.skipped} non-finite step(s) skipped"
        if trainer.best:
            line += f"; best {trainer.best['checkpoint']}"
        typer.echo(f"{line}; checkpoints in {trainer.out_dir}")
    leave_world()


def _with_recipe_flags(fn: Callable) -> Callable:
    """`train` with one option per recipe shortcut (kiln.train.recipes): typer reads the signature."""
    from kiln.cli.recipe_flags import shortcuts  # the recipes' table, without importing torch

    params = [p for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD]
    for s in shortcuts():
        flag = "--" + s.flag.replace("_", "-")
        help_ = f"Sets {s.key}{' (repeat for several)' if s.multiple else ''}; same as --set {s.key}=..."
        option = typer.Option([] if s.multiple else None, flag, help=help_, rich_help_panel="Recipe shortcuts")
        params.append(inspect.Parameter(s.flag, inspect.Parameter.KEYWORD_ONLY, default=option,
                                        annotation=list[str] if s.multiple else str | None))
    fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]  # what typer reads the options from
    return fn


_TORCHRUN_FLAGS = ("nnodes", "node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint",
                   "rdzv_id", "max_restarts")


def launch(ctx: typer.Context,
           nproc_per_node: str = typer.Option("1", "--nproc-per-node", help="Processes on this node (or 'gpu')."),
           nnodes: str | None = typer.Option(None, "--nnodes", help="Nodes, or MIN:MAX for elastic runs."),
           node_rank: int | None = typer.Option(None, "--node-rank", help="This node's rank, 0 .. nnodes-1 "
                                                    "(node 0 holds global rank 0, which writes the run files)."),
           master_addr: str | None = typer.Option(None, "--master-addr"),
           master_port: int | None = typer.Option(None, "--master-port"),
           rdzv_backend: str | None = typer.Option(None, "--rdzv-backend"),
           rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", help="HOST:PORT on node 0 where the "
                                                        "nodes meet; the same on every node."),
           rdzv_id: str | None = typer.Option(None, "--rdzv-id"),
           max_restarts: int | None = typer.Option(None, "--max-restarts")) -> None:
    """Run a kiln command in N processes per node via torch.distributed.run: `kiln launch --nproc-per-node 2 -- train --config run.toml`."""
    command = list(ctx.args)
    if not command:
        raise KilnError("nothing to launch; put the kiln command after --, e.g. "
                        "kiln launch --nproc-per-node 2 -- train --config run.toml")
    if not (nproc_per_node in ("gpu", "cpu", "auto") or (nproc_per_node.isdigit() and int(nproc_per_node) > 0)):
        raise KilnError(f"--nproc-per-node must be a number >= 1, gpu, cpu or auto, got {nproc_per_node!r}")
    for flag, value in (("--node-rank", node_rank), ("--max-restarts", max_restarts)):
        if value is not None and value < 0:
            raise KilnError(f"{flag} must be >= 0, got {value}")
    _check_nodes(nnodes, node_rank, master_addr, rdzv_endpoint, rdzv_backend)
    argv = [sys.executable, "-m", "kiln.cli.torchrun", f"--nproc-per-node={nproc_per_node}"]
    values = locals()
    for name in _TORCHRUN_FLAGS:
        if values[name] is not None:
            argv.append(f"--{name.replace('_', '-')}={values[name]}")
    if nnodes in (None, "1") and rdzv_endpoint is None and master_port is None:
        argv.append("--standalone")  # one node: torchrun picks a free port itself
    argv += ["-m", "kiln.cli.main", *command]
    env = dict(os.environ)
    threads = share_cores(int(nproc_per_node)) if nproc_per_node.isdigit() else None
    if threads is not None:  # each rank's share (torchrun would give every rank 1, or all cores to each)
        env["OMP_NUM_THREADS"] = str(threads)
    with tempfile.TemporaryDirectory(prefix="kiln-launch-") as errors:
        # each rank leaves its user error here instead of printing it; shown once below
        code, signals = _run_passing_signals(argv, {**env, ERROR_DIR_ENV: errors, LAUNCH_DIR_ENV: errors},
                                             Path(errors))
        messages = {p.stem.removeprefix("rank-").lstrip("0") or "0": p.read_text(encoding="utf-8")
                    for p in sorted(Path(errors).glob("rank-*.txt"))}
        cause_file = Path(errors) / LAUNCH_CAUSE_FILE
        cause = cause_file.read_text(encoding="utf-8") if cause_file.is_file() else None
        stopped = any(Path(errors).glob("stopped-*"))
        # a rank that stopped on a signal did so only after every rank agreed and the checkpoint was sealed; a
        # rank torn down after that (torchrun ends the others, gloo may abort at exit) changes nothing
        if code != 0 and not messages and stopped:
            code = EXIT_STOPPED
    if len(signals) >= 2:  # a second signal to the launcher ended the ranks at once: as `kiln train` would end
        raise typer.Exit(128 + signals[-1])
    if code == EXIT_STOPPED and not signals and stopped:  # the signal went to a rank, not to this launcher
        typer.echo("kiln launch: the run stopped on a signal sent to one of its ranks (not to kiln launch); "
                   "every rank saved: resume with --resume", err=True)
    if cause is not None and not messages and code not in (0, EXIT_STOPPED):
        typer.echo(cause, err=True)
    if messages:
        distinct = list(dict.fromkeys(messages.values()))
        if len(distinct) == 1:
            typer.echo(f"kiln: {distinct[0]}", err=True)
        else:
            for rank, message in messages.items():
                typer.echo(f"kiln: rank {rank}: {message}", err=True)
        # a user error (or a non-finite abort, 3) said its message; ranks that lost their peer over it exit
        # 70 or by a signal, which would hide the cause: the launch exits as the message says
        raise typer.Exit(code if code == 3 else 1)
    if code != 0:
        raise typer.Exit(code)


def _run_passing_signals(argv: list[str], env: dict[str, str], folder: Path) -> tuple[int, list[int]]:
    """Run torchrun in a session of its own (a terminal's Ctrl-C reaches this process alone) and pass each
    SIGINT / SIGTERM on once to every rank that has its handlers in place (their pids in `folder`,
    kiln.train.preempt): they agree on a step, save and exit 75. Before any rank is ready, torchrun gets it.
    Returns torchrun's exit code and the signals this process received, in order."""
    received: list[int] = []
    # torchrun dies with this process (any signal, SIGKILL included), and its ranks with it (kiln.cli.lifeline)
    proc = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=child_of_launcher(os.getpid()))

    def pass_on(signum: int, frame: Any) -> None:
        received.append(signum)
        with contextlib.suppress(OSError):  # the ranks tell the launcher's signal from torchrun's teardown by it
            (folder / LAUNCHER_SIGNAL_FILE).write_text(signal.Signals(signum).name)
        pids = []
        for f in folder.glob("pid-*"):
            with contextlib.suppress(OSError, ValueError):
                pids.append(int(f.read_text()))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        if not pids:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, pass_on) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait(), received
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _check_nodes(nnodes: str | None, node_rank: int | None, master_addr: str | None,
                 rdzv_endpoint: str | None, rdzv_backend: str | None) -> None:
    """Multi-node flags that torchrun would accept and then hang on (or fail deep inside) are refused here."""
    if nnodes is not None:
        parts = nnodes.split(":")
        if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts) or int(parts[0]) > int(parts[-1]):
            raise KilnError(f"--nnodes must be a number >= 1 or MIN:MAX (MIN <= MAX), got {nnodes!r}")
        fixed = len(parts) == 1
        if fixed and node_rank is not None and node_rank >= int(nnodes):
            raise KilnError(f"--node-rank {node_rank} is out of range for --nnodes {nnodes}: node ranks run "
                            f"from 0 to {int(nnodes) - 1}")
        if int(parts[-1]) > 1 and rdzv_endpoint is None and master_addr is None:
            raise KilnError(f"--nnodes {nnodes} needs a meeting point every node can reach: --rdzv-endpoint HOST:PORT "
                            "(node rank 0's host and a free port), the same on every node")
        # the static rendezvous (torchrun's default) numbers ranks by node rank; c10d assigns them itself
        if fixed and int(nnodes) > 1 and node_rank is None and rdzv_backend in (None, "static"):
            raise KilnError(f"--nnodes {nnodes} needs --node-rank on each node (0 on the node that hosts "
                            "the rendezvous and global rank 0)")
    elif node_rank:
        raise KilnError(f"--node-rank {node_rank} without --nnodes: say how many nodes take part")
    if rdzv_endpoint is not None:
        host, _, port = rdzv_endpoint.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise KilnError(f"--rdzv-endpoint must be HOST:PORT (e.g. node0.cluster:29500), got {rdzv_endpoint!r}")


def plot(run_dir: Path = typer.Argument(..., help="A run directory with metrics.jsonl."),
         out: Path | None = typer.Option(None, "--out", help="PNG path (default RUN_DIR/curves.png).")) -> None:
    """Plot loss, learning rate and eval curves of a run as a PNG."""
    from kiln.train.plot import plot_run

    typer.echo(str(plot_run(run_dir, out)))


def register(app: typer.Typer) -> None:
    app.command("train")(_with_recipe_flags(train))
    app.command("launch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(launch)
    app.command("plot")(plot)
