"""`kiln eval` over lm-evaluation-harness: a local multiple-choice task (local data, offline) scored through
kiln's model equals lm-eval's own HF backend on the exported directory; rolling log-likelihood and
generation too."""

from __future__ import annotations

import json
import random
import shutil

import pytest
from typer.testing import CliRunner

from kiln.cli.main import app

WORDS = ["the", "cat", "dog", "sat", "ran", "on", "under", "mat", "log", "hill", "red", "blue", "big", "small", "a", "quick", "lazy", "fox", "jumps", "over"]


@pytest.fixture(scope="module")
def eval_setup(tmp_path_factory):
    from kiln.data.bpe import train_bpe
    from kiln.interop.tiny import make_tiny

    d = tmp_path_factory.mktemp("lmeval")
    rng = random.Random(0)
    docs = []
    for i in range(12):
        q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 7)))
        choices = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 4))) for _ in range(4)]
        docs.append({"question": f"Q: {q}\nA:", "choices": choices, "answer": i % 4, "text": f"{q}. {choices[0]}."})
    (d / "docs.jsonl").write_text("".join(json.dumps(x) + "\n" for x in docs))
    (d / "corpus.txt").write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) for _ in range(50)))
    train_bpe([d / "corpus.txt"], d / "tok", vocab_size=300, min_frequency=1)
    model = make_tiny("qwen3", "causal-lm", d / "model", tokenizer=False, vocab_size=300, eos_token_id=2,
                      pad_token_id=0, max_position_embeddings=64)
    for f in (d / "tok").iterdir():
        shutil.copy(f, model / f.name)
    tasks = d / "tasks"
    tasks.mkdir()
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {d / 'docs.jsonl'}\ntest_split: test\n"
    (tasks / "mc.yaml").write_text("task: kiln_tiny_mc\n" + common + "output_type: multiple_choice\n"
                                   "doc_to_text: \"{{question}}\"\ndoc_to_choice: choices\ndoc_to_target: answer\n"
                                   "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (tasks / "ppl.yaml").write_text("task: kiln_tiny_ppl\n" + common + "output_type: loglikelihood_rolling\n"
                                    "doc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
                                    "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    (tasks / "gen.yaml").write_text("task: kiln_tiny_gen\n" + common + "output_type: generate_until\n"
                                    "doc_to_text: \"{{question}}\"\ndoc_to_target: \"{{choices[0]}}\"\n"
                                    "generation_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: 8\n"
                                    "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    return d, model, tasks


def _hf_scores(model_dir, tasks_dir, names):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    res = simple_evaluate(model="hf", model_args={"pretrained": str(model_dir), "device": "cpu", "dtype": "float32"},
                          tasks=names, task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False), log_samples=False,
                          batch_size=4, bootstrap_iters=0)
    return res["results"]


def test_kiln_eval_equals_lm_eval_hf_backend(eval_setup, tmp_path):
    d, model, tasks = eval_setup
    names = ["kiln_tiny_mc", "kiln_tiny_ppl", "kiln_tiny_gen"]
    r = CliRunner().invoke(app, ["eval", str(model), "--tasks", ",".join(names), "--include", str(tasks),
                                 "--out", str(tmp_path / "res.json")])
    assert r.exit_code == 0, r.output
    ours = json.loads((tmp_path / "res.json").read_text())["results"]
    r = CliRunner().invoke(app, ["export", str(model), "--out", str(d / "export")])
    assert r.exit_code == 0, r.output
    theirs = _hf_scores(d / "export", tasks, names)
    for key in ("acc,none", "acc_norm,none"):
        assert ours["kiln_tiny_mc"][key] == theirs["kiln_tiny_mc"][key], key
    for key in ("word_perplexity,none", "bits_per_byte,none"):
        assert ours["kiln_tiny_ppl"][key] == pytest.approx(theirs["kiln_tiny_ppl"][key], rel=1e-5), key
    assert ours["kiln_tiny_gen"]["exact_match,none"] == theirs["kiln_tiny_gen"]["exact_match,none"]


@pytest.mark.slow  # an unknown name makes lm-eval index its thousands of built-in task YAMLs
def test_kiln_eval_refuses_unknown_task(eval_setup):
    _, model, tasks = eval_setup
    r = CliRunner().invoke(app, ["eval", str(model), "--tasks", "no_such_task", "--include", str(tasks)])
    assert r.exit_code == 1 and "unknown lm-eval task(s): no_such_task" in r.output
