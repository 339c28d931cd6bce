"""HF key maps as data: (kiln prefix, HF prefix) pairs with `{}` standing for a layer index.

A rule maps a module prefix, so one line covers a Linear's weight and bias. Tensor steps
(transpose, split) are named, reversible functions attached to a rule when needed. A `Stack`
maps one kiln tensor to many HF tensors: experts held stacked in kiln, one tensor per expert
(and per part, e.g. gate and up) on disk.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kiln.errors import WeightsError

Step = tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]]


def _pattern(template: str) -> re.Pattern:
    parts = [re.escape(p) for p in template.split("{}")]
    return re.compile(r"(\d+)".join(parts) + r"(\..+)?$")


@dataclass(frozen=True)
class Rule:
    kiln: str
    hf: str
    step: Step | None = None  # (kiln->hf, hf->kiln) tensor functions; None = identity


@dataclass(frozen=True)
class Stack:
    """kiln tensor (E, ...) = stack over experts e of cat(HF part tensors of e, dim=`dim`).

    `kiln` and each of `hf` are full tensor names; in `hf` the last `{}` is the expert index,
    earlier ones (layer indices) are shared with `kiln`.
    """
    kiln: str
    hf: tuple[str, ...]
    dim: int = 0

    def hf_names(self, outer: tuple[str, ...], num_experts: int) -> list[list[str]]:
        """[expert][part] -> HF name, for the layer indices `outer`."""
        def fill(template: str, e: int) -> str:
            for g in outer:
                template = template.replace("{}", g, 1)
            return template.replace("{}", str(e), 1)
        return [[fill(t, e) for t in self.hf] for e in range(num_experts)]


def _full(template: str, last: str = r"(\d+)") -> re.Pattern:
    """A full-name pattern; the last `{}` may match `last` (the expert slot also takes the `*` of messages)."""
    parts = [re.escape(p) for p in template.split("{}")]
    return re.compile(r"(\d+)".join(parts[:-1]) + (last if len(parts) > 1 else "") + parts[-1] + "$")


class KeyMap:
    """Renames state-dict keys between kiln and HF; an unmatched key is returned as such."""

    def __init__(self, rules: Sequence[Rule | Stack | tuple[str, str]]):
        all_rules = [r if isinstance(r, (Rule, Stack)) else Rule(*r) for r in rules]
        self.rules = [r for r in all_rules if isinstance(r, Rule)]
        self.stacks = [r for r in all_rules if isinstance(r, Stack)]
        self._to_hf = [(_pattern(r.kiln), r) for r in self.rules]
        self._to_kiln = [(_pattern(r.hf), r) for r in self.rules]
        self._stack_kiln = [(_full(s.kiln), s) for s in self.stacks]
        self._stack_hf = [(_full(t, r"(\d+|\*)"), s, part) for s in self.stacks for part, t in enumerate(s.hf)]

    # ---- stacked tensors --------------------------------------------------------------------
    def _unstack(self, key: str, value: torch.Tensor) -> dict[str, torch.Tensor] | None:
        for pat, stack in self._stack_kiln:
            m = pat.match(key)
            if m:
                names = stack.hf_names(m.groups(), value.shape[0])
                out = {}
                for e, per_part in enumerate(names):
                    # clone: parts must not share storage with each other (safetensors refuses that)
                    for name, part in zip(per_part, value[e].chunk(len(stack.hf), dim=stack.dim)):
                        out[name] = part.clone()
                return out
        return None

    def _stack_hit(self, key: str) -> tuple[Stack, tuple[str, ...], int, int] | None:
        for pat, stack, part in self._stack_hf:
            m = pat.match(key)
            if m:
                *outer, expert = m.groups()
                return stack, tuple(outer), part, -1 if expert == "*" else int(expert)
        return None

    def _restack(self, found: dict) -> dict[str, torch.Tensor]:
        out = {}
        for (stack, outer), parts in found.items():
            num = max(e for _, e in parts) + 1
            names = stack.hf_names(outer, num)
            missing = [names[e][p] for e in range(num) for p in range(len(stack.hf)) if (p, e) not in parts]
            if missing:
                raise WeightsError(f"expert tensor(s) missing: {', '.join(repr(n) for n in missing[:4])}"
                                   + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
            kiln = stack.kiln
            for g in outer:
                kiln = kiln.replace("{}", g, 1)
            out[kiln] = torch.stack([torch.cat([parts[(p, e)] for p in range(len(stack.hf))], dim=stack.dim)
                                     for e in range(num)])
        return out

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

    def _rename(self, key: str, value: torch.Tensor, to_hf: bool, out: dict[str, torch.Tensor],
                unmatched: list[str]) -> None:
        """One plain (not stacked) tensor renamed by its rule, the rule's step (to HF: its first, else its second)
        applied, into `out`; a key no rule matches goes to `unmatched`."""
        hit = self._apply(key, self._to_hf if to_hf else self._to_kiln, "hf" if to_hf else "kiln")
        if hit is None:
            unmatched.append(key)
            return
        name, rule = hit
        out[name] = rule.step[0 if to_hf else 1](value) if rule.step else value

    def to_hf(self, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
        out: dict[str, torch.Tensor] = {}
        unmatched: list[str] = []
        for k, v in state.items():
            if self.stacks:
                parts = self._unstack(k, v)
                if parts is not None:
                    out.update(parts)
                    continue
            self._rename(k, v, True, out, unmatched)
        return out, unmatched

    def to_kiln(self, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
        out: dict[str, torch.Tensor] = {}
        unmatched: list[str] = []
        found: dict[tuple[Stack, tuple[str, ...]], dict[tuple[int, int], torch.Tensor]] = {}
        for k, v in state.items():
            stacked = self._stack_hit(k) if self.stacks else None
            if stacked is not None:
                stack, outer, part, expert = stacked
                found.setdefault((stack, outer), {})[(part, expert)] = v
                continue
            self._rename(k, v, False, out, unmatched)
        out.update(self._restack(found))
        return out, unmatched

    def kiln_name(self, hf_key: str) -> str | None:
        stacked = self._stack_hit(hf_key) if self.stacks else None
        if stacked is not None:
            kiln = stacked[0].kiln
            for g in stacked[1]:
                kiln = kiln.replace("{}", g, 1)
            return kiln
        hit = self._apply(hf_key, self._to_kiln, "kiln")
        return None if hit is None else hit[0]

    def stack_slot(self, hf_key: str) -> tuple[Stack, int, int] | None:
        """(its stack, part, expert) for an HF tensor that is one expert's part of a stacked kiln tensor."""
        hit = self._stack_hit(hf_key) if self.stacks else None
        return None if hit is None or hit[3] < 0 else (hit[0], hit[2], hit[3])

    def is_plain(self, hf_key: str) -> bool:
        """The HF tensor becomes a kiln tensor as it is: one rule, no tensor step, not part of a stack."""
        if self.stacks and self._stack_hit(hf_key) is not None:
            return False
        hit = self._apply(hf_key, self._to_kiln, "kiln")
        return hit is not None and hit[1].step is None

    def hf_name(self, kiln_key: str) -> str | None:
        for pat, stack in self._stack_kiln:
            m = pat.match(kiln_key)
            if m:  # for messages: the first part, every expert ("...experts.*.gate_proj.weight")
                name = stack.hf[0]
                for g in m.groups():
                    name = name.replace("{}", g, 1)
                return name.replace("{}", "*", 1)
        hit = self._apply(kiln_key, self._to_hf, "hf")
        return None if hit is None else hit[0]

    def prefixed(self, kiln_prefix: str, hf_prefix: str) -> KeyMap:
        """The same rules under module prefixes on both sides (e.g. `model.` and `bert.`)."""
        def join(p: str, s: str) -> str:
            return f"{p}.{s}" if p and s else (p or s)
        return KeyMap([Stack(join(kiln_prefix, s.kiln), tuple(join(hf_prefix, t) for t in s.hf), s.dim)
                       for s in self.stacks]
                      + [Rule(join(kiln_prefix, r.kiln), join(hf_prefix, r.hf), r.step) for r in self.rules])

    def __add__(self, other: KeyMap) -> KeyMap:
        return KeyMap([*self.stacks, *other.stacks, *self.rules, *other.rules])
