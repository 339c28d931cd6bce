"""`kiln serve`: an OpenAI-compatible HTTP server on the generation engine (kiln.engine).

protocol.py (the wire format: strict request models, errors naming the field, SSE framing), tools.py (messages and
tool calls between OpenAI's form and the chat template's), results.py (log-probs in OpenAI's shapes), async_engine.py
(the one thread that drives the engines), adapters.py (LoRA adapters over one base), app.py (the Starlette routes).
The command is kiln/cli/serve.py.
"""
