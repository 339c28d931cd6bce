"""Alarms for GRPO runs that learn nothing, and the rollouts on disk ([grpo] log_rollouts_every).

Every rollout logs, over every rank's completions: `alarm/truncated` (the share cut by the token budget: no end
token), `alarm/zero_std_groups` (the share of prompt groups whose rewards are all equal: zero advantage, no
gradient), `alarm/none_rewards` (the share no reward function scored), and with env / tools `alarm/turn_limit`
(episodes stopped by max_turns), `alarm/parse_failures` (episodes with a tool call that did not parse) and
`alarm/env_errors` (episodes failed by user code). Each, and `logprob_gap`, is warned about once per run when over
its threshold, saying what to change. `groups_with_signal` counts the groups whose rewards differ (the ones that
teach); a rollout where none do is warned about once (kiln.train.preference.Signal). `rollouts.jsonl` gets one JSON object per completion or episode.
A run whose reward functions score nothing at all (every reward None, every rank) in its first `NONE_ROLLOUTS`
rollouts (or in all of them, when the run is shorter) is stopped with a ConfigError (exit 1): with no reward there is
no advantage and nothing to learn (`NoneStreak`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch

from kiln.errors import ConfigError  # sweep2

# what a value over the threshold means, and what to do about it
THRESHOLDS: dict[str, tuple[float, str]] = {
    "alarm/truncated": (0.5, "most completions hit the token budget without ending (raise grpo.max_new_tokens / "
                             "max_episode_tokens while the prompt and the budget fit the model's "
                             "max_position_embeddings, where an episode stops whatever its budget (sweep2); or set "
                             "mask_truncated_completions = true)"),
    "alarm/zero_std_groups": (0.5, "most prompt groups have equal rewards: zero advantages, no learning signal "
                                   "(rewards too sparse or saturated; more num_generations, easier prompts)"),
    "alarm/none_rewards": (0.5, "most completions got no reward (every reward function returned None)"),
    "alarm/turn_limit": (0.5, "most episodes were stopped by grpo.max_turns rather than by the environment"),
    "alarm/parse_failures": (0.2, "many episodes wrote a tool call the template's parser could not read"),
    "alarm/env_errors": (0.1, "many episodes failed in the environment or a tool (see rollouts.jsonl's `error`)"),
    "logprob_gap": (1e-3, "the sampler's log-probs differ from the trainer's (rollouts are off-policy)"),
}
EPISODE_ALARMS = ("alarm/turn_limit", "alarm/parse_failures", "alarm/env_errors")


def counts(micro: dict[str, Any], rewards: torch.Tensor, group: int, episodes: list[Any] | None) -> torch.Tensor:
    """(9,) float64 sums over one micro-batch: completions, truncated, None rewards, groups, zero-std groups,
    episodes, turn-limit ends, episodes with parse failures, failed episodes."""
    n = rewards.numel()
    grouped = rewards.view(-1, group)
    lo = torch.where(torch.isnan(grouped), math.inf, grouped).min(1).values
    hi = torch.where(torch.isnan(grouped), -math.inf, grouped).max(1).values
    flat = ~(hi > lo)  # all equal, or all None
    eps = episodes or []
    return torch.tensor([n, float(micro["truncated"].sum()), float(torch.isnan(rewards).sum()), grouped.size(0),
                         float(flat.sum()), len(eps), sum(e.end == "max_turns" for e in eps),
                         sum(e.parse_failures > 0 for e in eps), sum(e.end == "error" for e in eps)],
                        dtype=torch.float64)


def metrics(total: torch.Tensor, multi_turn: bool) -> dict[str, float]:
    out = {"alarm/truncated": float(total[1] / total[0]), "alarm/none_rewards": float(total[2] / total[0]),
           "alarm/zero_std_groups": float(total[4] / total[3]), "groups_with_signal": float(total[3] - total[4])}
    if multi_turn:
        out.update({"alarm/turn_limit": float(total[6] / total[5]), "alarm/parse_failures": float(total[7] / total[5]),
                    "alarm/env_errors": float(total[8] / total[5])})
    return out


class Alarms:
    """Warns once per alarm per run (on the main process) when a metric goes over its threshold."""

    def __init__(self) -> None:
        self.warned: set[str] = set()

    def check(self, values: dict[str, float], step: int, main: bool) -> list[str]:
        said = []
        for name, (limit, why) in THRESHOLDS.items():
            v = values.get(name)
            if v is None or name in self.warned or not v > limit:
                continue
            self.warned.add(name)
            line = f"warning: step {step}: {name} = {v:.3g} (over {limit:g}): {why}"
            said.append(line)
            if main:
                print(line, flush=True)
        return said


NONE_ROLLOUTS = 3  # sweep2: rollouts in a row from the start with no reward at all before the run is refused


class NoneStreak:  # sweep2
    """Refuses a run whose first rollouts got no reward at all (each of them: every function None for every
    completion of every rank). None means "does not apply", so this is a reward set that fits no prompt of the data
    (a wrong column, a function for another task); a run of it learns nothing. Once a reward is scored, never."""

    def __init__(self) -> None:
        self.rollouts = 0
        self.scored = False

    def check(self, total: torch.Tensor, names: list[str], step: int, last: bool) -> None:
        """`total`: a rollout's `counts` summed over every rank; `last`: the run's final step."""
        if self.scored or total[0] == 0:
            return
        if total[2] < total[0]:
            self.scored = True
            return
        self.rollouts += 1
        if self.rollouts >= NONE_ROLLOUTS or last:
            raise ConfigError(
                f"[grpo] nothing can be learned: every reward function ({', '.join(names)}) returned None for every "
                f"completion of the first {self.rollouts} rollout(s) (up to step {step}), so no advantage and no "
                f"gradient; None means \"does not apply\": check grpo.rewards against the data's columns, and return "
                f"a number (0.0 for a wrong answer) where a completion is judged")


def check_positions(config: Any, ids: list[list[int]], where: list[str], max_new_tokens: int) -> None:  # sweep2
    """Refuses, before any work, a [grpo] max_new_tokens that cannot fit after the longest prompt in the model's
    positions (where its family has a limit): every completion would be cut by the positions, not by the budget."""
    positions = getattr(config, "max_position_embeddings", None)
    i = max(range(len(ids)), key=lambda k: len(ids[k]))
    longest_prompt, source = len(ids[i]), where[i]
    if isinstance(positions, int) and longest_prompt + max_new_tokens > positions:
        raise ConfigError(f"grpo.max_new_tokens = {max_new_tokens}: the longest prompt ({source}) is "
                          f"{longest_prompt} tokens, and {longest_prompt} + {max_new_tokens} = "
                          f"{longest_prompt + max_new_tokens} is over the model's max_position_embeddings = "
                          f"{positions}; set grpo.max_new_tokens <= {max(positions - longest_prompt, 0)}")


def single_turn_records(micro: dict[str, Any], rows: list[int], repeat: int, per_func: torch.Tensor,
                        names: list[str], tokenizer: Any, step: int) -> list[dict[str, Any]]:
    p = micro["prompt_len"]
    out = []
    for i in range(micro["input_ids"].size(0)):
        prompt = micro["input_ids"][i, :p][micro["attention_mask"][i, :p].bool()].tolist()
        k = int(micro["completion_mask"][i].sum())
        ids = micro["input_ids"][i, p: p + k].tolist()
        out.append({"step": step, "row": rows[i // repeat], "prompt_ids": prompt, "completion_ids": ids,
                    "loss_mask": micro["loss_mask"][i, :k].tolist(), "text": tokenizer.decode(ids),
                    "rewards": named(per_func[i], names), "turns": 1})
    return out


def named(row: torch.Tensor, names: list[str]) -> dict[str, float | None]:
    return {n: (None if math.isnan(float(v)) else float(v)) for n, v in zip(names, row)}


def append_records(path: Path, records: list[dict[str, Any]]) -> None:
    """Append JSON lines (one write, flushed and synced: a crash leaves whole lines)."""
    import os

    text = "".join(json.dumps(r, default=str, ensure_ascii=False) + "\n" for r in records)
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
