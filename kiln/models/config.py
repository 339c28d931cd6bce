"""The typed config base: a dataclass per family, read from and written back to config.json.

Fields carry HF's names so the mapping is one-to-one; keys a family does not model are kept in
`extra` and written back unchanged, so an export's config.json says everything the source said.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kiln.errors import ConfigError


@dataclass
class FamilyConfig:
    model_type: ClassVar[str] = ""
    # the attention's q_proj emits a sigmoid output gate per head beside the query (twice its rows); config.json does
    # not say so, the family does (kiln plan's shape check and activations read it)
    attn_output_gate: ClassVar[bool] = False
    # why kiln plan's activation formula (derived for attention + MLP blocks) does not hold for this family's blocks;
    # None where it does. kiln plan prints it beside its estimate
    plan_activations_caveat: ClassVar[str | None] = None

    architectures: list[str] | None = None
    id2label: dict[int, str] | None = None
    problem_type: str | None = None
    tie_word_embeddings: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    # ---- labels ---------------------------------------------------------------------------
    @property
    def num_labels(self) -> int:
        return len(self.id2label) if self.id2label else 2

    @property
    def labels(self) -> list[str]:
        return [self.id2label[i] for i in sorted(self.id2label)] if self.id2label else ["LABEL_0", "LABEL_1"]

    def set_labels(self, labels: list[str] | int) -> None:
        if isinstance(labels, int):
            labels = [f"LABEL_{i}" for i in range(labels)]
        self.id2label = {i: str(name) for i, name in enumerate(labels)}

    # ---- dict round trip ------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config.json") -> "FamilyConfig":
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        kwargs: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in data.items():
            if key in names:
                kwargs[key] = value
            elif key not in ("model_type", "label2id", "num_labels"):
                extra[key] = value
        if kwargs.get("id2label") is not None:
            try:
                kwargs["id2label"] = {int(k): v for k, v in kwargs["id2label"].items()}
            except (ValueError, AttributeError):
                raise ConfigError(f"{source}: id2label must map integer ids to names") from None
        elif "num_labels" in data:
            kwargs["id2label"] = {i: f"LABEL_{i}" for i in range(int(data["num_labels"]))}
        for f in dataclasses.fields(cls):
            if f.name in kwargs and f.type in ("int", int) and not isinstance(kwargs[f.name], int):
                raise ConfigError(f"{source}: {f.name} must be an integer, got {kwargs[f.name]!r}")
        try:
            cfg = cls(**kwargs, extra=extra)
        except TypeError as e:
            raise ConfigError(f"{source}: {e}") from None
        cfg.validate(source)
        return cfg

    def validate(self, source: str = "config.json") -> None:
        """Family-specific checks; raise ConfigError naming the key."""

    def to_dict(self) -> dict[str, Any]:
        out = dict(self.extra)
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if f.name == "id2label":
                if value is None:
                    continue
                out["id2label"] = {str(k): v for k, v in sorted(value.items())}
                out["label2id"] = {v: k for k, v in sorted(value.items())}
                continue
            if value is None and f.name in ("architectures", "problem_type") and f.name not in self.extra:
                continue
            out[f.name] = value
        out["model_type"] = self.model_type
        return out

    def replace(self, **changes: Any) -> "FamilyConfig":
        return dataclasses.replace(self, **changes)
