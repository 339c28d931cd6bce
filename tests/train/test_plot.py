"""`kiln plot`: train and eval loss share one panel; the other metrics keep a panel each."""

from __future__ import annotations

import json

from kiln.train.plot import panels, plot_run


def test_plot_puts_train_and_eval_loss_on_one_panel(tmp_path):
    records = [{"step": 1, "loss": 2.0, "lr": 1e-3}, {"step": 2, "eval_loss": 1.5, "eval_accuracy": 0.4, "eval_f1": 0.3}]
    assert panels(records) == [("loss", ["loss", "eval_loss"]), ("learning rate", ["lr"]),
                               ("eval_accuracy", ["eval_accuracy"]), ("eval_f1", ["eval_f1"])]
    assert panels(records[:1]) == [("train loss", ["loss"]), ("learning rate", ["lr"])]
    assert panels([{"step": 1, "eval_loss": 1.0}]) == [("eval_loss", ["eval_loss"])]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert plot_run(tmp_path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_adds_the_runs_lm_eval_scores(tmp_path):
    from kiln.train.plot import harness_scores

    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    assert harness_scores(tmp_path) == []
    (tmp_path / "lm_eval_results.json").write_text(json.dumps({"results": {"mc": {
        "alias": "mc", "acc,none": 0.25, "acc_stderr,none": "N/A", "acc_norm,none": 0.5}}}))
    assert harness_scores(tmp_path) == [("mc acc", 0.25), ("mc acc_norm", 0.5)]
    assert plot_run(tmp_path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
