"""benchmarks/check.py (`make bench-check`): which benchmarks a change touched, the ratios RESULTS.md records, and
the 10% rule; nothing is benchmarked here (speed is measured only in benchmarks/)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def check():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_check", ROOT / "benchmarks" / "check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_recorded_ratios_read_the_results_table(check):
    table = ("text\n\n| workload | peer | ratio best (median) | notes |\n|---|---|---|---|\n"
             "| encoder fine-tune (MiniLM) | HF Trainer | **1.01x** (0.99x) | a | b |\n"
             "| QLoRA | peft | **1.68x** (1.69x) | note |\n\n| other | table |\n|---|---|\n| x | 3.0x |\n")
    assert check.recorded_ratios(table) == {"encoder fine-tune (MiniLM)": 1.01, "QLoRA": 1.68}
    real = check.recorded_ratios((ROOT / "benchmarks" / "RESULTS.md").read_text())
    assert real and all(r > 0 for r in real.values())


def test_a_ratio_more_than_ten_percent_below_is_flagged(check):
    rows = [{"workload": "a", "ratio_best": 0.72, "ratio_median": 0.70},
            {"workload": "b", "ratio_best": 0.92, "ratio_median": 0.90},
            {"workload": "new", "ratio_best": 2.0, "ratio_median": 2.0}]
    got = {name: fell for name, _, fell in check.verdicts(rows, {"a": 0.97, "b": 1.0})}
    assert got == {"a": True, "b": False, "new": False}


def test_touched_by_recorded_loads_else_by_imports(check):
    recorded = {s: ["kiln/nothing.py"] for s, _ in check.WORKLOADS}
    recorded["bench_finetune_bbc.py"] = ["kiln/train/trainer.py"]
    assert check.touched({"kiln/train/trainer.py"}, recorded) == [("bench_finetune_bbc.py", [])]
    assert check.touched({"benchmarks/bench_dpo.py"}, recorded) == [("bench_dpo.py", [])]
    assert check.touched({"README.md"}, recorded) == []
    guess = check.static_deps("bench_finetune_bbc.py")  # not recorded: its imports, followed
    assert {"benchmarks/common.py", "kiln/train/trainer.py", "kiln/cli/main.py"} <= guess


def test_changed_files_against_the_merge_base(check, tmp_path):
    def git(*args):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    git("init", "-q", "-b", "main")
    (tmp_path / "a.py").write_text("1")
    git("add", "a.py")
    git("commit", "-qm", "one")
    git("checkout", "-qb", "work")
    (tmp_path / "a.py").write_text("2")
    (tmp_path / "new.py").write_text("3")
    assert check.changed_files("main", tmp_path) == {"a.py", "new.py"}


def test_results_table_one_line_per_row_and_a_chart(check, tmp_path):
    import run_all

    rows = [{"workload": "w1", "peer": "p", "unit": "tokens/s", "kiln_best": 2.0, "kiln_median": 1.9, "peer_best": 1.0,
             "peer_median": 1.0, "ratio_best": 2.0, "ratio_median": 1.9, "goal": ">= 1.5x", "note": "a note",
             "kiln_mem_mb": 10.0, "peer_mem_mb": 20.0, "mem_ratio": 0.5, "when": "2026-11-29 04:00", "load": "1.0 -> 2.0"},
            {"workload": "w2", "peer": "p", "unit": "samples/s", "kiln_best": 0.9, "kiln_median": 0.9, "peer_best": 1.0,
             "peer_median": 1.0, "ratio_best": 0.9, "ratio_median": 0.9, "goal": "", "note": ""}]
    text = run_all.table(rows)
    lines = text.splitlines()
    assert lines[2] == "| w1 | p | **2.00x** (1.90x) | 0.50 | 2026-11-29 04:00 | 1.0 -> 2.0 | >= 1.5x | yes |"
    assert lines[3].startswith("| w2 | p | **0.90x** (0.90x) | — | — | — |")
    assert "- **w1**: kiln 2.00 (1.90) tokens/s, peer 1.00 (1.00); peak memory 10 / 20 MB. a note" in lines
    assert [(r["workload"], r["ratio_best"]) for r in run_all.read_table(text)] == [("w1", 2.0), ("w2", 0.9)]
    assert run_all.chart(rows, tmp_path / "ratios.png")
    assert (tmp_path / "ratios.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    real = run_all.read_table((ROOT / "benchmarks" / "RESULTS.md").read_text())
    assert len(real) >= 20 and all("\n" not in r["workload"] for r in real)


def test_a_one_round_row_is_read_and_charted_without_a_median_and_the_newest_row_is_compared(check, tmp_path):
    import run_all

    table = ("| workload | peer | ratio best (median) |\n|---|---|---|\n| w | p | **1.50x** (1.40x) |\n"
             "| one | p | **4.67x** (one round) |\n| w | p | **2.00x** (1.90x) |\n| plan | p | **0.92-0.95** (plan) |\n")
    rows = run_all.read_table(table)
    assert [(r["workload"], r["ratio_best"], r["ratio_median"]) for r in rows] == [
        ("w", 1.5, 1.4), ("one", 4.67, None), ("w", 2.0, 1.9)]  # a range is no ratio: skipped
    assert check.recorded_ratios(table) == {"w": 2.0, "one": 4.67}  # a workload's newest row
    assert run_all.chart(rows, tmp_path / "ratios.png")


def test_the_results_table_keeps_its_cells_short():
    """One line per row that a reader can scan: a long cell's prose goes in a note below the table."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    table = text[text.index("| workload |"):].split("\n\n", 1)[0].splitlines()
    long = [c.strip() for line in table for c in line.strip("|").split("|") if len(c.strip()) > 100]
    assert len(table) > 20 and long == [], long
