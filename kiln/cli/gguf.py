"""The GGUF side of `kiln export --format gguf` and `kiln verify-export FILE.gguf --source ...`."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from kiln.cli.output import out, report_checks
from kiln.errors import KilnError


def _load(source: Path):
    """The model at `source`; an embedding encoder (BERT, ModernBERT) as its sentence-transformers model, so the
    GGUF and the check get its pooling."""
    import json

    from kiln.interop.gguf_arch import GGUF_FAMILIES
    from kiln.models.auto import load_pretrained

    config = source / "config.json"
    model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    fam = GGUF_FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if fam is not None and fam.encoder:
        from kiln.models.sentence import load_sentence_model

        return load_sentence_model(source)
    return load_pretrained(source)


def export_gguf(source: Path, out_file: Path, gguf_type: str, merge: bool, system: str | None,
                overwrite: bool, lora_adapter: bool = False, imatrix: Path | None = None) -> None:
    from kiln.interop.gguf_export import gguf_type as check_type
    from kiln.interop.gguf_export import write_gguf

    check_type(gguf_type)
    if out_file.exists() and not overwrite:
        raise KilnError(f"--out {out_file}: exists; pass --overwrite to replace it")
    model = _load(source)
    if lora_adapter:
        from kiln.interop.gguf_lora import write_gguf_lora

        if merge:
            raise KilnError("--merge and --lora-adapter: choose one (merged weights, or the adapter file alone)")
        path = write_gguf_lora(model, out_file, name=source.name)
        out.print(f"exported the LoRA adapter of {source} -> {path} ({path.stat().st_size / 2**20:.2f} MiB); "
                  f"llama.cpp applies it over the base's GGUF (llama-cli -m BASE.gguf --lora {path.name})")
        return
    if getattr(model, "lora_config", None) is not None and not merge:
        raise KilnError(f"{source}: holds a LoRA adapter; pass --merge to export the base with the adapter merged "
                        "in, or --lora-adapter to write the adapter as its own GGUF")
    if merge and getattr(model, "lora_config", None) is None:
        raise KilnError(f"--merge: {source} holds no LoRA adapter to merge")
    start = time.perf_counter()
    text = None
    if imatrix is not None:
        from kiln.interop.gguf_imatrix import read_calibration

        text = read_calibration(imatrix)
    path = write_gguf(model, out_file, gguf_type, name=source.name, system=system, imatrix_text=text)
    took = time.perf_counter() - start
    out.print(f"exported {source} -> {path} ({gguf_type}, {path.stat().st_size / 2**20:.2f} MiB, {took:.1f} s); "
              f"Ollama Modelfile: {path.with_name('Modelfile')}")


def verify_gguf_cmd(path: Path, source: Path | None, lora: Path | None = None) -> None:
    """`source`: the model directory (a run or checkpoint already resolved to its model/)."""
    from kiln.interop.gguf_verify import verify_gguf

    if source is None:
        raise KilnError(f"{path}: a GGUF is checked against the model it came from; give --source DIR_OR_RUN")
    checks = verify_gguf(path, _load(source), lora=lora)
    if not report_checks(checks):
        raise typer.Exit(1)
