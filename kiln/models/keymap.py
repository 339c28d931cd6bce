"""HF key maps as data: (kiln prefix, HF prefix) pairs with `{}` standing for a layer index.

A rule maps a module prefix, so one line covers a Linear's weight and bias. Tensor steps
(transpose, split, stack) are named, reversible functions attached to a rule when needed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

Step = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]


def _pattern(template: str) -> re.Pattern:
    parts = [re.escape(p) for p in template.split("{}")]
    return re.compile(r"(\d+)".join(parts) + r"(\..+)?$")


@dataclass(frozen=True)
class Rule:
    kiln: str
    hf: str
    step: Step | None = None  # (kiln->hf, hf->kiln) tensor functions; None = identity


class KeyMap:
    """Renames state-dict keys between kiln and HF; an unmatched key is returned as such."""

    def __init__(self, rules: list[Rule | tuple[str, str]]):
        self.rules = [r if isinstance(r, Rule) else Rule(*r) for r in rules]
        self._to_hf = [(_pattern(r.kiln), r) for r in self.rules]
        self._to_kiln = [(_pattern(r.hf), r) for r in self.rules]

    @staticmethod
    def _apply(key: str, table, target: str) -> tuple[str, Rule] | None:
        for pat, rule in table:
            m = pat.match(key)
            if m:
                groups = m.groups()
                name = getattr(rule, target)
                for g in groups[:-1]:
                    name = name.replace("{}", g, 1)
                return name + (groups[-1] or ""), rule
        return None

    def to_hf(self, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
        out, unmatched = {}, []
        for k, v in state.items():
            hit = self._apply(k, self._to_hf, "hf")
            if hit is None:
                unmatched.append(k)
                continue
            name, rule = hit
            out[name] = rule.step[0](v) if rule.step else v
        return out, unmatched

    def to_kiln(self, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
        out, unmatched = {}, []
        for k, v in state.items():
            hit = self._apply(k, self._to_kiln, "kiln")
            if hit is None:
                unmatched.append(k)
                continue
            name, rule = hit
            out[name] = rule.step[1](v) if rule.step else v
        return out, unmatched

    def kiln_name(self, hf_key: str) -> str | None:
        hit = self._apply(hf_key, self._to_kiln, "kiln")
        return None if hit is None else hit[0]

    def hf_name(self, kiln_key: str) -> str | None:
        hit = self._apply(kiln_key, self._to_hf, "hf")
        return None if hit is None else hit[0]

    def prefixed(self, kiln_prefix: str, hf_prefix: str) -> "KeyMap":
        """The same rules under module prefixes on both sides (e.g. `model.` and `bert.`)."""
        def join(p: str, s: str) -> str:
            return f"{p}.{s}" if p and s else (p or s)
        return KeyMap([Rule(join(kiln_prefix, r.kiln), join(hf_prefix, r.hf), r.step) for r in self.rules])

    def __add__(self, other: "KeyMap") -> "KeyMap":
        return KeyMap(self.rules + other.rules)
