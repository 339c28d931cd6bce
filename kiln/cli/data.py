"""`kiln tokenize`: text, JSONL, parquet or arrow files to token shards with a manifest."""

from __future__ import annotations

from pathlib import Path

import typer


def tokenize(inputs: list[Path] = typer.Argument(..., help="Files or directories (.txt = one document per file, "
                                                            ".jsonl, .parquet, .arrow)."),
             tokenizer: Path = typer.Option(..., "--tokenizer", "-t",
                                            help="An HF directory, a tokenizer.json, or a Hub repo id."),
             out: Path = typer.Option(..., "--out", "-o", help="The shard directory to write."),
             text_field: str = typer.Option("text", "--text-field", help="The JSONL field / table column with the text."),
             val_fraction: float = typer.Option(0.0, "--val-fraction", help="Share of documents held out for validation."),
             seed: int = typer.Option(0, "--seed", help="Seed of the validation split."),
             shard_tokens: int = typer.Option(1 << 24, "--shard-tokens", help="Tokens per shard (cut at document ends)."),
             workers: int = typer.Option(1, "--workers", "-j", help="Tokenizer processes."),
             dtype: str = typer.Option("auto", "--dtype", help="auto (uint16 if the vocabulary fits), uint16, uint32."),
             eos: str = typer.Option(None, "--eos", help="The token ending each document (default: the tokenizer's "
                                                         "eos_token)."),
             encoding_errors: str = typer.Option("strict", "--encoding-errors", help="strict, or replace bad UTF-8."),
             overwrite: bool = typer.Option(False, "--overwrite", help="Replace the shards already in --out."),
             progress: bool = typer.Option(True, "--progress/--no-progress")) -> None:
    """Tokenize documents into .npy token shards (EOS after each document) plus manifest.json."""
    from kiln.data.tokenize import TokenizeOptions, tokenize_to_shards
    from kiln.errors import KilnError
    from kiln.hub.outdir import describe, holdings
    from kiln.hub.resolve import resolve_model_dir

    if encoding_errors not in ("strict", "replace"):
        raise KilnError(f"--encoding-errors must be strict or replace, got {encoding_errors!r}")
    if out.exists() and not out.is_dir():
        raise KilnError(f"--out {out}: is a file, not a directory; choose a directory for the shards")
    # shards already there are kiln.data.tokenize's to refuse (or replace); a model, tokenizer or run is not
    found = {k: v for k, v in holdings(out).items() if "shards" not in k}
    if found and not overwrite:
        raise KilnError(f"--out {out}: already holds {describe(found)}; choose another directory, or pass "
                        "--overwrite to write shards beside them")
    options = TokenizeOptions(text_field=text_field, val_fraction=val_fraction, seed=seed, shard_tokens=shard_tokens,
                              workers=workers, dtype=dtype, eos=eos, encoding_errors=encoding_errors,
                              overwrite=overwrite, progress=progress)
    m = tokenize_to_shards(inputs, resolve_model_dir(tokenizer), out, options)  # a path, or org/name[@rev]
    parts = [f"{name}: {s['documents']:,} documents, {s['tokens']:,} tokens in {len(s['shards'])} shard(s)"
             for name, s in m["splits"].items() if s["shards"]]
    typer.echo(f"{out}: {m['dtype']}, vocab {m['vocab_size']:,}, eos {m['eos_token']!r} = {m['eos_id']}; "
               + "; ".join(parts))


def register(app: typer.Typer) -> None:
    app.command("tokenize")(tokenize)
