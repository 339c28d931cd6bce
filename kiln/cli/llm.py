"""Language-model commands: generate, chat, tokenizer train."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

from kiln.errors import KilnError

out = Console()


def _sampling(temperature: float, top_k: int, top_p: float, seed: Optional[int]) -> dict:
    return dict(do_sample=temperature > 0, temperature=temperature if temperature > 0 else 1.0, top_k=top_k,
                top_p=top_p, seed=seed)


def _load(model_dir: Path):
    from kiln.models import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    if model.tokenizer is None:
        raise KilnError(f"{model_dir}: no tokenizer files (tokenizer.json) next to the model")
    return model


def generate(model_dir: Path = typer.Argument(..., help="An HF causal-LM directory."),
             prompt: str = typer.Argument(..., help="Text to continue."),
             max_new_tokens: int = typer.Option(40, "--max-new-tokens", "-n"),
             temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy."),
             top_k: int = typer.Option(0, "--top-k"), top_p: float = typer.Option(1.0, "--top-p"),
             seed: Optional[int] = typer.Option(None, "--seed")) -> None:
    """Continue PROMPT with the model (KV cache; greedy unless --temperature > 0); stops at EOS."""
    from kiln.pipelines import generate as run

    text = run(_load(model_dir), prompt, max_new_tokens, temperature, top_k, top_p, seed)
    out.print(prompt + text, highlight=False)


def chat(model_dir: Path = typer.Argument(..., help="An HF causal-LM directory with a chat template."),
         system: Optional[str] = typer.Option(None, "--system", help="A system message."),
         max_new_tokens: int = typer.Option(128, "--max-new-tokens", "-n"),
         temperature: float = typer.Option(0.0, "--temperature", "-t", help="0 = greedy."),
         top_k: int = typer.Option(0, "--top-k"), top_p: float = typer.Option(1.0, "--top-p"),
         seed: Optional[int] = typer.Option(None, "--seed")) -> None:
    """Talk to the model turn by turn through its chat template. An empty line or Ctrl-D ends."""
    import torch

    from kiln.data.sft import chat_prompt_ids

    model = _load(model_dir)
    model.tokenizer.chat()  # fail now, not after the first question, if there is no template
    messages = [{"role": "system", "content": system}] if system else []
    while True:
        try:
            line = input("you> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        ids = torch.tensor([chat_prompt_ids(model.tokenizer, messages)])
        new = model.generate(ids, max_new_tokens=max_new_tokens, **_sampling(temperature, top_k, top_p, seed))
        reply = model.tokenizer.decode(new[0, ids.size(1):].tolist()).strip()
        out.print(f"bot> {reply}", highlight=False)
        messages.append({"role": "assistant", "content": reply})


tokenizer_app = typer.Typer(help="Tokenizer tools.", no_args_is_help=True)


@tokenizer_app.command("train")
def tokenizer_train(files: List[Path] = typer.Argument(..., help=".txt (a text per line) or .jsonl files."),
                    out_dir: Path = typer.Option(..., "--out", help="Directory to write the tokenizer to."),
                    vocab_size: int = typer.Option(4096, "--vocab-size"),
                    min_frequency: int = typer.Option(2, "--min-frequency"),
                    text_field: str = typer.Option("text", "--text-field", help="JSONL field with plain text."),
                    max_length: int = typer.Option(2048, "--model-max-length")) -> None:
    """Train a byte-level BPE tokenizer with ChatML special tokens and chat template."""
    from kiln.data.bpe import train_bpe

    tok = train_bpe(files, out_dir, vocab_size, min_frequency, text_field, max_length)
    out.print(f"wrote {out_dir}: vocab {tok.vocab_size}, specials {', '.join(f'{k}={v}' for k, v in tok.specials.items())}")


def register(app: typer.Typer) -> None:
    app.command("generate")(generate)
    app.command("chat")(chat)
    app.add_typer(tokenizer_app, name="tokenizer")
