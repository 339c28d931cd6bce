"""Gradient accumulation: 4 micro-batches of 2 give the same update as one batch of 8,
for a per-example loss and for a per-token loss whose micro-batches hold different token counts."""

from __future__ import annotations

import torch

from kiln.data.loader import Loader
from kiln.models.auto import from_config
from kiln.train import Trainer
from tests.train.train_helpers import tiny_config


def _token_data(n: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        length = 3 + (i * 7) % 20  # lengths 3..22: micro-batches differ in token count
        labels = torch.randint(0, 3, (length,), generator=g)
        labels[torch.rand(length, generator=g) < 0.3] = -100
        out.append({"input_ids": torch.randint(5, 99, (length,), generator=g), "labels": labels})
    return out


def _seq_data(n: int = 16) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(5, 99, (4 + i % 9,), generator=g), "labels": torch.tensor(i % 3)}
            for i in range(n)]


def _train(task: str, data: list[dict], batch_size: int, grad_accum: int, tmp_path) -> dict[str, torch.Tensor]:
    model = from_config(tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), task=task, seed=0)
    # SGD: the update is the gradient itself (Adam would blow rounding noise in near-zero grads up to lr).
    t = Trainer(model, data, optimizer=lambda groups: torch.optim.SGD(groups, lr=0.5), steps=2, batch_size=batch_size, grad_accum=grad_accum, lr=1e-2, warmup_steps=0,
                schedule="constant", clip_grad_norm=None, out_dir=str(tmp_path / f"{task}-{batch_size}"),
                progress=False, seed=5).fit()
    return {k: v.detach().clone() for k, v in t.unwrapped().state_dict().items()}


def _assert_close(a: dict, b: dict) -> None:
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=2e-6, msg=f"{k} differs")


def test_token_loss_micro_batches_equal_one_batch(tmp_path):
    data = _token_data()
    # The micro-batches really do hold different numbers of labelled tokens (else a mean of means would pass).
    loader = Loader(data, 2, seed=5)
    counts = [int((loader.next_batch()["labels"] != -100).sum()) for _ in range(4)]
    assert len(set(counts)) > 1, counts
    _assert_close(_train("token-classification", data, 2, 4, tmp_path), _train("token-classification", data, 8, 1, tmp_path))


def test_sequence_loss_micro_batches_equal_one_batch(tmp_path):
    data = _seq_data()
    _assert_close(_train("sequence-classification", data, 2, 4, tmp_path),
                  _train("sequence-classification", data, 8, 1, tmp_path))


def test_mean_of_micro_batch_means_would_differ(tmp_path):
    """The check above can fail: weighting each micro-batch equally (a plain mean loss) changes the result."""
    data = _token_data()

    def mean_step(model, batch):
        out = model(**{k: v for k, v in batch.items() if k != "labels"})
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), batch["labels"].flatten())
        return loss * 2, 2  # each micro-batch weighted as 2 examples, whatever its token count

    model = from_config(tiny_config(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
                        task="token-classification", seed=0)
    t = Trainer(model, data, optimizer=lambda groups: torch.optim.SGD(groups, lr=0.5), step=mean_step, steps=2, batch_size=2, grad_accum=4, lr=1e-2, schedule="constant",
                clip_grad_norm=None, out_dir=str(tmp_path / "mean"), progress=False, seed=5).fit()
    naive = t.unwrapped().state_dict()
    exact = _train("token-classification", data, 8, 1, tmp_path)
    assert any((naive[k] - exact[k]).abs().max() > 1e-5 for k in exact)
