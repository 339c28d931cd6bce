"""Encoder throughput, kiln vs transformers, same random weights and inputs, on CPU.

For each family (BERT-base shaped by default): forward (eval, no grad) and forward+backward
(train mode) samples/s, interleaving the two libraries rep by rep so machine noise hits both, and
taking the best rep of each (the least disturbed one on a shared machine).
Prints kiln/transformers ratios last (> 1.0 means kiln is faster).

    python benchmarks/bench_encoders.py [--families bert,deberta-v2] [--layers 12] [--seq 128] [--batch 8]

Run by hand (not in `make bench`): forward-only and per-family rows are not in the results table, whose
encoder training step is bench_bert_step.py.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
import transformers

from kiln.models import load_pretrained
from kiln.models.tasks import get_task

SIZES = {  # base-sized configs per family (only the keys that differ from the tiny ones)
    "bert": dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, vocab_size=30522,
                 max_position_embeddings=512),
    "deberta-v2": dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, vocab_size=128100,
                       max_position_embeddings=512, relative_attention=True, position_buckets=256,
                       max_relative_positions=-1, pos_att_type=["p2c", "c2p"], norm_rel_ebd="layer_norm",
                       share_att_key=True, position_biased_input=False, type_vocab_size=0),
}


def build(model_type: str, layers: int, out: str):
    cfg = transformers.AutoConfig.for_model(model_type, num_hidden_layers=layers, **SIZES[model_type])
    torch.manual_seed(0)
    hf = getattr(transformers, get_task("sequence-classification").hf_auto).from_config(cfg)
    hf.save_pretrained(out)
    return hf, load_pretrained(out, task="sequence-classification")


def timed(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def bench(model_type: str, layers: int, batch: int, seq: int, reps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        hf, ours = build(model_type, layers, tmp)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 1000, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[batch // 2:, seq * 3 // 4:] = 0  # half the batch padded: the masked attention path
    labels = torch.randint(0, 2, (batch,), generator=g)
    inputs = {"input_ids": ids, "attention_mask": mask}

    def fwd(model):
        model.eval()
        with torch.no_grad():
            model(**inputs)

    def fwd_bwd(model):
        model.train()
        model(**inputs, labels=labels).loss.backward()
        model.zero_grad(set_to_none=True)

    result = {}
    for name, fn in (("forward", fwd), ("forward+backward", fwd_bwd)):
        fn(hf), fn(ours)  # warm-up
        t_hf, t_kiln = [], []
        for _ in range(reps):  # interleaved so drift in machine load hits both
            t_hf += timed(lambda: fn(hf), 1)
            t_kiln += timed(lambda: fn(ours), 1)
        hf_sps, kiln_sps = batch / min(t_hf), batch / min(t_kiln)
        print(f"{model_type:>11} {name:>17}: transformers {hf_sps:7.2f} samples/s   kiln {kiln_sps:7.2f} samples/s")
        result[f"{model_type} {name}"] = kiln_sps / hf_sps
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default="bert,deberta-v2")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {torch.get_num_threads()} threads, "
          f"batch {args.batch} x seq {args.seq}, {args.layers} layers, best of {args.reps}")
    from kiln.models.auto import REGISTRY

    ratios = {}
    for fam in args.families.split(","):
        if fam not in REGISTRY:
            print(f"{fam}: not in kiln's registry yet, skipped")
            continue
        ratios.update(bench(fam, args.layers, args.batch, args.seq, args.reps))
    print("kiln/transformers throughput ratios (> 1.0: kiln faster):")
    for k, v in ratios.items():
        print(f"  {k}: {v:.3f}")


if __name__ == "__main__":
    main()
