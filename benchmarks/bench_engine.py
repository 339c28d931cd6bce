"""kiln's generation engine vs transformers' generate and kiln's old static loop, CPU, greedy.

The model: Qwen3 layout with the real vocabulary (151,936), hidden 256, 2 layers, 4 heads over 2 kv heads of 64,
tied embeddings, random weights built by transformers and saved once; every side loads that directory. The
requests: turns of chatterbot-corpus's English conversations (a PyPI package's real chat set): the prompt is
the conversation so far, the output length the next turn's, both counted by a byte-level BPE trained on the
corpus (its ids sit inside the 151,936 vocabulary; the softmax still runs over all of it). Random weights would
stop at an EOS id by chance, so EOS is off and each request asks for exactly its turn's length.

At concurrency c (1, 8, 32) 2c requests (4 at c=1) arrive at once. transformers (`generate`, its default
cache) and the old loop (kiln's earlier `generate`, as copied into benchmarks/old_loop.py) take them in static
batches of c, left-padded,
each batch decoding to its longest request; the engine keeps c sequences running and admits the next request
as one ends. Throughput counts the requested output tokens over the wall time; time to first token runs from
the arrival (queueing included). KV memory: the engine's cache slots held against the tokens they hold, at
every step of the c=32 run (transformers holds batch x longest row). Ratios last.

    python benchmarks/bench_engine.py [--rounds 2] [--concurrency 1 8 32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import load_average, report, setup_torch

SIZE = dict(vocab_size=151936, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True,
            pad_token_id=0, eos_token_id=None)


def chat_requests(tmp: Path) -> list[tuple[list[int], int]]:
    """(prompt ids, output length) for every turn after the first of chatterbot-corpus's English
    conversations, tokenized by a BPE trained on the corpus."""
    import json

    import chatterbot_corpus
    import yaml

    from kiln.data.bpe import train_bpe
    from kiln.hub.tokenizer import Tokenizer

    root = Path(chatterbot_corpus.__file__).parent / "data" / "english"
    convs = []
    for f in sorted(root.glob("*.yml")):
        for c in yaml.safe_load(f.read_text(encoding="utf-8")).get("conversations", []):
            turns = [str(t) for t in c if t is not None]
            if len(turns) >= 2:
                convs.append(turns)
    (tmp / "text.jsonl").write_text("".join(json.dumps({"text": "\n".join(c)}) + "\n" for c in convs),
                                    encoding="utf-8")
    train_bpe([tmp / "text.jsonl"], tmp / "tok", vocab_size=4000, min_frequency=1)
    tok = Tokenizer.from_dir(tmp / "tok")
    out = []
    for c in convs:
        for i in range(1, len(c)):
            prompt = tok.backend.encode("\n".join(c[:i]), add_special_tokens=False).ids
            reply = tok.backend.encode(c[i], add_special_tokens=False).ids
            if prompt and reply:
                out.append((list(prompt), max(4, len(reply))))
    return out


def static_batches(requests, c):
    return [requests[s:s + c] for s in range(0, len(requests), c)]


def run_hf(model, requests, c) -> tuple[float, list[float]]:
    import torch
    import transformers

    firsts: list[float] = []

    class First(transformers.LogitsProcessor):
        def __init__(self, rows):
            self.rows, self.seen = rows, False

        def __call__(self, ids, scores):
            if not self.seen:
                self.seen = True
                firsts.extend([time.perf_counter()] * self.rows)
            return scores

    t0 = time.perf_counter()
    for batch in static_batches(requests, c):
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(n for _, n in batch),
                           min_new_tokens=max(n for _, n in batch), do_sample=False, pad_token_id=0,
                           logits_processor=transformers.LogitsProcessorList([First(len(batch))]))
    return time.perf_counter() - t0, [f - t0 for f in firsts]


def run_old(model, requests, c) -> tuple[float, list[float]]:
    import torch
    from old_loop import generate  # kiln's earlier loop, kept as the measured baseline  # engfsdp

    firsts: list[float] = []
    t0 = time.perf_counter()
    for batch in static_batches(requests, c):
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
        seen = []

        def first(_tok, seen=seen, rows=len(batch)):  # noqa: B008 - binds this batch's row count, on purpose
            if not seen:
                seen.append(1)
                firsts.extend([time.perf_counter()] * rows)

        generate(model, ids, mask, max_new_tokens=max(n for _, n in batch), eos_token_id=[], pad_token_id=0,
                 on_token=first)
    return time.perf_counter() - t0, [f - t0 for f in firsts]


def run_engine(model, requests, c, kv: list | None = None) -> tuple[float, list[float]]:
    from kiln.engine import Engine, SamplingParams

    engine = Engine(model, max_seqs=c, step_tokens=512, eos_token_ids=[])
    firsts: dict[str, float] = {}
    t0 = time.perf_counter()
    for p, n in requests:
        engine.add_request(p, SamplingParams(max_tokens=n, temperature=0.0))
    while engine.has_unfinished():
        for o in engine.step():
            firsts.setdefault(o.request_id, time.perf_counter() - t0)
        if kv is not None:
            kv.append({**engine.kv_usage(), "block_size": engine.pool.block_size,
                       "reserved": engine.pool.num_blocks * engine.pool.bytes_per_block()})
    return time.perf_counter() - t0, list(firsts.values())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()
    setup_torch()
    import torch
    import transformers
    from common import loaded_pair

    with tempfile.TemporaryDirectory() as tmp:
        pool = chat_requests(Path(tmp))
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    hf, ours, n_params = loaded_pair(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SIZE)))
    hf.eval()
    ours.eval()
    ours.config.eos_token_id = None
    hf.generation_config.eos_token_id = None
    print(f"model: {n_params / 1e6:.1f}M parameters; {len(pool)} chat turns; {load_average()}", flush=True)
    rng = random.Random(0)
    rows = []
    for c in args.concurrency:
        requests = rng.sample(pool, 4 if c == 1 else 2 * c)
        useful = sum(n for _, n in requests)
        lp, lo = [len(p) for p, _ in requests], [n for _, n in requests]
        print(f"c={c}: {len(requests)} requests, prompt tokens {min(lp)}-{max(lp)} (mean {statistics.mean(lp):.0f}),"
              f" output tokens {min(lo)}-{max(lo)} (mean {statistics.mean(lo):.0f})", flush=True)
        got: dict[str, list[tuple[float, float]]] = {"transformers": [], "old loop": [], "engine": []}
        kv: list = []
        for r in range(args.rounds):
            for side, fn in (("transformers", lambda: run_hf(hf, requests, c)),
                             ("old loop", lambda: run_old(ours, requests, c)),
                             ("engine", lambda: run_engine(ours, requests, c, kv if c == max(args.concurrency)
                                                           and r == 0 else None)))[:: 1 if r % 2 == 0 else -1]:
                wall, firsts = fn()
                tps, ttft = useful / wall, statistics.mean(firsts)
                print(f"  round {r + 1} {side:>12}: {tps:8.1f} tokens/s, mean TTFT {ttft * 1000:8.1f} ms", flush=True)
                got[side].append((tps, ttft))
        rows.append((c, got))
        if kv:
            held = [k for k in kv if k["tokens"]]
            peak = max(held, key=lambda k: k["tokens"])
            ratio = max(k["slots"] / k["tokens"] for k in held)
            mean = sum(k["slots"] for k in held) / sum(k["tokens"] for k in held)
            print(f"  engine KV at c={c} (block size {peak['block_size']}): at the peak {peak['tokens']} tokens in "
                  f"{peak['slots']} slots ({peak['slots'] / peak['tokens']:.3f}x, {peak['bytes'] / 2**20:.2f} MiB); "
                  f"over {len(held)} steps {mean:.3f}x (slots / tokens summed), at most {ratio:.3f}x; the pool "
                  f"reserves {peak['reserved'] / 2**20:.1f} MiB (the default kv_blocks: max_seqs sequences of the "
                  "model's 1,024 positions); transformers' static batches hold batch x longest row", flush=True)
    scoring(ours)
    print(load_average())
    for c, got in rows:
        fast = {side: min(t for _, t in v) for side, v in got.items()}
        print(f"c={c:>2}: TTFT (best round) engine {fast['engine'] * 1000:.0f} ms, transformers "
              f"{fast['transformers'] * 1000:.0f} ms, old loop {fast['old loop'] * 1000:.0f} ms: engine/transformers "
              f"{fast['engine'] / fast['transformers']:.2f}, engine/old loop {fast['engine'] / fast['old loop']:.2f}")
    for c, got in rows:
        for peer in ("transformers", "old loop"):
            report(f"generation engine, {c} concurrent chat requests (greedy)", peer, "tokens/s",
                   [t for t, _ in got["engine"]], [t for t, _ in got[peer]],
                   goal=">= 3x" if c == 32 and peer == "transformers" else "")


def scoring(model) -> None:
    """The exact scoring forward (kiln.engine.token_logps, the engine's bits) against the training forward
    (ForCausalLM.token_logps, exact path), forward and backward over 8 sequences of 64 tokens."""
    import torch

    from kiln.engine import token_logps

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, 4000, (8, 64), generator=g)
    targets = torch.cat([ids[:, 1:], torch.full((8, 1), -100)], 1)
    targets[:, :15] = -100
    model.train()
    times = {}
    for side in ("training forward", "scoring forward", "training forward", "scoring forward"):
        model.zero_grad(set_to_none=True)
        t = time.perf_counter()
        if side == "training forward":
            lp = model.token_logps(ids, None, targets).sum()
        else:
            lp = torch.cat(token_logps(model, ids.tolist(), [16] * 8)).sum()
        lp.backward()
        times[side] = min(times.get(side, float("inf")), time.perf_counter() - t)
    model.eval()
    train, score = times["training forward"], times["scoring forward"]
    print(f"log-probs of 8 x 48 completion tokens, forward + backward: training forward {train * 1000:.0f} ms, "
          f"the engine's scoring forward {score * 1000:.0f} ms ({score / train:.2f}x)", flush=True)

if __name__ == "__main__":
    main()
