"""Mamba-HPN end to end on CPU in a few minutes, with a real crash in the middle:

  1. the BBC News tokenizer and token shards of examples/pretrain_bbc (built with its recipe if missing)
  2. kiln train mamba_hpn.toml in a child process; once step KILL_AT is logged the child gets SIGKILL
  3. kiln train --resume: it continues from the newest checkpoint; the steps between that checkpoint
     and the kill are trained again and must repeat the killed attempt's losses exactly
  4. the train / validation curves of both objectives

    .venv/bin/python examples/mamba_hpn/run.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
PRETRAIN = HERE.parent / "pretrain_bbc"
RUN = HERE / "runs" / "mamba_hpn"
KILL_AT = 90          # past the growth (step 60) and the step-80 checkpoint: the resume re-runs 81..90


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def make_data() -> None:
    if (PRETRAIN / "data" / "shards" / "manifest.json").is_file():
        return
    spec = importlib.util.spec_from_file_location("pretrain_bbc_run", PRETRAIN / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.make_data()


def train_until_killed(cmd: list[str]) -> list[dict]:
    """Run `cmd`, SIGKILL it once metrics.jsonl holds step KILL_AT; returns the records it had written."""
    with open(HERE / "runs" / "first-attempt.log", "w") as log:
        child = subprocess.Popen(cmd, cwd=HERE, stdout=log, stderr=subprocess.STDOUT)
        while child.poll() is None:
            if any(r.get("step") == KILL_AT and "loss" in r for r in records(RUN / "metrics.jsonl")):
                os.kill(child.pid, signal.SIGKILL)
                break
            time.sleep(0.05)
        code = child.wait()
    if code != -signal.SIGKILL:
        raise SystemExit(f"the first attempt ended with {code} before step {KILL_AT}; see runs/first-attempt.log")
    return records(RUN / "metrics.jsonl")


def main() -> None:
    make_data()
    shutil.rmtree(RUN, ignore_errors=True)
    RUN.parent.mkdir(exist_ok=True)
    env_cmd = [sys.executable, "-m", "kiln.cli.main", "train", "--config", "mamba_hpn.toml"]
    t0 = time.perf_counter()
    killed = train_until_killed(env_cmd)
    state = json.loads((RUN / "run_state.json").read_text())
    print(f"SIGKILL after step {max(r['step'] for r in killed if 'loss' in r)}; newest checkpoint "
          f"{state['checkpoint']} (step {state['step']})", flush=True)
    subprocess.run(env_cmd + ["--resume", str(RUN)], cwd=HERE, check=True)
    elapsed = time.perf_counter() - t0

    final = records(RUN / "metrics.jsonl")
    train = {r["step"]: r for r in final if "loss" in r}
    before = {r["step"]: r for r in killed if "loss" in r and r["step"] > state["step"]}
    worst = max(abs(train[s][k] - r[k]) for s, r in before.items() for k in ("loss", "loss_prototype", "loss_lm"))
    same = worst == 0.0
    print(f"resumed from step {state['step']}: steps {min(before)}..{max(before)} retrained, "
          f"max |loss difference| vs the killed attempt {worst:.1e}: the resumed losses "
          + ("continue the curve exactly" if same else "DO NOT continue the curve"))

    def mean(step: int, key: str, n: int = 10) -> float:  # mean over the n steps ending at `step`
        return sum(train[s][key] for s in range(step - n + 1, step + 1)) / n

    print("train (mean of 10 steps)  " + "  ".join(
        f"step {s}: proto {mean(s, 'loss_prototype'):.3f} lm {mean(s, 'loss_lm'):.2f}" for s in (10, 60, 90, 120)))
    for r in (r for r in final if "eval_loss" in r):
        print(f"validation step {r['step']:3d}: prototype-head loss {r['eval_loss']:.3f}, "
              f"LM-head loss {r['eval_lm_loss']:.3f} (ppl {r['eval_lm_ppl']:.0f})")
    print(f"total {elapsed:.0f} s (both attempts)")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
