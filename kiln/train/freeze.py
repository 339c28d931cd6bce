"""Freezing parameters: one small language for `train.freeze` and `grow.freeze` / `grow.freeze_after`.

A spec is one of
- a layer policy over the model's one layer stack (the `nn.ModuleList` named `layers`):
  `first:N`, `last:N`, `layers:i,j,...` (also spelled `indices:i,j,...`, the seed research trainer's word);
- `embeddings`: every `nn.Embedding` of the model;
- a parameter name prefix (`model.embeddings`) or glob (`model.layers.0.*`), which must match
  at least one parameter.
Parameter names never hold a colon, so `kind:args` is always a policy; the bare word `embeddings`
is the policy, not a prefix.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Sequence

from torch import nn

from kiln.errors import ConfigError

_POLICY = re.compile(r"(first|last|layers|indices):(.*)")
USAGE = "first:N, last:N, layers:i,j,..., embeddings, or a parameter name prefix or glob"


def spec_error(spec: str) -> str | None:
    """Why `spec` cannot be a freeze spec whatever the model (None when its form is fine): a check
    for config loading, before any model exists."""
    if ":" not in spec:
        return None
    if re.fullmatch(r"(first|last):\d+|(layers|indices):\d+(,\d+)*", spec):
        return None
    return f"{spec!r} is not a freeze spec; use {USAGE}"


def find_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(qualified name, the ModuleList) of the model's one layer stack named `layers`."""
    found = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and n.split(".")[-1] == "layers"]
    if len(found) != 1:
        raise ConfigError(f"layer growth/freezing needs exactly one ModuleList named 'layers' in "
                          f"{type(model).__name__}; found {[n for n, _ in found] or 'none'}")
    return found[0]


def _name_hit(name: str, pattern: str) -> bool:
    return name == pattern or name.startswith(pattern.rstrip(".") + ".") or fnmatch.fnmatchcase(name, pattern)


def _policy_layers(model: nn.Module, spec: str, key: str) -> list[nn.Module]:
    """`first:N` / `last:N` / `layers:i,j` (`indices:i,j`) -> the layers it picks from the model's stack."""
    match = _POLICY.fullmatch(spec)
    assert match is not None, spec  # only a spec _POLICY matched comes here
    kind, arg = match.groups()
    _, stack = find_layers(model)
    n = len(stack)
    try:
        values = [int(v) for v in arg.split(",")]
    except ValueError:
        values = []
    if kind in ("first", "last") and len(values) == 1 and 0 <= values[0] <= n:
        picked: Sequence[int] = range(values[0]) if kind == "first" else range(n - values[0], n)
    elif kind in ("layers", "indices") and values and all(0 <= v < n for v in values):
        picked = values
    else:
        raise ConfigError(f"{key}: freeze policy {spec!r} is not valid for {n} layers: use first:N, last:N "
                          f"(N <= {n}) or layers:i,j,... (indices below {n})")
    return [stack[i] for i in picked]


def freeze(model: nn.Module, specs: list[str], key: str = "train.freeze") -> list[str]:
    """requires_grad=False for every parameter a spec names; returns their names in model order.

    `key` is the setting the specs came from, for messages.
    """
    names = [n for n, _ in model.named_parameters()]
    modules: list[nn.Module] = []  # picked by a policy: every parameter inside is frozen
    patterns: list[str] = []
    for spec in specs:
        if _POLICY.fullmatch(spec):
            modules += _policy_layers(model, spec, key)
        elif spec == "embeddings":
            modules += [m for m in model.modules() if isinstance(m, nn.Embedding)]
        elif ":" in spec:
            raise ConfigError(f"{key}: {spec!r} is not a freeze spec; use {USAGE}")
        else:
            patterns.append(spec)
    unmatched = [p for p in patterns if not any(_name_hit(n, p) for n in names)]
    if unmatched:
        raise ConfigError(f"{key}: {unmatched} match no parameter name (names look like {names[0] if names else None!r})")
    picked = {id(p) for m in modules for p in m.parameters()}
    frozen = []
    for name, p in model.named_parameters():
        if id(p) in picked or any(_name_hit(name, pat) for pat in patterns):
            p.requires_grad_(False)
            frozen.append(name)
    return frozen
