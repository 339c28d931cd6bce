"""A number-guessing game in kiln's environment protocol (no kiln import): the user thinks of a digit, the
policy guesses, the user answers "higher" or "lower" until it is found or the turns run out.

The secret is one of the row's `target`s (examples/agent/run.py draws 2 or 7, which the prompt does not say:
the policy has to find them by playing). Step reward: 1.0 for the right digit (the episode ends),
-0.2 * |guess - target| / 9 for a wrong one, -0.2 for a reply without a digit ("Say one digit."). The episode's
reward, `reward/env`, is their sum: finding the digit sooner scores more."""

from __future__ import annotations

import re


class GuessEnv:
    def reset(self, row: dict, seed: int) -> dict:
        self.target = int(row["target"])
        return {"messages": [{"role": "user", "content": row["prompt"]}]}

    def step(self, message: dict) -> dict:
        found = re.search(r"\d", message.get("content") or "")
        if found is None:
            return {"messages": [{"role": "user", "content": "Say one digit."}], "reward": -0.2}
        guess = int(found.group())
        if guess == self.target:
            return {"done": True, "reward": 1.0}
        hint = "higher" if guess < self.target else "lower"
        return {"messages": [{"role": "user", "content": hint}], "reward": -0.2 * abs(guess - self.target) / 9}
