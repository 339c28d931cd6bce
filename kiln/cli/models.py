"""Model-directory commands: inspect, export, verify-export, verify-matrix, fill-mask, classify."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import typer
from rich.table import Table

from kiln.cli.common import ALLOW_MISSING, ALLOW_UNUSED, check_range, fit_length, load_for_prediction
from kiln.cli.output import note, out, report_checks, styled
from kiln.errors import KilnError


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
    n_params, quant = _count_parameters(weights, raw, model_dir)
    table.add_row("parameters", f"{n_params:,} in {len(weights)} tensors")
    if quant:
        table.add_row("quantization", quant)
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
    import torch

    from kiln.errors import WeightsError
    from kiln.models.pretrained import stored_dtype_problems

    with torch.device("meta"):  # what a load would refuse (an int32 under a float weight's name), said here too
        problems = stored_dtype_problems(family.build(config, get_task(task)), weights, str(model_dir))
    if problems:
        raise WeightsError("; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""))


def _count_parameters(weights: dict, raw: dict, model_dir: Path) -> tuple[int, str | None]:
    """(parameter count, the quantization line or None): a block-scaled checkpoint's scales are not parameters,
    and packed FP4 holds two a byte."""
    from kiln.hub.fp8 import SCALE_SUFFIX, canonical_scales, fp8_pairs, is_fp4, logical_shape, scheme_from_config

    scheme = scheme_from_config(raw, str(model_dir / "config.json"))
    if scheme is None:
        return sum(v.numel() for v in weights.values() if v.dtype.is_floating_point), None
    state, scheme = canonical_scales(weights, scheme)
    pairs = fp8_pairs(state, scheme, str(model_dir))
    scales = {k + SCALE_SUFFIX for k in pairs}
    total = sum(math.prod(logical_shape(v)) for k, v in state.items()
                if k not in scales and (v.dtype.is_floating_point or k in pairs))
    n4 = sum(1 for q, _ in pairs.values() if is_fp4(q))
    return total, f"{scheme.describe()}; {len(pairs) - n4} fp8 and {n4} fp4 tensors, {len(pairs)} scales"


def checkpoint_dir(ckpt: Path) -> Path:
    """A run checkpoint (RUN/ckpt-N, or its model/ folder), checked against its manifest as a resume checks it."""
    from kiln.parallel.checkpoint import is_sharded
    from kiln.train.checkpoint import CKPT_RE, list_paths, verify_checkpoint

    if not ckpt.is_dir():
        raise KilnError(f"--checkpoint {ckpt}: no such checkpoint directory")
    if ckpt.name == "model" and CKPT_RE.match(ckpt.parent.name):
        ckpt = ckpt.parent  # the manifest that covers model/ sits one level up
    if not (ckpt / "manifest.json").is_file():
        found = [p.name for p in list_paths(ckpt)]
        if found:
            raise KilnError(f"--checkpoint {ckpt}: is a run directory; name one of its checkpoints, e.g. "
                            + ", ".join(str(ckpt / n) for n in found[-2:]))
        if is_sharded(ckpt) and not CKPT_RE.match(ckpt.name):
            return ckpt  # torch.distributed.checkpoint shards saved outside a run: no manifest to check
        if not CKPT_RE.match(ckpt.name):
            raise KilnError(f"--checkpoint {ckpt}: not a kiln checkpoint (no manifest.json); to export a model "
                            "directory give it as SRC")
    problem = verify_checkpoint(ckpt)
    if problem is not None:
        raise KilnError(f"--checkpoint {ckpt}: not a usable checkpoint: {problem}")
    if not (ckpt / "model" / "config.json").is_file():
        raise KilnError(f"--checkpoint {ckpt}: no model/config.json inside")
    return ckpt


def source_model_dir(path: Path) -> Path:
    """A model directory, a run checkpoint (RUN/ckpt-N) or a run directory (its newest checkpoint) -> the model
    directory to load."""
    from kiln.parallel.checkpoint import is_sharded
    from kiln.train.checkpoint import list_paths

    if (path / "config.json").is_file():
        return path
    if path.is_dir() and not (path / "manifest.json").is_file() and list_paths(path):
        path = list_paths(path)[-1]
    ckpt = checkpoint_dir(path)
    if is_sharded(ckpt):
        raise KilnError(f"{ckpt}: a sharded checkpoint; export it to an HF directory first (kiln export "
                        f"--checkpoint {ckpt} --out DIR), then to GGUF from DIR")
    return ckpt / "model"


def export(src: Path | None = typer.Argument(None, help="An HF model directory."),
           out_dir: Path = typer.Option(..., "--out", help="Directory to write (--format gguf: the .gguf file)."),
           checkpoint: Path | None = typer.Option(None, "--checkpoint", help="A run checkpoint, RUN_DIR/ckpt-N."),
           head: str | None = typer.Option(None, "--head", help="Re-target to this head (base, masked-lm, ...)."),
           max_shard_mb: int | None = typer.Option(None, "--max-shard-mb", help="Shard weights past this size."),
           overwrite: bool = typer.Option(False, "--overwrite",
                                          help="Replace the model or tokenizer already in --out."),
           allow_missing: bool = ALLOW_MISSING, allow_unused: bool = ALLOW_UNUSED,
           dtype: str | None = typer.Option(None, "--dtype", help="Write every weight as bf16, fp16 or fp32 "
                                               "(an FP8 source: dequantized, quantization_config dropped)."),
           quantize: str | None = typer.Option(None, "--quantize", help="Write the Linears 4-bit, nf4 or fp4 "
                                                  "(a bitsandbytes-4bit directory; after any LoRA merge)."),
           fmt: str = typer.Option("hf", "--format", help="hf (an HF directory) or gguf (one file for llama.cpp / "
                                   "Ollama, with a Modelfile beside it)."),
           gguf_type: str = typer.Option("f16", "--gguf-type", help="GGUF tensor type: f32, f16, bf16, q8_0, "
                                         "q4_k_m, q5_k_m, q6_k (K-quants by llama.cpp's quantizer)."),
           merge: bool = typer.Option(False, "--merge", help="GGUF: merge the LoRA adapter into the base "
                                      "(a QLoRA base dequantized first)."),
           system: str | None = typer.Option(None, "--system", help="GGUF: the SYSTEM prompt of the "
                                                "Ollama Modelfile."),
           lora_adapter: bool = typer.Option(False, "--lora-adapter", help="GGUF: write the LoRA adapter alone as "
                                             "a GGUF adapter llama.cpp applies over the base's GGUF."),
           imatrix: Path | None = typer.Option(None, "--imatrix", help="GGUF K-quants: a calibration text file; "
                                                  "kiln's importance matrix on it steers llama.cpp's quantizer.")) -> None:
    """Write an HF directory (config.json, model.safetensors, tokenizer) from a directory or checkpoint,
    or with --format gguf one GGUF file (+ Ollama Modelfile)."""
    from kiln.hub.outdir import check_out_dir, staged_dir
    from kiln.interop.export import export_model

    if (src is None) == (checkpoint is None):
        raise KilnError("give exactly one of SRC or --checkpoint RUN_DIR/ckpt-N")
    if fmt not in ("hf", "gguf"):
        raise KilnError(f"--format {fmt!r}: choose hf or gguf")
    if fmt == "gguf":
        from kiln.cli.gguf import export_gguf

        given = [f for f, v in (("--head", head), ("--max-shard-mb", max_shard_mb), ("--dtype", dtype),
                                ("--quantize", quantize)) if v is not None]
        if given:
            raise KilnError(f"{', '.join(given)}: HF-directory options; a GGUF's type is --gguf-type")
        if src is not None:
            from kiln.hub.resolve import resolve_model_dir

            src = resolve_model_dir(src)
        given_dir = src if src is not None else checkpoint
        assert given_dir is not None  # exactly one of SRC and --checkpoint (checked above)
        export_gguf(source_model_dir(given_dir), out_dir, gguf_type, merge, system, overwrite, lora_adapter, imatrix)
        return
    if merge or system is not None or lora_adapter or imatrix is not None:
        raise KilnError("--merge, --lora-adapter, --imatrix and --system are GGUF options (an HF export always merges LoRA); "
                        "add --format gguf")
    if max_shard_mb is not None:
        check_range("--max-shard-mb", max_shard_mb, 1)
    if src is not None:
        from kiln.hub.resolve import resolve_model_dir

        src = resolve_model_dir(src)  # a local directory, or a Hub repo id's cached snapshot
        if not src.is_dir():
            raise KilnError(f"{src}: no such model directory")
    shard_bytes = max_shard_mb * 2**20 if max_shard_mb else None
    import torch

    from kiln.parallel.checkpoint import export_sharded, is_sharded

    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    if dtype is not None and dtype not in dtypes:
        raise KilnError(f"--dtype {dtype!r}: choose one of {', '.join(dtypes)}")
    ckpt = checkpoint_dir(checkpoint) if checkpoint is not None else None
    if ckpt is not None and is_sharded(ckpt):  # FSDP/TP/EP/PP shards: gathered in this process's CPU memory
        if head is not None:
            raise KilnError("--head cannot re-target a sharded checkpoint; export it first, then re-head the export")
        check_out_dir(out_dir, overwrite)
        with staged_dir(out_dir) as tmp:
            export_sharded(ckpt, tmp, max_shard_bytes=shard_bytes, dtype=dtypes[dtype] if dtype else None)
        out.print(f"exported {ckpt} (sharded) -> {out_dir}")
        return
    source = ckpt / "model" if ckpt is not None else src
    assert source is not None  # exactly one of SRC and --checkpoint (checked above)
    path = export_model(source, out_dir, head=head, max_shard_bytes=shard_bytes, overwrite=overwrite,
                        allow_missing=allow_missing, allow_unused=allow_unused, on_note=note,
                        dtype=dtypes[dtype] if dtype else None, quantize=quantize)
    out.print(f"exported {source} -> {path}")


def _device(name: str) -> str:
    """A --device value checked before any model is built: a clear message where torch cannot use it."""
    import torch

    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise KilnError(f"--device {name!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise KilnError(f"--device {name!r}: this torch ({torch.__version__}) sees no CUDA device")
    return name


def verify_export_cmd(model_dir: Path = typer.Argument(..., help="An exported HF directory, or a .gguf file."),
                      source: Path | None = typer.Option(None, "--source", help="Also check tensors equal SRC's "
                                                            "(a .gguf: the model dir or run it came from)."),
                      device: str = typer.Option("cpu", "--device", help="Run both models on this device (cpu, cuda, cuda:1)."),
                      lora: Path | None = typer.Option(None, "--lora", help="A .gguf: llama.cpp applies this GGUF "
                                                          "LoRA adapter over it (--source: the LoRA directory or run).")) -> None:
    """Load DIR into transformers and kiln, run fixed inputs, require max abs diff = 0 everywhere
    (a FILE.gguf: llama.cpp against kiln's model from --source)."""
    from kiln.hub.resolve import resolve_model_dir

    if model_dir.suffix == ".gguf":
        from kiln.cli.gguf import verify_gguf_cmd

        verify_gguf_cmd(model_dir, None if source is None else source_model_dir(resolve_model_dir(source)), lora)
        return
    if lora is not None:
        raise KilnError("--lora: a GGUF adapter is checked over a base .gguf; DIR is not one")
    from kiln.interop.verify import verify_export

    checks = verify_export(resolve_model_dir(model_dir), source=None if source is None else resolve_model_dir(source),
                           device=_device(device))
    if not report_checks(checks):
        raise typer.Exit(1)


def verify_matrix(cells: Path | None = typer.Option(None, "--cells", help="JSON list of {family, head, path}."),
                  device: str = typer.Option("cpu", "--device", help="Run both models on this device (cpu, cuda, cuda:1).")) -> None:
    """Every family x head: build tiny with transformers, export with kiln, verify-export; print the grid."""
    from kiln.interop.matrix import default_cells, read_cells, run_matrix
    from kiln.models.tasks import BASE, CAUSAL_LM, ENCODER_HEADS

    todo = read_cells(str(cells)) if cells else default_cells()
    results = run_matrix(todo, on_cell=lambda c: out.print(
        f"{'PASS' if c.ok else 'FAIL'} {c.family:>12} {_short(c.head):>6}"),
        device=_device(device))
    heads = list(dict.fromkeys(c.head for c in results))
    grid = Table("family", *[_short(h) for h in heads])
    for fam in dict.fromkeys(c.family for c in results):
        row = []
        for h in heads:
            cell = next((c for c in results if c.family == fam and c.head == h), None)
            row.append(styled("n/a", "dim") if cell is None else
                       (styled(f"PASS {cell.max_diff:g}", "green") if cell.ok else styled("FAIL", "red")))
        grid.add_row(fam, *row)
    out.print(grid)
    # Tallies per kind of row: encoder families (five heads each) and causal LMs.
    for kind, kind_heads in (("encoder", ENCODER_HEADS), (CAUSAL_LM, (BASE, CAUSAL_LM))):
        tallied = [c for c in results if c.head in kind_heads and
                   set(kind_heads) <= {x.head for x in results if x.family == c.family}]
        if tallied:
            out.print(f"{kind} families x heads: {sum(c.ok for c in tallied)}/{len(tallied)} PASS")
    failed = [c for c in results if not c.ok]
    if failed:
        for c in failed:
            out.print(styled(f"FAIL {c.family} {c.head}: {c.detail}", "red"))
        out.print(styled(f"{len(failed)} of {len(results)} cells failed", "red"))
        raise typer.Exit(1)
    out.print(styled(f"all {len(results)} cells passed", "green"))


def _short(head: str) -> str:
    from kiln.models.tasks import TASKS

    return TASKS[head].short if head in TASKS else head


def fill_mask(model_dir: Path = typer.Argument(..., help="An HF masked-LM directory."),
              text: str = typer.Argument(..., help="Text with the model's mask token, e.g. [MASK] or <mask>."),
              k: int = typer.Option(5, "-k", "--top-k", help="How many candidates."),
              allow_missing: bool = ALLOW_MISSING, allow_unused: bool = ALLOW_UNUSED) -> None:
    """Top-k tokens for the mask, with probabilities, like transformers' fill-mask pipeline."""
    from kiln.models.tasks import MASKED_LM
    from kiln.pipelines import fill_mask as run

    check_range("-k", k, 1)
    model = load_for_prediction(model_dir, MASKED_LM, allow_missing, allow_unused)
    check_range("-k", k, 1, model.config.vocab_size)
    fit_length(model, model.tokenizer.encode([text])["input_ids"].shape[1], "the text", cut=False)
    table = Table("position", "token", "score", "sequence")
    for r in run(model, text, k=k):
        table.add_row(str(r["position"]), r["token"], f"{r['score']:.4f}", r["sequence"])
    out.print(table)


def classify(model_dir: Path = typer.Argument(..., help="An HF sequence-classification directory."),
             texts: list[str] = typer.Argument(..., help="One or more texts."),
             top: int = typer.Option(3, "--top", help="How many labels to show per text."),
             allow_missing: bool = ALLOW_MISSING, allow_unused: bool = ALLOW_UNUSED) -> None:
    """Label each text with the model's classes and their probabilities."""
    from kiln.models.tasks import SEQUENCE_CLASSIFICATION
    from kiln.pipelines import classify as run

    check_range("--top", top, 1)
    model = load_for_prediction(model_dir, SEQUENCE_CLASSIFICATION, allow_missing, allow_unused)
    lengths = model.tokenizer.encode(list(texts))["attention_mask"].sum(-1).tolist()
    cut = [fit_length(model, n, f"text {i + 1}", cut=True) for i, n in enumerate(lengths)]
    limit = min((c for c in cut if c is not None), default=None)
    table = Table("text", "label", "score")
    for text, scores in zip(texts, run(model, list(texts), **({"max_length": limit} if limit else {}))):
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
