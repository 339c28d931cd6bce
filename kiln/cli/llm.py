"""Language-model commands: generate, tokenizer train (chat: kiln.cli.chat)."""

from __future__ import annotations

from pathlib import Path

import typer

from kiln.cli.common import ALLOW_MISSING, ALLOW_UNUSED, check_range, load_for_prediction
from kiln.cli.output import note, out
from kiln.errors import KilnError


def _sampling(max_new_tokens: int, temperature: float, top_k: int, top_p: float, seed: int | None) -> dict:
    check_range("--max-new-tokens", max_new_tokens, 0)
    check_range("--temperature", temperature, 0)
    check_range("--top-k", top_k, 0)
    check_range("--top-p", top_p, 0, 1, low_open=True)
    return dict(do_sample=temperature > 0, temperature=temperature if temperature > 0 else 1.0, top_k=top_k,
                top_p=top_p, seed=seed)


def _load(model_dir: Path, allow_missing: bool, allow_unused: bool):
    from kiln.models.tasks import CAUSAL_LM

    return load_for_prediction(model_dir, CAUSAL_LM, allow_missing, allow_unused)


# the sampling options `kiln generate` and `kiln chat` share
TEMPERATURE = typer.Option(0.0, "--temperature", "-t", help="0 = greedy.")
TOP_K = typer.Option(0, "--top-k")
TOP_P = typer.Option(1.0, "--top-p")
SEED = typer.Option(None, "--seed")


def generate(model_dir: Path = typer.Argument(..., help="An HF causal-LM directory."),
             prompt: str = typer.Argument(..., help="Text to continue."),
             max_new_tokens: int = typer.Option(40, "--max-new-tokens", "-n"),
             temperature: float = TEMPERATURE, top_k: int = TOP_K, top_p: float = TOP_P,
             seed: int | None = SEED,
             image: list[Path] | None = typer.Option(None, "--image", help="An image before the prompt "
                                                        "(image-text models; repeatable)."),
             allow_missing: bool = ALLOW_MISSING, allow_unused: bool = ALLOW_UNUSED) -> None:
    """Continue PROMPT with the model (KV cache; greedy unless --temperature > 0); stops at EOS."""
    from kiln.pipelines import generate as run

    _sampling(max_new_tokens, temperature, top_k, top_p, seed)  # every flag checked before the model loads
    for path in image or []:
        if not path.is_file():
            raise KilnError(f"--image: image file {path} does not exist")
    model = _load(model_dir, allow_missing, allow_unused)
    processor = None
    if image and hasattr(model, "image_prompt"):  # the directory's preprocessor_config.json, when it has one
        from kiln.data.images import QwenImageProcessor

        processor = QwenImageProcessor.for_model(model_dir, model.config.outer.get("vision_config"))
    positions = getattr(model.config, "max_position_embeddings", None)
    if not image and isinstance(positions, int):  # the engine ends a sequence at the last position, unsaid
        n = len(model.tokenizer.backend.encode(prompt, add_special_tokens=False).ids)
        if 0 < n < positions < n + max_new_tokens:
            note(f"--max-new-tokens {max_new_tokens}: the model reads {positions} positions in all and the prompt "
                 f"takes {n}, so at most {positions - n} new tokens come")
    text = run(model, prompt, max_new_tokens, temperature, top_k, top_p, seed, images=list(image or []) or None,
               image_processor=processor)
    out.print(prompt + text)


tokenizer_app = typer.Typer(help="Tokenizer tools.", no_args_is_help=True)


@tokenizer_app.command("train")
def tokenizer_train(files: list[Path] = typer.Argument(..., help=".txt (a text per line) or .jsonl files."),
                    out_dir: Path = typer.Option(..., "--out", help="Directory to write the tokenizer to."),
                    vocab_size: int = typer.Option(4096, "--vocab-size"),
                    min_frequency: int = typer.Option(2, "--min-frequency"),
                    text_field: str = typer.Option("text", "--text-field", help="JSONL field with plain text."),
                    max_length: int = typer.Option(2048, "--model-max-length"),
                    overwrite: bool = typer.Option(False, "--overwrite",
                                                   help="Replace a tokenizer already in --out.")) -> None:
    """Train a byte-level BPE tokenizer with ChatML special tokens and chat template."""
    from kiln.data.bpe import CHAT_TOKENS, iter_texts, train_bpe
    from kiln.hub.outdir import check_out_dir, staged_dir

    check_range("--min-frequency", min_frequency, 1)
    check_range("--model-max-length", max_length, 1)
    check_out_dir(out_dir, overwrite)
    # one pass before training: a file that is missing, not UTF-8 or bad JSON fails here, and empty input
    # (which would give a tokenizer of bare bytes without one merge) is refused
    if not any(t.strip() for t in iter_texts(files, text_field)):
        raise KilnError(f"no text to learn from in {', '.join(map(str, files))} (empty, or only blank lines)")
    with staged_dir(out_dir) as tmp:
        tok = train_bpe(files, tmp, vocab_size, min_frequency, text_field, max_length)
        if tok.vocab_size <= 256 + len(CHAT_TOKENS):  # bytes and specials only: it would not compress anything
            raise KilnError(f"no merges learned: no pair of symbols in the text occurs --min-frequency "
                            f"{min_frequency} times; give more text or lower --min-frequency")
    specials = ", ".join(f"{k}={v}" for k, v in tok.specials.items())
    out.print(f"wrote {out_dir}: vocab {tok.vocab_size}, specials {specials}")


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
    app.add_typer(tokenizer_app, name="tokenizer")
