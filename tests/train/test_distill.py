"""[distill]: the step's loss equal to TRL's generalized_jsd_loss on the two models' full logits, a teacher of another
vocabulary or tokenizer refused before work starts, the student's KL to the teacher falling over a short run, and
SIGKILL + resume exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.data.loader import pad_collate
from kiln.data.records import Record
from kiln.data.sft import encode_sft
from kiln.errors import ConfigError
from kiln.hub import Tokenizer
from kiln.models.auto import load_pretrained
from kiln.models.common.fast import set_fast
from kiln.train.config import load_run_config
from kiln.train.metrics import read_metrics
from kiln.train.recipes.distill import DistillRun, DistillSection
from kiln.train.run import build_trainer
from tests.train.dpo_helpers import arithmetic_pairs, hf_model_dir, make_tokenizer, model_section, write_jsonl


def chats(n: int, seed: int = 0) -> list[dict]:
    return [{"messages": r["prompt"] + r["chosen"]} for r in arithmetic_pairs(n, seed)]


def peaked_dir(d: Path, tok: Path, seed: int) -> Path:
    """A tiny HF Qwen3 whose weights are drawn wide (std 0.15), so its next-token distributions are far from
    uniform (transformers' 0.02 init makes every model nearly uniform, and any two nearly equal)."""
    import transformers

    hf_model_dir(d, tok, seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(d)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.15 + (1.0 if p.dim() == 1 else 0.0))  # norms near 1
    model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def d(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("distill")
    write_jsonl(d / "train.jsonl", chats(64))
    write_jsonl(d / "eval.jsonl", chats(16, 5))
    tok = make_tokenizer(d, arithmetic_pairs(80))
    peaked_dir(d / "teacher", tok, 7)
    peaked_dir(d / "student", tok, 0)
    return d


@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (0.5, 2.0), (1.0, 1.0)])
def test_step_loss_equals_trl_on_the_full_logits(d, beta, temperature):
    import transformers
    from trl.experimental.gkd.gkd_trainer import GKDTrainer

    rows = [Record(r, f"rows:{i + 1}") for i, r in enumerate(chats(5, 2))]
    examples, _ = encode_sft(rows, Tokenizer.from_dir(d / "student"), 40, "assistant", False)
    batch = pad_collate(examples)
    student = transformers.AutoModelForCausalLM.from_pretrained(d / "student")
    teacher = transformers.AutoModelForCausalLM.from_pretrained(d / "teacher")
    labels = torch.nn.functional.pad(batch["labels"][:, 1:], (0, 1), value=-100)  # next-token targets
    want = GKDTrainer.generalized_jsd_loss(
        student(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits,
        teacher(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.detach(),
        labels=labels, beta=beta, temperature=temperature)
    run = DistillRun(DistillSection(teacher=str(d / "teacher"), beta=beta, temperature=temperature),
                     set_fast(load_pretrained(d / "teacher", task="causal-lm")).eval(), None)
    mine = set_fast(load_pretrained(d / "student", task="causal-lm"))
    total, count = run.loss_sum(mine, batch)
    got = total / count
    assert float(want) > 1e-3  # control: the two models differ
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want)), (float(got), float(want))
    # the first step's gradients too: every student weight's, relative 1e-5 of its largest element
    want.backward()
    got.backward()
    theirs = {n: p.grad for n, p in student.named_parameters() if p.grad is not None}
    ours = {n: p.grad for n, p in mine.named_parameters() if p.grad is not None}
    assert set(ours) == set(theirs) and theirs
    for name, g in theirs.items():
        scale = float(g.abs().max()) or 1.0
        assert float((ours[name] - g).abs().max()) <= 1e-5 * scale + 1e-8, name


def run_toml(d: Path, out: str, teacher: Path, steps: int = 12) -> Path:
    path = d / f"{out}.toml"
    path.write_text(f"""
{model_section(d)}[data]
train = "{d / 'train.jsonl'}"
eval = "{d / 'eval.jsonl'}"
max_length = 40
[train]
out_dir = "{d / out}"
seed = 1
steps = {steps}
batch_size = 8
lr = 1e-2
weight_decay = 0.0
progress = false
log_every = 1
eval_every = 6
save_every = 6
[distill]
teacher = "{teacher}"
""")
    return path


def test_a_teacher_of_another_vocabulary_or_tokenizer_is_refused(d, tmp_path):
    import transformers

    from tests.train.dpo_helpers import QWEN3

    other = tmp_path / "wide"
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**QWEN3, "vocab_size": 320})).save_pretrained(other)
    transformers.AutoTokenizer.from_pretrained(d / "tok").save_pretrained(other)
    with pytest.raises(ConfigError, match="its vocabulary has 320 entries, the student's 300"):
        build_trainer(load_run_config(run_toml(d, "bad", other)))
    alien = tmp_path / "alien"
    (alien / "src").mkdir(parents=True)
    tok = make_tokenizer(alien / "src", [{"prompt": [{"role": "user", "content": "zebra quartz"}],
                                          "chosen": [{"role": "assistant", "content": "xylophone jam"}],
                                          "rejected": [{"role": "assistant", "content": "vex"}]}] * 4)
    hf_model_dir(alien, tok, 3)
    with pytest.raises(ConfigError, match="its tokenizer differs from the student's"):
        build_trainer(load_run_config(run_toml(d, "bad", alien)))
    assert not (d / "bad").exists()  # refused before anything was written
    with pytest.raises(ConfigError, match="distill.beta must be a finite number >= 0 and <= 1, got 2"):
        load_run_config(_with(d, "beta = 2"))
    with pytest.raises(ConfigError, match="distill.temperature must be a finite number > 0, got nan"):
        load_run_config(_with(d, "temperature = nan"))


def _with(d: Path, line: str) -> Path:
    path = run_toml(d, "bad", d / "teacher")
    path.write_text(path.read_text().replace("[distill]\n", f"[distill]\n{line}\n"))
    return path


def test_students_kl_to_the_teacher_falls(d):
    """Forward KL from a random-init student to a fixed random teacher (both tiny Qwen3s) on arithmetic chats: the
    held-out KL at step 12 is below that at step 6, and the train KL falls by more than a third from the first step
    (the two start ~1 nat apart; a student the size of the teacher can match it)."""
    build_trainer(load_run_config(run_toml(d, "run", d / "teacher"))).fit()
    records = read_metrics(d / "run" / "metrics.jsonl")
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r["eval_loss"] for r in records if "eval_loss" in r]
    print(f"train KL {losses[0]:.4f} -> {losses[-1]:.4f}; held-out {evals}")
    assert len(losses) == 12 and len(evals) == 2
    assert sum(losses[-3:]) / 3 < 0.67 * losses[0], losses
    assert evals[1] < evals[0], evals


@pytest.mark.slow
def test_sigkill_then_resume_is_exact(d):
    from safetensors.torch import load_file

    from tests.train.train_helpers import kiln

    kiln("train", "--config", str(run_toml(d, "ref", d / "teacher")))
    cfg = run_toml(d, "killed", d / "teacher")
    p = kiln("train", "--config", str(cfg), env={"KILN_FAULT": "step:9"}, check=False)
    assert p.returncode == -9, p.stderr
    p = kiln("train", "--config", str(cfg), "--resume", str(d / "killed"))
    assert "from ckpt-000006" in p.stdout
    a = load_file(str(d / "ref" / "ckpt-000012" / "model" / "model.safetensors"))
    b = load_file(str(d / "killed" / "ckpt-000012" / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def curve(run):
        return [{k: v for k, v in r.items() if not k.endswith("_per_s")} for r in read_metrics(run / "metrics.jsonl")]

    assert curve(d / "killed") == curve(d / "ref")
    assert json.loads((d / "killed" / "metrics.jsonl").read_text().splitlines()[-1])
