"""The typed config base: a dataclass per family, read from and written back to config.json.

Fields carry HF's names so the mapping is one-to-one; keys a family does not model are kept in
`extra` and written back unchanged, so an export's config.json says everything the source said.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, Self, cast

from kiln.errors import ConfigError

# Sizes a model is built from, by transformers' names, checked for every family whose config has them before
# anything is built: a zero or negative one fails deep inside (a modulo by zero, a tensor of negative size, a
# reshape of 0 elements at the first forward) with an error that names no key.
WHOLE_SIZES = ("vocab_size", "hidden_size", "moe_intermediate_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
               "n_routed_experts", "num_experts_per_tok", "kv_lora_rank", "q_lora_rank", "v_head_dim",
               "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
               "linear_conv_kernel_dim", "embedding_size", "patch_size", "image_size", "num_channels", "state_size",
               "conv_kernel", "expand")
# ... and counts where 0 means "none" (num_experts 0: a dense MLP in the families that allow it)
COUNTS = ("type_vocab_size", "first_k_dense_replace", "num_experts", "n_shared_experts", "qk_rope_head_dim",
          "qk_nope_head_dim")
# the expert count that bounds num_experts_per_tok, under the names families give it
EXPERT_COUNTS = ("num_experts", "n_routed_experts")


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
    def from_dict(cls, data: dict[str, Any], source: str = "config.json") -> Self:
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
        cfg.check_whole_sizes(source)
        cfg.validate(source)
        return cfg

    def check_whole_sizes(self, source: str = "config.json") -> None:
        """Each size of WHOLE_SIZES this config has a whole number >= 1 (None: not set), each of COUNTS >= 0, and
        the experts a token is routed to within the experts there are; a ConfigError naming the key."""
        fields = {f.name for f in dataclasses.fields(self)}
        for names, low in ((WHOLE_SIZES, 1), (COUNTS, 0)):
            for name in names:
                value = getattr(self, name) if name in fields else None
                if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                    raise ConfigError(f"{source}: {name} must be an integer >= {low}, got {value!r}")
        k = getattr(self, "num_experts_per_tok", None) if "num_experts_per_tok" in fields else None
        for name in EXPERT_COUNTS:
            n = getattr(self, name) if name in fields else None
            if k is not None and n and k > n:
                raise ConfigError(f"{source}: num_experts_per_tok ({k}) must be within 1..{name} ({n}): a token "
                                  f"cannot be routed to more experts than there are")

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

    def replace(self, **changes: Any) -> FamilyConfig:
        return dataclasses.replace(self, **changes)

    def dequantized(self, dtype: Any = None) -> None:
        """The config of a model whose quantized base was dequantized (to `dtype`, a torch dtype): no
        quantization_config, and the dtype keys transformers' "auto" dtype reads say `dtype` where present."""
        self.extra.pop("quantization_config", None)
        for key in ("dtype", "torch_dtype"):
            if dtype is not None and key in self.extra:
                self.extra[key] = str(dtype).removeprefix("torch.")


class TextSizes(Protocol):
    """The sizes every model that reads tokens has in its config (decoders, hybrids, encoders, Mamba): what code
    outside a family reads of it (GGUF export, poolings, heads over the vocabulary)."""
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int


def text_sizes(config: FamilyConfig) -> TextSizes:
    """`config` as `TextSizes`, checked: a ConfigError naming the size a config lacks."""
    for size in ("vocab_size", "hidden_size", "num_hidden_layers"):
        if not isinstance(getattr(config, size, None), int):
            raise ConfigError(f"{config.model_type}: the config has no {size}, which this reads")
    return cast(TextSizes, config)  # each size checked just above
