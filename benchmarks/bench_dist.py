"""Data, fully sharded, tensor and pipeline parallel training on one decoder: tokens/s and peak memory per rank.

    python benchmarks/bench_dist.py            # CPU, gloo, world size 2 (and 1 for scaling)
    python benchmarks/bench_dist.py --gpu      # CUDA, nccl, one process per GPU (needs 2 GPUs)

Each mode runs in fresh processes on the same qwen3-shaped decoder and the same per-step global
batch, so peak memory is the mode's own. DDP and FSDP2 split the batch over the ranks; TP gives
every rank the whole batch and splits the layers; PP gives both stages the whole batch in 4
micro-batches (1F1B) and splits the blocks 2 + 2. CP rows take long sequences (LONG rows of LONG_SEQ
tokens): DDP splits the rows over the ranks, CP (all-gathered K/V, or the ring) gives both ranks every
row and splits each sequence in 4 load-balanced chunks; same tokens per rank. The "-xl" rows take a single
row of XL_SEQ tokens, on one process and split over cp = 2. The "-slow" rows slow rank 1 down (after each of its
batches it sleeps as long as one step of the plain 2-process DDP row took) and run the same batches in
lockstep DDP and under the adaptive cadence ([parallel.cadence]'s defaults through the Trainer's cadence
engine, as `kiln train` runs it: the fast rank runs more batches between syncs, parameters averaged).
Tokens/s counts each global token once. Peak memory is the rise of max RSS over the process's start on
CPU, max allocated on CUDA. Ratios print last.

Run by hand (not in `make bench`): it starts several process groups of 2 ranks (about 6 minutes on 2 CPU
cores), its rows are not kiln-vs-peer rows of the results table, and `--gpu` needs 2 GPUs.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # spawn.py: processes without torchrun

import torch
import torch.distributed as dist
from spawn import spawn

from kiln.models.auto import AutoConfig, from_config
from kiln.parallel.apply import parallelize

SIZE = dict(vocab_size=2048, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
            num_key_value_heads=4, head_dim=32, max_position_embeddings=4096)
BATCH, SEQ, WARMUP, STEPS = 8, 128, 2, 6  # global batch per step
LONG, LONG_SEQ = 2, 2048  # the long-sequence rows' global batch: DDP vs CP
XL_SEQ = 4096             # one row this long: one process vs the row split over cp = 2 (what DDP cannot split)
CP_MODES = {"cp": "allgather", "cp-ring": "ring"}
SLOWED = 1                # the rank the "-slow" rows slow down


def _plan(mode: str) -> SimpleNamespace:
    return SimpleNamespace(dp=0, tp=2 if mode == "tp" else 1, ep=1, fsdp=mode == "fsdp", offload=False,
                           cp=2 if mode in CP_MODES else 1, cp_method=CP_MODES.get(mode, "allgather"),
                           pp=2 if mode == "pp" else 1, pp_schedule="1f1b", microbatches=4, pp_stages=None,
                           param_dtype=None, reduce_dtype="fp32", sequence_parallel=True,
                           activation_checkpointing="none", checkpoint_every=1, compile=False,
                           compile_backend="inductor")


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class _Ids:
    """Random token rows, each rank its own stream (the Trainer's data protocol)."""
    epoch = 0

    def __init__(self, rank: int, rows: int):
        self.g, self.rows = torch.Generator().manual_seed(rank), rows

    def next_batch(self) -> dict:
        ids = torch.randint(0, SIZE["vocab_size"], (self.rows, SEQ), generator=self.g)
        return {"input_ids": ids, "labels": ids}

    def check_size(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}


def cadence(rank: int, world: int, model: torch.nn.Module, device: torch.device, delay: float) -> dict:
    """`kiln train`'s [parallel.cadence] with its default settings: the Trainer and its cadence engine. Each rank
    draws its own rows; the budget is the DDP rows' (WARMUP + STEPS steps x world batches); the first WARMUP
    steps (where the planner measures both ranks' speeds) are not timed."""
    from kiln.train import Callback, Trainer
    from kiln.train.config import CadenceSection, ParallelSection

    class Clock(Callback):
        def __init__(self) -> None:
            self.start, self.batches, self.rounds = None, [0] * world, 0

        def on_step(self, trainer: Trainer, record: dict) -> None:
            if self.start is None:  # the warm-up rounds end here
                if trainer.step >= WARMUP:
                    self.start = time.perf_counter()
                return
            self.batches = [b + c for b, c in zip(self.batches, record["batches"])]
            self.rounds += 1

    def step(m: torch.nn.Module, batch: dict) -> torch.Tensor:
        if rank == SLOWED:
            time.sleep(delay)
        return m(batch["input_ids"], labels=batch["labels"]).loss

    clock = Clock()
    rows = BATCH // world  # per rank and batch, as DDP's share of the global batch
    Trainer(model, _Ids(rank, rows), step=step, parallel=ParallelSection(cadence=CadenceSection()),
            callbacks=[clock], steps=WARMUP + STEPS, batch_size=rows, lr=1e-4, weight_decay=0.0,
            schedule="constant", clip_grad_norm=None, device=device.type, save_at_end=False, progress=False,
            out_dir=tempfile.mkdtemp()).fit()
    seconds = time.perf_counter() - clock.start
    return {"tokens_per_s": sum(clock.batches) * rows * SEQ / seconds, "batches": clock.batches,
            "rounds": clock.rounds}


def worker(rank: int, world: int, mode: str, gpu: bool, out: str, delay: float = 0.0) -> None:
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    start_mb = _peak_mb(device)  # the process before the model: imports, the forked server's pages
    model = from_config(AutoConfig.for_model("qwen3", **SIZE), task="causal-lm", seed=0).to(device)
    if mode == "cadence-slow":
        result = cadence(rank, world, model, device, delay)
        result["peak_mb"] = _peak_mb(device) - start_mb
        Path(out, f"{mode}-{world}-rank{rank}.json").write_text(json.dumps(result))
        return
    par = parallelize(model, _plan(mode.removesuffix("-long").removesuffix("-xl").removesuffix("-slow")),
                      world_size=world, device=device)
    rows, seq = (LONG, LONG_SEQ) if mode.endswith("-long") or mode in CP_MODES else (BATCH, SEQ)
    if mode.endswith("-xl"):
        rows, seq = 1, XL_SEQ
    if par.wrap_ddp:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[rank] if gpu else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    seconds = 0.0
    for step in range(WARMUP + STEPS):
        ids = torch.randint(0, SIZE["vocab_size"], (rows, seq), generator=g)
        ids = ids.chunk(par.data_shards)[par.data_rank].to(device)
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        if par.pipeline is not None:  # the schedule runs forward and backward; gradients hold loss sums
            _, count = par.pipeline.train_batch({"input_ids": ids, "labels": ids})
            par.pipeline.finish_gradients(float(count))
        else:
            loss = model(ids, labels=ids).loss
            loss.backward()
            par.sync_gradients()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == SLOWED and mode.endswith("-slow"):
            time.sleep(delay)
        if gpu:
            torch.cuda.synchronize()
        dist.barrier()
        if step >= WARMUP:
            seconds += time.perf_counter() - t0
    result = {"tokens_per_s": rows * seq * STEPS / seconds, "peak_mb": _peak_mb(device) - start_mb}
    Path(out, f"{mode}-{world}-rank{rank}.json").write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="CUDA + nccl instead of CPU + gloo")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per process (CPU)")
    args = ap.parse_args()
    if args.gpu and torch.cuda.device_count() < 2:
        sys.exit("--gpu needs 2 CUDA devices")
    backend = "nccl" if args.gpu else "gloo"
    out = tempfile.mkdtemp()
    runs = [("ddp", 1), ("ddp", 2), ("fsdp", 2), ("tp", 2), ("pp", 2), ("ddp-long", 2), ("cp", 2), ("cp-ring", 2),
            ("ddp-xl", 1), ("cp-xl", 2)]
    for mode, world in runs:
        spawn(worker, world, (mode, args.gpu, out), backend=backend, threads=args.threads)
    ddp_step = BATCH * SEQ / min(json.loads(Path(out, f"ddp-2-rank{r}.json").read_text())["tokens_per_s"]
                                 for r in range(2))
    for mode in ("ddp-slow", "cadence-slow"):  # the slowed rank sleeps one plain DDP step per batch
        spawn(worker, 2, (mode, args.gpu, out, ddp_step), backend=backend, threads=args.threads)
    runs += [("ddp-slow", 2), ("cadence-slow", 2)]
    res = {}
    print(f"{'mode':12s} {'world':>5s} {'tokens/s':>10s}  "
          f"peak MB per rank ({'CUDA allocated' if args.gpu else 'max RSS rise'})")
    for mode, world in runs:
        ranks = [json.loads(Path(out, f"{mode}-{world}-rank{r}.json").read_text()) for r in range(world)]
        res[mode, world] = {"tps": min(r["tokens_per_s"] for r in ranks), "mem": max(r["peak_mb"] for r in ranks)}
        print(f"{mode:12s} {world:5d} {res[mode, world]['tps']:10.0f}  "
              + ", ".join(f"{r['peak_mb']:.0f}" for r in ranks))
    ddp = res["ddp", 2]
    print(f"ratio fsdp2/ddp tokens/s: {res['fsdp', 2]['tps'] / ddp['tps']:.3f}")
    print(f"ratio tp/ddp tokens/s: {res['tp', 2]['tps'] / ddp['tps']:.3f}")
    print(f"ratio pp/ddp tokens/s: {res['pp', 2]['tps'] / ddp['tps']:.3f}")
    print(f"ratio fsdp2/ddp peak memory: {res['fsdp', 2]['mem'] / ddp['mem']:.3f}")
    print(f"ratio tp/ddp peak memory: {res['tp', 2]['mem'] / ddp['mem']:.3f}")
    print(f"ratio pp/ddp peak memory: {res['pp', 2]['mem'] / ddp['mem']:.3f}")
    print(f"ratio ddp 2 processes / 1 process tokens/s (scaling): {ddp['tps'] / res['ddp', 1]['tps']:.3f}")
    long = res["ddp-long", 2]  # CP against DDP on the same long rows
    for mode in CP_MODES:
        print(f"ratio {mode}/ddp tokens/s at {LONG_SEQ} tokens: {res[mode, 2]['tps'] / long['tps']:.3f}")
        print(f"ratio {mode}/ddp peak memory at {LONG_SEQ} tokens: {res[mode, 2]['mem'] / long['mem']:.3f}")
    print(f"ratio cp 2 / 1 process peak memory per rank, one {XL_SEQ}-token row: "
          f"{res['cp-xl', 2]['mem'] / res['ddp-xl', 1]['mem']:.3f}")
    print(f"ratio cp 2 / 1 process tokens/s, one {XL_SEQ}-token row: {res['cp-xl', 2]['tps'] / res['ddp-xl', 1]['tps']:.3f}")
    batches = json.loads(Path(out, "cadence-slow-2-rank0.json").read_text())["batches"]
    print(f"cadence, rank {SLOWED} slowed: batches per rank {batches} (DDP: {STEPS} each)")
    slow = res["ddp-slow", 2]
    print(f"ratio cadence/ddp tokens/s, rank {SLOWED} slowed: {res['cadence-slow', 2]['tps'] / slow['tps']:.3f}")
    print(f"ratio cadence/ddp peak memory, rank {SLOWED} slowed: {res['cadence-slow', 2]['mem'] / slow['mem']:.3f}")


if __name__ == "__main__":
    main()
