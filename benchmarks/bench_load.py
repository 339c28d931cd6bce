"""Loading a ~1B checkpoint: each rank's peak RSS against the checkpoint's bytes, and time to the first step.

Two checkpoints written by transformers (`save_pretrained`, bf16, random weights, sharded into several
safetensors files plus the index as a release ships them; transformers' own default, 50 GB shards,
would write one file, so `max_shard_size` is set): a Qwen3-shaped dense model (~0.97B parameters) and a
Qwen3-MoE-shaped one (~1.12B, 32 experts top 4). They are cached (KILN_BENCH_CACHE, default
~/.cache/kiln-bench/load) so reruns skip building them.

Each run is the real command: `kiln train --config X.toml` for one process, `kiln launch
--nproc-per-node N -- train --config X.toml` for several; 2 steps of batch 1 x 64 tokens per rank (train.batch_size
is per process; PP = 2's two stages share a batch of 2 micro-batches of 1 x 64; SFT rows of
BBC text, each a title and the start of its article truncated to 64 tokens, one sample per row: data.pack =
false, so every run and the peer see the same 64-token rows). Each rank's peak RSS is its VmHWM (from /proc/self/status) read at interpreter exit by a
sitecustomize hook that this benchmark puts first on the ranks' PYTHONPATH (VmHWM, not getrusage's
ru_maxrss: ru_maxrss survives exec, so a rank forked from torchrun's agent would inherit the agent's
peak); a poller reads the same field every 0.2 s as a fallback for a rank that dies before its exit hook.
Beside each run: `kiln plan`'s prediction for the same TOML and process count (kiln.parallel.memory).

Time to first step (1B dense, LoRA, 1 process): `kiln train` from process start until metrics.jsonl has
its first step, against transformers + peft in a fresh process (from_pretrained + get_peft_model + one
forward / backward / AdamW step on the same batch shape) from process start until that step is done.

    python benchmarks/bench_load.py [--only fsdp] [--skip-ttfs]

Rows (ratios last): a memory row's "ratio" is the measured peak over `kiln plan`'s prediction and its
"peak memory ratio" the measured peak over the checkpoint's bytes (the full fine-tune's: over the
16-bytes-per-parameter floor of mixed-precision AdamW divided over its ranks).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, bbc_articles, report

GiB = 1024 ** 3
# Qwen3 layout at ~1B: Qwen3's vocabulary, hidden 1536, 24 layers (between Qwen3-0.6B and -1.7B), tied.
DENSE = dict(vocab_size=151936, hidden_size=1536, intermediate_size=4608, num_hidden_layers=24,
             num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=2048,
             tie_word_embeddings=True, pad_token_id=0, eos_token_id=2)
# Qwen3-MoE layout at ~1B: 32 experts, top 4, every layer sparse; the experts hold ~81% of the weights.
MOE = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, moe_intermediate_size=768,
           num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=32,
           num_experts_per_tok=4, decoder_sparse_step=1, norm_topk_prob=True, max_position_embeddings=2048,
           tie_word_embeddings=True, pad_token_id=0, eos_token_id=2)
SHARD_SIZE = "1GB"          # several files + model.safetensors.index.json, as a release ships them
BATCH, MAX_LENGTH, STEPS = 1, 64, 2
ALL_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
FLOOR_BYTES_PER_PARAM = 16  # bf16 weight + bf16 grad + fp32 master + two fp32 Adam moments


def dense_params(s: dict) -> int:
    """Parameters of a Qwen3 decoder of shape `s` (tied head): embedding, per layer attention (with q/k norms),
    MLP and two norms, and the final norm."""
    h, q, kv = s["hidden_size"], s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    attention = h * q * 2 + h * kv * 2 + 2 * s["head_dim"]
    mlp = 3 * h * s["intermediate_size"]
    head = 0 if s["tie_word_embeddings"] else s["vocab_size"] * h
    return s["vocab_size"] * h + head + s["num_hidden_layers"] * (attention + mlp + 2 * h) + h


def moe_params(s: dict) -> int:
    """Parameters of a Qwen3-MoE decoder of shape `s` (every layer sparse, tied head)."""
    experts = s["num_experts"] * 3 * s["hidden_size"] * s["moe_intermediate_size"]
    router = s["num_experts"] * s["hidden_size"]
    dense_mlp = 3 * s["hidden_size"] * s["intermediate_size"]
    return dense_params(s) + s["num_hidden_layers"] * (experts + router - dense_mlp)


def cache_root() -> Path:
    return Path(os.environ.get("KILN_BENCH_CACHE", Path.home() / ".cache" / "kiln-bench" / "load"))


def build_checkpoint(kind: str) -> Path:
    """The cached checkpoint directory of `kind` ("dense" or "moe"), written once by transformers in bf16, with
    a byte-level BPE tokenizer beside it (kiln train reads the tokenizer from model.path)."""
    shape = DENSE if kind == "dense" else MOE
    tag = f"{kind}-{hashlib.sha256(json.dumps([shape, SHARD_SIZE], sort_keys=True).encode()).hexdigest()[:10]}"
    out = cache_root() / tag
    if (out / "model.safetensors.index.json").exists() and (out / "tokenizer.json").exists():
        return out
    import torch
    import transformers

    from kiln.data.bpe import train_bpe

    transformers.utils.logging.disable_progress_bar()
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    cls, cfg = ((transformers.Qwen3ForCausalLM, transformers.Qwen3Config) if kind == "dense"
                else (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig))
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of 1B parameters
    try:
        model = cls(cfg(**shape, dtype="bfloat16"))
    finally:
        torch.set_default_dtype(torch.float32)
    model.save_pretrained(tmp, max_shard_size=SHARD_SIZE)
    del model
    text = tmp / "corpus.txt"
    text.write_text("\n".join(f"{t}\n{b}" for _, t, b in bbc_articles(400)), encoding="utf-8")
    train_bpe([text], tmp, vocab_size=2000, min_frequency=2)
    text.unlink()
    tmp.rename(out)  # complete or absent: a killed build leaves only the .partial directory
    return out


# The run beyond memory / nproc: a Qwen3-shaped dense model, as many layers as the size asks (untied 32K vocabulary).
LARGE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=6144, num_hidden_layers=0, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, max_position_embeddings=2048, tie_word_embeddings=False,
             pad_token_id=0, eos_token_id=2)
LARGE_NPROC = 4


def large_shape(target_bytes: int) -> dict:
    """LARGE with the fewest layers whose bf16 checkpoint exceeds `target_bytes`."""
    base = dense_params({**LARGE, "num_hidden_layers": 0})
    per_layer = dense_params({**LARGE, "num_hidden_layers": 1}) - base
    return {**LARGE, "num_hidden_layers": max(1, -(-(target_bytes // 2 - base) // per_layer))}


def build_large(shape: dict, tokenizer_from: Path) -> Path:
    """A Qwen3-shaped bf16 checkpoint of `shape` written file by file (1 GB files + index, as a release), random
    normal(0, 0.02) weights drawn tensor by tensor: never more than one output file in memory (the model itself
    would not fit in a rank's share of memory, which is the point). Cached like the others."""
    import torch
    import transformers

    from kiln.hub.weights import shard_names, shard_plan, write_index, write_shard

    tag = f"large-{shape['num_hidden_layers']}L-{hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:8]}"
    out = cache_root() / tag
    if (out / "model.safetensors.index.json").exists():
        return out
    tmp = out.with_name(out.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = transformers.Qwen3Config(**shape, dtype="bfloat16")
    cfg.architectures = ["Qwen3ForCausalLM"]
    cfg.save_pretrained(tmp)
    with torch.device("meta"):  # names and shapes only
        names = {k: tuple(v.shape) for k, v in transformers.Qwen3ForCausalLM(cfg).state_dict().items()}
    groups = shard_plan([(k, 2 * math.prod(v)) for k, v in names.items()], 10 ** 9)
    gen = torch.Generator().manual_seed(0)
    for name, group in zip(shard_names(len(groups)), groups):
        write_shard(tmp, name, {k: (torch.ones(names[k]) if k.endswith("norm.weight") else
                                    torch.randn(names[k], generator=gen) * 0.02).to(torch.bfloat16) for k in group})
    write_index(tmp, 2 * sum(math.prod(v) for v in names.values()),
                {k: n for n, g in zip(shard_names(len(groups)), groups) for k in g})
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tokenizer_from / f).exists():
            (tmp / f).write_bytes((tokenizer_from / f).read_bytes())
    tmp.rename(out)
    return out


def mem_available() -> int:
    return next(int(x.split()[1]) * 1024 for x in Path("/proc/meminfo").read_text().splitlines()
                if x.startswith("MemAvailable"))


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def write_chats(d: Path) -> Path:
    # a short prompt (the title) so each reply starts well within MAX_LENGTH tokens
    rows = [{"messages": [{"role": "user", "content": title},
                          {"role": "assistant", "content": " ".join(body.split()[:80])}]}
            for _, title, body in bbc_articles(16)]
    path = d / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@dataclass
class Run:
    name: str
    kind: str                      # which checkpoint
    nproc: int
    targets: list[str] | None      # LoRA targets; None: full fine-tune
    parallel: dict = field(default_factory=dict)
    goal: float = 0.0              # peak RSS / checkpoint bytes (full: / the 16 B/param floor over nproc)


RUNS = [Run("LoRA, 1 process", "dense", 1, ALL_LINEAR, {}, 1.25),
        Run("FSDP2 + LoRA, 2 processes", "dense", 2, ALL_LINEAR, {"fsdp": True}, 0.75),
        Run("FSDP2 + LoRA, 4 processes", "dense", 4, ALL_LINEAR, {"fsdp": True}, 0.5),
        Run("FSDP2 full fine-tune bf16, 2 processes", "dense", 2, None, {"fsdp": True}, 1.0),
        Run("EP = 2 + LoRA (attention), MoE", "moe", 2, ATTENTION, {"ep": 2}, 0.7),
        Run("PP = 2 + LoRA, 2 processes", "dense", 2, ALL_LINEAR, {"pp": 2, "microbatches": 2}, 0.75),
        # the same runs with each block's activations recomputed in the backward: how near the goals the rest is
        Run("LoRA, 1 process, activation checkpointing", "dense", 1, ALL_LINEAR,
            {"activation_checkpointing": "block"}, 1.25),
        Run("FSDP2 + LoRA, 2 processes, activation checkpointing", "dense", 2, ALL_LINEAR,
            {"fsdp": True, "activation_checkpointing": "block"}, 0.75)]


def rows_per_process(run: Run) -> int:
    """train.batch_size, which is per process: BATCH rows on every rank (a pipeline's stages share one batch, split
    into its micro-batches of BATCH rows each)."""
    return BATCH * run.parallel.get("microbatches", 1)


def write_toml(d: Path, run: Run, model: Path, chats: Path, steps: int = STEPS) -> Path:
    out = d / f"run-{time.time_ns()}"
    lora = "" if run.targets is None else f"[lora]\nr = 16\nalpha = 32\ntargets = {json.dumps(run.targets)}\n"
    par = "".join(f"{k} = {json.dumps(v)}\n" for k, v in run.parallel.items())
    path = d / f"{out.name}.toml"
    path.write_text(f"""[model]
path = "{model}"
task = "causal-lm"
[data]
train = "{chats}"
max_length = {MAX_LENGTH}
pack = false
[train]
out_dir = "{out}"
steps = {steps}
batch_size = {rows_per_process(run)}
lr = 1e-4
save_at_end = false
progress = false
log_every = 1
{lora}{'[parallel]' + chr(10) + par if par else ''}""")
    return path


SITECUSTOMIZE = '''import atexit, os
def _kiln_bench_hwm():
    try:
        hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]
        rank = os.environ.get("RANK", "main")
        with open(os.path.join(os.environ["KILN_BENCH_HWM_DIR"], f"{rank}-{os.getpid()}"), "w") as f:
            f.write(hwm)
    except Exception:
        pass
# the measured processes only: a rank (or the one kiln process of a 1-process run), not a process it starts (a
# compiler, a reward worker), which would inherit RANK and be counted as a second rank
if os.environ.get("KILN_BENCH_HWM_DIR") and ("RANK" in os.environ or os.environ.get("KILN_BENCH_NPROC") == "1"):
    atexit.register(_kiln_bench_hwm)
    os.environ["KILN_BENCH_HWM_CHILD"] = "1"  # what it starts by exec inherits this; a fork: see run_kiln's poll
'''


def _hwm_kb(pid: int) -> tuple[str, int] | None:
    """(RANK or "main", VmHWM kB) of a kiln process, or None (not a rank / gone / a process a rank started)."""
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        names = {e.split(b"=")[0] for e in env}
        if b"KILN_BENCH_HWM_DIR" not in names or b"KILN_BENCH_HWM_CHILD" in names:
            return None
        rank = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"RANK=")), "main")
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM"))
        return rank, int(line.split()[1])
    except (OSError, StopIteration):
        return None


def _ppid(pid: int) -> int:
    """The parent of `pid` (0 when gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        out += map(int, kids)
        todo += map(int, kids)
    return out


def run_kiln(run: Run, model: Path, chats: Path, work: Path, pythonpath: str = str(ROOT), steps: int = STEPS,
             env_extra: dict | None = None) -> dict:
    """Run `run` through the kiln CLI; each rank's peak RSS (bytes), the seconds to the first logged step, the
    median seconds of the steps after the first, and the wall time."""
    cfg = write_toml(work, run, model, chats, steps)
    hook = work / "hook"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    hwm_dir = Path(tempfile.mkdtemp(dir=work, prefix="hwm-"))
    env = {**os.environ, "PYTHONPATH": f"{hook}:{pythonpath}", "KILN_BENCH_HWM_DIR": str(hwm_dir), "KILN_BENCH_NPROC": str(run.nproc),
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env_extra or {})}
    env.pop("RANK", None)
    cli = [sys.executable, "-m", "kiln.cli.main"]
    argv = cli + (["train"] if run.nproc == 1 else ["launch", "--nproc-per-node", str(run.nproc), "--", "train"])
    argv += ["--config", str(cfg)]
    metrics = Path(next(line.split('"')[1] for line in cfg.read_text().splitlines()
                        if line.startswith("out_dir"))) / "metrics.jsonl"
    polled: dict[str, int] = {}
    used = resource.getrusage(resource.RUSAGE_CHILDREN)  # every waited-for descendant: the ranks, via torchrun
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first_step: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            for pid in _descendants(proc.pid) + [proc.pid]:
                got = _hwm_kb(pid)
                parent = _hwm_kb(_ppid(pid)) if got is not None else None
                if parent is not None and parent[0] == got[0]:  # forked by a measured process: not a rank
                    continue
                if got is not None and (run.nproc == 1 or got[0] != "main"):
                    polled[f"{got[0]}-{pid}"] = max(polled.get(f"{got[0]}-{pid}", 0), got[1])
            if not first_step and metrics.exists() and '"loss"' in metrics.read_text():
                first_step.append(time.perf_counter() - t0)
            time.sleep(0.2)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    log, _ = proc.communicate()
    wall = time.perf_counter() - t0
    done.set()
    poller.join()
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}):\n{log[-4000:]}")
    at_exit = {p.name: int(p.read_text()) for p in hwm_dir.iterdir()}
    # ranks: the processes with a RANK (torchrun's workers); for one process the kiln train process itself
    wanted = (lambda k: k.startswith("main-")) if run.nproc == 1 else (lambda k: not k.startswith("main-"))
    ranks = {k: max(v, polled.get(k, 0)) for k, v in at_exit.items() if wanted(k)}
    ranks.update({k: v for k, v in polled.items() if wanted(k) and k not in ranks})
    peaks = [ranks[k] * 1024 for k in sorted(ranks, key=lambda k: (k.split("-")[0], k))]
    if len(peaks) != run.nproc:
        raise RuntimeError(f"{run.name}: found {len(peaks)} rank processes, expected {run.nproc}: {sorted(ranks)}")
    if not first_step and metrics.exists() and '"loss"' in metrics.read_text():
        first_step.append(wall)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    rows = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.exists() else []
    step_s = sorted(r["tokens"] / r["tokens_per_s"] for r in rows if r.get("tokens_per_s") and r["step"] > 1)
    return {"peaks": peaks, "first_step_s": first_step[0] if first_step else float("nan"), "wall_s": wall,
            "step_s": step_s[len(step_s) // 2] if step_s else float("nan"),
            # CPU seconds and minor page faults of all its processes: far steadier than wall time on a shared machine
            "cpu_s": after.ru_utime + after.ru_stime - used.ru_utime - used.ru_stime,
            "sys_s": after.ru_stime - used.ru_stime, "minflt": after.ru_minflt - used.ru_minflt,
            "hook_ranks": sum(1 for k in at_exit if wanted(k))}


def predicted(cfg_path: Path, nproc: int, today: bool = False) -> list[tuple[str, int]]:
    """`kiln plan --config cfg_path --nproc nproc`'s per-rank totals (rank label, bytes), from the same
    functions the CLI calls; `today`: its column for a loader that reads the whole checkpoint on every rank."""
    from kiln.cli.plan import plan_inputs
    from kiln.parallel.memory import plan_memory
    from kiln.train.config import load_run_config

    params, dims, s, sizes, _ = plan_inputs(load_run_config(cfg_path, []), nproc, "cpu", str(cfg_path))
    plan = plan_memory(params, dims, s, sizes, today=today)
    return [(r.rank, r.total) for r in plan.ranks]


def peer_first_step(model: Path, targets: list[str]) -> dict:
    """transformers + peft in this (fresh) process: from_pretrained + get_peft_model + one forward / backward /
    AdamW step on a batch of BATCH x MAX_LENGTH tokens; seconds from process start (as `kiln train` is timed
    from its process start) and this process's peak RSS."""
    import peft
    import torch
    import transformers

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    m = transformers.AutoModelForCausalLM.from_pretrained(model)  # the checkpoint's dtype (bf16): transformers 5
    m = peft.get_peft_model(m, peft.LoraConfig(r=16, lora_alpha=32, target_modules=targets, lora_dropout=0.0,
                                               task_type="CAUSAL_LM"))
    m.train()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(3, 2000, (BATCH, MAX_LENGTH), generator=torch.Generator().manual_seed(0))
    loss = m(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    float(loss)
    hwm = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM"))
    return {"dtype": str(next(m.parameters()).dtype), "peak": int(hwm.split()[1]) * 1024}


def run_peer(model: Path, targets: list[str]) -> dict:
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, __file__, "--peer-child", str(model), ",".join(targets)], env=env,
                       capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode:
        raise RuntimeError(f"transformers + peft first step failed:\n{r.stderr[-4000:]}")
    return {**json.loads(r.stdout.strip().splitlines()[-1]), "first_step_s": wall}


def load() -> str:
    return "load average " + " / ".join(f"{x:.1f}" for x in os.getloadavg())


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"


def run_beyond(dense: Path, chats: Path, work: Path, kiln_root: str, fraction: float = 1.1) -> tuple | None:
    """FSDP2 + LoRA on LARGE_NPROC ranks over a checkpoint of `fraction` x MemAvailable / LARGE_NPROC: every rank
    reading it whole (the loader before the sharded read) would need LARGE_NPROC x that, more than the machine
    has; each reading its share, it trains. None (and why, printed) when even the shares would not fit."""
    avail = mem_available()
    target = int(fraction * avail / LARGE_NPROC)
    t0 = time.time()
    # the smallest cached one above the target (free memory varies between runs), else a new one
    cached = sorted((checkpoint_bytes(p), p) for p in cache_root().glob("large-*")
                    if (p / "model.safetensors.index.json").exists() and checkpoint_bytes(p) > target)
    model = cached[0][1] if cached else build_large(large_shape(target), dense)
    shape = {**LARGE, "num_hidden_layers": json.loads((model / "config.json").read_text())["num_hidden_layers"]}
    size = checkpoint_bytes(model)
    print(f"beyond memory: {dense_params(shape) / 1e9:.2f}B parameters ({shape['num_hidden_layers']} layers), "
          f"{gib(size)} in {len(list(model.glob('*.safetensors')))} files; MemAvailable {gib(avail)} / "
          f"{LARGE_NPROC} = {gib(avail / LARGE_NPROC)}; ready in {time.time() - t0:.0f} s ({load()})", flush=True)
    run = Run(f"FSDP2 + LoRA, {LARGE_NPROC} processes, checkpoint > memory / {LARGE_NPROC}", "large", LARGE_NPROC,
              ALL_LINEAR, {"fsdp": True}, 0.5)
    cfg = write_toml(work, run, model, chats, 3)
    plan, today = predicted(cfg, run.nproc), predicted(cfg, run.nproc, today=True)
    print(f"kiln plan: {gib(max(b for _, b in plan))} per rank, {gib(run.nproc * max(b for _, b in plan))} for all; "
          f"every rank reading the whole checkpoint: {gib(run.nproc * max(b for _, b in today))} for all", flush=True)
    if run.nproc * max(b for _, b in plan) > 0.9 * mem_available():
        print("beyond memory: skipped, the ranks' shares would not fit in what is free now", flush=True)
        return None
    before = load()
    res = run_kiln(run, model, chats, work, kiln_root, steps=3)
    worst = max(res["peaks"])
    print(f"{run.name}: 3 steps; peak RSS per rank {', '.join(gib(p) for p in res['peaks'])}, all ranks "
          f"{gib(sum(res['peaks']))}; / checkpoint {worst / size:.2f}x; measured / plan "
          f"{worst / max(b for _, b in plan):.2f}; first step at {res['first_step_s']:.0f} s, step "
          f"{res['step_s']:.1f} s, wall {res['wall_s']:.0f} s; {before} -> {load()}", flush=True)
    return run, res, max(b for _, b in plan), size, avail, before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="run only the memory runs whose name contains this")
    ap.add_argument("--skip-ttfs", action="store_true", help="no time-to-first-step comparison")
    ap.add_argument("--ttfs-only", action="store_true", help="only the time-to-first-step comparison (no memory runs, "
                    "no run beyond memory)")
    ap.add_argument("--rounds", type=int, default=1, help="time-to-first-step rounds (interleaved)")
    ap.add_argument("--kiln-root", default=str(ROOT), help="the kiln checkout the runs import (e.g. a worktree of an "
                    "older commit, to measure its loader); rows are written only for this checkout's own")
    ap.add_argument("--skip-beyond", action="store_true", help="no run of a checkpoint beyond memory / nproc")
    ap.add_argument("--beyond-fraction", type=float, default=1.1, help="that checkpoint's size, as a multiple of "
                    "MemAvailable / nproc (below 1 only to check the benchmark itself at a small size)")
    a = ap.parse_args()
    t_start = time.time()
    ckpt = {k: build_checkpoint(k) for k in ("dense", "moe")}
    n_params = {"dense": dense_params(DENSE), "moe": moe_params(MOE)}
    size = {k: checkpoint_bytes(p) for k, p in ckpt.items()}
    for k in ckpt:
        files = sorted(p.name for p in ckpt[k].glob("*.safetensors"))
        print(f"{k}: {n_params[k] / 1e9:.3f}B parameters, {gib(size[k])} in {len(files)} safetensors files "
              f"+ index ({ckpt[k]}); built in {time.time() - t_start:.0f} s ({load()})", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-bench-load-") as tmp:
        work = Path(tmp)
        chats = write_chats(work)
        for run in [] if a.ttfs_only else RUNS:
            if a.only and a.only.lower() not in run.name.lower():
                continue
            cfg = write_toml(work, run, ckpt[run.kind], chats)
            plan = predicted(cfg, run.nproc, today=Path(a.kiln_root).resolve() != ROOT)
            before = load()
            res = run_kiln(run, ckpt[run.kind], chats, work, a.kiln_root)
            floor = (FLOOR_BYTES_PER_PARAM * n_params[run.kind] / run.nproc if run.targets is None
                     else size[run.kind])
            worst = max(res["peaks"])
            plan_peak = max(b for _, b in plan)
            print(f"{run.name} ({run.kind}): peak RSS per rank {', '.join(gib(p) for p in res['peaks'])}; "
                  f"/ {'16 B/param floor over ranks' if run.targets is None else 'checkpoint'} "
                  f"{worst / floor:.2f}x (goal <= {run.goal}x); kiln plan "
                  f"{', '.join(f'{r} {gib(b)}' for r, b in plan)}; measured / plan {worst / plan_peak:.2f}; "
                  f"first step at {res['first_step_s']:.0f} s, wall {res['wall_s']:.0f} s; {before} -> {load()}",
                  flush=True)
            rows.append((run, res, plan_peak, floor, before))
        beyond = None
        if not (a.skip_beyond or a.ttfs_only) and (not a.only or a.only.lower() in "beyond memory"):
            beyond = run_beyond(ckpt["dense"], chats, work, a.kiln_root, a.beyond_fraction)
        ttfs = None
        if a.ttfs_only or (not a.skip_ttfs and not a.only):
            run = RUNS[0]
            kiln_s, peer_s = [], []
            for r in range(a.rounds):
                for side in ("peer", "kiln")[:: 1 if r % 2 == 0 else -1]:
                    before = load()
                    if side == "kiln":
                        got = run_kiln(run, ckpt["dense"], chats, work)
                        kiln_s.append(got["first_step_s"])
                    else:
                        got = run_peer(ckpt["dense"], ALL_LINEAR)
                        peer_s.append(got["first_step_s"])
                    peak = max(got["peaks"]) if side == "kiln" else got["peak"]
                    print(f"time to first step, round {r + 1}, {side}: {got['first_step_s']:.1f} s, peak RSS "
                          f"{gib(peak)} ({before} -> {load()})", flush=True)
            ttfs = (kiln_s, peer_s, load())
    if Path(a.kiln_root).resolve() != ROOT:
        print(f"(runs imported kiln from {a.kiln_root}: no rows written)")
        return
    print(f"\nbenchmark wall time {(time.time() - t_start) / 60:.1f} min; {load()}")
    for run, res, plan_peak, floor, before in rows:
        worst = max(res["peaks"])
        against = "16 B/param floor / ranks" if run.targets is None else "checkpoint"
        report(f"load 1B {'Qwen3-MoE' if run.kind == 'moe' else 'Qwen3'} bf16: {run.name} (peak RSS of the largest "
               f"rank / {against})", "kiln plan (predicted)", "GiB", [worst / GiB], [plan_peak / GiB],
               kiln_mem=worst / 2 ** 20, peer_mem=floor / 2 ** 20, goal=f"<= {run.goal}x memory",
               note=f"ratio = measured / kiln plan; per rank {', '.join(f'{p / GiB:.2f}' for p in res['peaks'])} GiB; "
                    f"{before}")
    if beyond:
        run, res, plan_peak, ckpt_size, avail, before = beyond
        worst = max(res["peaks"])
        report(f"load beyond memory / {run.nproc}: {run.name} (peak RSS of the largest rank / checkpoint)",
               "kiln plan (predicted)", "GiB", [worst / GiB], [plan_peak / GiB], kiln_mem=worst / 2 ** 20,
               peer_mem=ckpt_size / 2 ** 20, goal=f"trains; <= {run.goal}x memory",
               note=f"checkpoint {gib(ckpt_size)} > MemAvailable {gib(avail)} / {run.nproc}; per rank "
                    f"{', '.join(f'{p / GiB:.2f}' for p in res['peaks'])} GiB, all ranks {gib(sum(res['peaks']))}; "
                    f"{before}")
    if ttfs:
        kiln_s, peer_s, when = ttfs
        report("time to first step, 1B Qwen3 bf16, LoRA, 1 process (kiln train vs from_pretrained + get_peft_model "
               "+ 1 step)", "transformers+peft", "first steps/min", [60 / s for s in kiln_s], [60 / s for s in peer_s],
               goal="reported", note=f"kiln {min(kiln_s):.1f} s, peer {min(peer_s):.1f} s; {when}")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--peer-child":
        print(json.dumps(peer_first_step(Path(sys.argv[2]), sys.argv[3].split(","))))
    else:
        main()
