"""Model-directory commands: inspect, export, verify-export, verify-matrix, fill-mask."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from kiln.errors import KilnError

out = Console()


def inspect_dir(model_dir: Path = typer.Argument(..., help="An HF model directory, or a Hub repo id org/name[@rev]."),
                tensors: bool = typer.Option(False, "--tensors", help="List every tensor.")) -> None:
    """What is in a model directory: family, head, parameters, dtypes, tensors, tokenizer."""
    from kiln.hub import Tokenizer, load_weights, read_config, weight_files
    from kiln.hub.resolve import resolve_model_dir
    from kiln.models.auto import load_config
    from kiln.models.tasks import get_task

    model_dir = resolve_model_dir(model_dir)  # a repo id: its snapshot in the HF cache
    raw = read_config(model_dir)
    family, config, task = load_config(model_dir)
    weights = load_weights(model_dir)
    table = Table(show_header=False, box=None)
    table.add_row("directory", str(model_dir))
    table.add_row("family", f"{family.model_type}")
    table.add_row("head", f"{get_task(task)} ({', '.join(raw.get('architectures') or ['no architectures'])})")
    table.add_row("files", ", ".join(p.name for p in weight_files(model_dir)))
    n_params = sum(v.numel() for v in weights.values() if v.dtype.is_floating_point)
    table.add_row("parameters", f"{n_params:,} in {len(weights)} tensors")
    dtypes = Counter(str(v.dtype).replace("torch.", "") for v in weights.values())
    table.add_row("dtypes", ", ".join(f"{d} x{n}" for d, n in dtypes.most_common()))
    sizes = {k: getattr(config, k) for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                             "intermediate_size", "dim", "n_layers", "n_heads") if hasattr(config, k)}
    table.add_row("sizes", ", ".join(f"{k}={v}" for k, v in sizes.items()))
    if get_task(task).label_kind is not None:
        table.add_row("labels", ", ".join(config.labels))
    if Tokenizer.present(model_dir):
        tok = Tokenizer.from_dir(model_dir)
        table.add_row("tokenizer", f"{type(tok.backend.model).__name__}, vocab {tok.vocab_size:,}, "
                                   + ", ".join(f"{k}={v}" for k, v in tok.specials.items()))
    else:
        table.add_row("tokenizer", "none")
    out.print(table)
    if tensors:
        t = Table("tensor", "shape", "dtype")
        for k, v in weights.items():
            t.add_row(k, str(tuple(v.shape)), str(v.dtype).replace("torch.", ""))
        out.print(t)


def _checkpoint_model_dir(ckpt: Path) -> Path:
    for cand in (ckpt / "model", ckpt):
        if (cand / "config.json").is_file():
            return cand
    raise KilnError(f"{ckpt}: not a kiln checkpoint (no model/config.json inside)")


def export(src: Optional[Path] = typer.Argument(None, help="An HF model directory."),
           out_dir: Path = typer.Option(..., "--out", help="Directory to write."),
           checkpoint: Optional[Path] = typer.Option(None, "--checkpoint", help="A run checkpoint, RUN_DIR/ckpt-N."),
           head: Optional[str] = typer.Option(None, "--head", help="Re-target to this head (base, masked-lm, ...)."),
           max_shard_mb: Optional[int] = typer.Option(None, "--max-shard-mb", help="Shard weights past this size.")) -> None:
    """Write an HF directory (config.json, model.safetensors, tokenizer) from a directory or checkpoint."""
    from kiln.interop.export import export_model

    if (src is None) == (checkpoint is None):
        raise KilnError("give exactly one of SRC or --checkpoint RUN_DIR/ckpt-N")
    from kiln.parallel.checkpoint import export_sharded, is_sharded

    if checkpoint is not None and is_sharded(checkpoint):  # FSDP/TP/EP shards: gathered in this process's CPU memory
        path = export_sharded(checkpoint, out_dir, max_shard_bytes=max_shard_mb * 2**20 if max_shard_mb else None)
        out.print(f"exported {checkpoint} (sharded) -> {path}")
        return
    source = _checkpoint_model_dir(checkpoint) if checkpoint is not None else src
    path = export_model(source, out_dir, head=head, max_shard_bytes=max_shard_mb * 2**20 if max_shard_mb else None)
    out.print(f"exported {source} -> {path}")


def verify_export_cmd(model_dir: Path = typer.Argument(..., help="An exported HF directory."),
                      source: Optional[Path] = typer.Option(None, "--source", help="Also check tensors equal SRC's.")) -> None:
    """Load DIR into transformers and kiln, run fixed inputs, require max abs diff = 0 everywhere."""
    from kiln.hub.resolve import resolve_model_dir
    from kiln.interop.verify import verify_export

    checks = verify_export(resolve_model_dir(model_dir), source=None if source is None else resolve_model_dir(source))
    for c in checks:
        out.print(("[green]" if c.ok else "[red]") + c.line(), highlight=False)
    failed = [c for c in checks if not c.ok]
    if failed:
        out.print(f"[red]{len(failed)} of {len(checks)} checks failed")
        raise typer.Exit(1)
    out.print(f"[green]all {len(checks)} checks passed")


def verify_matrix(cells: Optional[Path] = typer.Option(None, "--cells", help="JSON list of {family, head, path}.")) -> None:
    """Every family x head: build tiny with transformers, export with kiln, verify-export; print the grid."""
    from kiln.interop.matrix import default_cells, read_cells, run_matrix
    from kiln.models.tasks import BASE, CAUSAL_LM, ENCODER_HEADS

    todo = read_cells(str(cells)) if cells else default_cells()
    results = run_matrix(todo, on_cell=lambda c: out.print(
        f"{'PASS' if c.ok else 'FAIL'} {c.family:>12} {_short(c.head):>6}", highlight=False))
    heads = list(dict.fromkeys(c.head for c in results))
    grid = Table("family", *[_short(h) for h in heads])
    for fam in dict.fromkeys(c.family for c in results):
        row = []
        for h in heads:
            cell = next((c for c in results if c.family == fam and c.head == h), None)
            row.append("[dim]n/a[/]" if cell is None else (f"[green]PASS[/] {cell.max_diff:g}" if cell.ok else "[red]FAIL"))
        grid.add_row(fam, *row)
    out.print(grid)
    # Tallies per kind of row: encoder families (five heads each) and causal LMs.
    for kind, heads in (("encoder", ENCODER_HEADS), (CAUSAL_LM, (BASE, CAUSAL_LM))):
        cells = [c for c in results if c.head in heads and
                 set(heads) <= {x.head for x in results if x.family == c.family}]
        if cells:
            out.print(f"{kind} families x heads: {sum(c.ok for c in cells)}/{len(cells)} PASS", highlight=False)
    failed = [c for c in results if not c.ok]
    if failed:
        for c in failed:
            out.print(f"[red]FAIL {c.family} {c.head}: {c.detail}", highlight=False)
        out.print(f"[red]{len(failed)} of {len(results)} cells failed")
        raise typer.Exit(1)
    out.print(f"[green]all {len(results)} cells passed")


def _short(head: str) -> str:
    from kiln.models.tasks import TASKS

    return TASKS[head].short if head in TASKS else head


def fill_mask(model_dir: Path = typer.Argument(..., help="An HF masked-LM directory."),
              text: str = typer.Argument(..., help="Text with the model's mask token, e.g. [MASK] or <mask>."),
              k: int = typer.Option(5, "-k", "--top-k", help="How many candidates.")) -> None:
    """Top-k tokens for the mask, with probabilities, like transformers' fill-mask pipeline."""
    from kiln.pipelines import fill_mask as run

    table = Table("position", "token", "score", "sequence")
    for r in run(model_dir, text, k=k):
        table.add_row(str(r["position"]), r["token"], f"{r['score']:.4f}", r["sequence"])
    out.print(table)


def classify(model_dir: Path = typer.Argument(..., help="An HF sequence-classification directory."),
             texts: List[str] = typer.Argument(..., help="One or more texts."),
             top: int = typer.Option(3, "--top", help="How many labels to show per text.")) -> None:
    """Label each text with the model's classes and their probabilities."""
    from kiln.pipelines import classify as run

    table = Table("text", "label", "score")
    for text, scores in zip(texts, run(model_dir, list(texts))):
        for i, s in enumerate(scores[:top]):
            table.add_row(text[:60] if i == 0 else "", s["label"], f"{s['score']:.4f}")
    out.print(table)


def register(app: typer.Typer) -> None:
    app.command("inspect")(inspect_dir)
    app.command("export")(export)
    app.command("verify-export")(verify_export_cmd)
    app.command("verify-matrix")(verify_matrix)
    app.command("fill-mask")(fill_mask)
    app.command("classify")(classify)
