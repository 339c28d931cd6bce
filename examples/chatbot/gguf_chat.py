"""The chatbot example's model in llama.cpp: export it to GGUF, hold one conversation through llama-cpp-python's chat
completion and the same conversation through `kiln chat`, both at temperature 0, and compare the transcripts.

    .venv/bin/python examples/chatbot/run.py          # or at least its stage 1: runs/tok, runs/base
    .venv/bin/python examples/chatbot/gguf_chat.py [--run runs/base] [--type f32]

Needs llama-cpp-python (`make gguf-peer`). Exits 1 when the transcripts differ, printing where.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
# the kiln of the tree this script is in, whatever kiln the interpreter has installed
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE.parent.parent.resolve()),
                                                                 os.environ.get("PYTHONPATH")]))}
TURNS = ["Hi, How is it going?", "My printer is not printing.", "Tell me a joke"]  # questions from its training data
MAX_NEW = 48


def kiln(*args: str, stdin: str | None = None) -> str:
    print("$ kiln " + " ".join(args), flush=True)
    done = subprocess.run([sys.executable, "-m", "kiln.cli.main", *args], cwd=HERE, text=True, input=stdin,
                          capture_output=True, env=ENV)
    if done.returncode:
        raise SystemExit(f"kiln {args[0]} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def kiln_transcript(model_dir: str) -> list[str]:
    """`kiln chat` fed the turns on stdin (one line each, then EOF); its `bot>` lines are the replies."""
    out = kiln("chat", model_dir, "--temperature", "0", "--max-new-tokens", str(MAX_NEW), stdin="\n".join(TURNS) + "\n")
    replies = [line.split("bot>", 1)[1].strip() for line in out.splitlines() if "bot>" in line]
    if len(replies) != len(TURNS):
        raise SystemExit(f"kiln chat gave {len(replies)} replies for {len(TURNS)} turns:\n{out}")
    return replies


def llama_transcript(gguf_path: Path) -> list[str]:
    """llama-cpp-python's chat completion over the GGUF, rendering with the chat template the file carries,
    greedy (temperature 0, no repeat penalty), the KV cache in f32 like kiln's."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf_path), n_ctx=256, verbose=False, seed=0,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    messages, replies = [], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        out = llm.create_chat_completion(messages=messages, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0,
                                         repeat_penalty=1.0, max_tokens=MAX_NEW)
        reply = out["choices"][0]["message"]["content"].strip()
        replies.append(reply)
        messages.append({"role": "assistant", "content": reply})
    return replies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="runs/base", help="the trained run (its last checkpoint is exported)")
    ap.add_argument("--type", default="f32", choices=["f32", "f16"])
    args = ap.parse_args()
    ckpt = str(sorted((HERE / args.run).glob("ckpt-*"))[-1].relative_to(HERE))
    model_dir, gguf_path = f"{args.run}-model", HERE / f"{args.run}-{args.type}.gguf"
    if not (HERE / model_dir / "config.json").is_file():
        kiln("export", "--checkpoint", ckpt, "--out", model_dir)
    print(kiln("export", model_dir, "--format", "gguf", "--out", str(gguf_path.relative_to(HERE)),
               "--gguf-type", args.type, "--overwrite"), end="")
    ours, theirs = kiln_transcript(model_dir), llama_transcript(gguf_path)
    for turn, a, b in zip(TURNS, ours, theirs):
        print(f"you> {turn}\n  kiln chat: {a}\n  llama.cpp: {b}")
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b]
    print("transcripts equal" if not differ else f"transcripts differ at turn(s) {[i + 1 for i in differ]}")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
