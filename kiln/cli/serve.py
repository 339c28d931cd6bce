"""`kiln serve DIR_OR_RUN`: an OpenAI-compatible HTTP server (kiln.serve) on the generation engine, for a model
directory, a checkpoint or a run (its newest checkpoint), with LoRA adapters served beside the base by name."""

from __future__ import annotations

import functools
from pathlib import Path

import typer

from kiln.cli.common import ALLOW_MISSING, ALLOW_UNUSED, check_range, load_for_prediction
from kiln.cli.output import out
from kiln.errors import KilnError

DEFAULT_PORT = 8000


def build_state(target: Path, loras: list[str], *, name: str | None = None, max_tokens: int = 2048,
                max_queue: int = 64, max_seqs: int = 64, kv_blocks: int | None = None,
                allow_missing: bool = False, allow_unused: bool = False):
    """The served models (the base as `name`, default DIR_OR_RUN as given, and one per --lora NAME=ADAPTER) with one
    Engine each, behind one AsyncEngine (not started)."""
    from kiln.cli.eval import model_dir_of
    from kiln.engine.engine import Engine
    from kiln.models.tasks import CAUSAL_LM
    from kiln.serve.adapters import adapter_model, parse_lora_flags
    from kiln.serve.app import ServedModel, ServerState
    from kiln.serve.async_engine import AsyncEngine
    from kiln.serve.protocol import now

    check_range("--max-tokens", max_tokens, 1)
    check_range("--max-queue", max_queue, 1)
    check_range("--max-seqs", max_seqs, 1)
    adapters = parse_lora_flags(loras)  # every flag checked before the model loads
    base_name = name or str(target)
    if base_name in adapters:
        raise KilnError(f"--lora {base_name}: the base model is served under that name; pick another")
    model_dir, _ = model_dir_of(target)
    base = load_for_prediction(model_dir, CAUSAL_LM, allow_missing, allow_unused)
    models = {base_name: base} | {n: adapter_model(base, d, n) for n, d in adapters.items()}
    # factories, not engines: the AsyncEngine makes a fresh one over the same model when a step fails
    factories = {n: functools.partial(Engine, m, base.tokenizer, max_seqs=max_seqs, kv_blocks=kv_blocks)
                 for n, m in models.items()}
    engine = AsyncEngine(factories, max_queue)
    engines = engine.engines
    created = now()
    # an image-text model's vision tokens and processor (its directory's preprocessor_config.json): chat requests
    # may then hold image parts (kiln.serve.images); the adapters share the base's tower
    images = base.image_tokens(model_dir=model_dir) if getattr(base, "takes_images", False) else None
    served = {n: ServedModel(n, base.tokenizer, engines[n].vocab_size, engines[n].max_positions, created,
                             None if n == base_name else base_name, images) for n in models}
    return ServerState(served, engine, max_tokens)


# uvicorn's own bound on open connections after the engine's: the cancelled requests' last chunks go out in it
CLOSE_GRACE_S = 5.0


def _server(config, engine, bound_s: float):
    """uvicorn's Server, except that SIGTERM / Ctrl-C also drains the engine (running requests get `bound_s` seconds,
    then are cancelled) and a graceful stop ends the command with status 0 (uvicorn re-raises the signal after its
    shutdown, which would end the process as killed by it)."""
    import uvicorn

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            engine.drain(bound_s)
            super().handle_exit(sig, frame)
            getattr(self, "_captured_signals", []).clear()

    return Server(config)


def serve(target: Path = typer.Argument(..., help="A causal-LM directory, a run directory (its newest checkpoint) "
                                                  "or a checkpoint RUN_DIR/ckpt-N."),
          host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
          port: int = typer.Option(DEFAULT_PORT, "--port"),
          lora: list[str] | None = typer.Option(None, "--lora", help="NAME=ADAPTER_DIR: a PEFT LoRA adapter over "
                                                   "the base, served as model NAME (repeatable)."),
          name: str | None = typer.Option(None, "--name", help="The base model's name in requests "
                                             "(default: DIR_OR_RUN as given)."),
          max_tokens: int = typer.Option(2048, "--max-tokens", help="The most tokens one completion may ask for."),
          max_queue: int = typer.Option(64, "--max-queue", help="The most requests queued and running together; "
                                        "more are answered 429."),
          max_seqs: int = typer.Option(64, "--max-seqs", help="The most sequences an engine step runs together."),
          kv_blocks: int | None = typer.Option(None, "--kv-blocks", help="KV-cache blocks per served model "
                                                  "(default: the engine's)."),
          shutdown_timeout: float = typer.Option(30.0, "--shutdown-timeout", help="On SIGTERM / Ctrl-C: seconds "
                                                 "running requests may take to finish before they are cancelled."),
          allow_missing: bool = ALLOW_MISSING, allow_unused: bool = ALLOW_UNUSED) -> None:
    """Serve the model over HTTP, OpenAI-style: /v1/chat/completions (tools, streaming), /v1/completions,
    /v1/models, /health. SIGTERM stops taking requests, lets running ones finish within --shutdown-timeout,
    cancels the rest and exits."""
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as e:
        raise KilnError(f"kiln serve needs starlette and uvicorn ({e}); pip install 'kiln[serve]'") from None
    from kiln.serve.app import build_app

    check_range("--port", port, 0, 65535)
    check_range("--shutdown-timeout", shutdown_timeout, 0)
    state = build_state(target, list(lora or []), name=name, max_tokens=max_tokens, max_queue=max_queue,
                        max_seqs=max_seqs, kv_blocks=kv_blocks, allow_missing=allow_missing,
                        allow_unused=allow_unused)
    app = build_app(state, stop_timeout=CLOSE_GRACE_S)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout + CLOSE_GRACE_S)  # type: ignore[arg-type]
    server = _server(config, state.engine, shutdown_timeout)
    out.print(f"kiln serve: {', '.join(state.models)} on http://{host}:{port}/v1 "
              "(GET /health; Ctrl-C or SIGTERM stops)")
    server.run()
    if not server.started:  # e.g. the port is taken: uvicorn logged why
        raise KilnError(f"could not serve on {host}:{port} (is the port in use?)")


def register(app: typer.Typer) -> None:
    app.command("serve")(serve)
