"""Training a release's multi-token-prediction module: the hook shared by the families whose MTP module is not an
MLA layer (Qwen3.5/3.6 text and image-text, DeepSeek-V4; DeepSeek-V3's lives in deepseek_v3.py).

The contract is DeepSeek-V3's: `enable_mtp(source, fresh)` makes the module live from the checkpoint's `mtp.*`
tensors (carried through untouched until then) or freshly initialised, and a training forward given labels or
targets leaves `mtp_loss_parts` = (cross entropy of the t+2 predictions summed over real targets, their count)
for the `[moe] mtp_weight` loss; `.loss` is unchanged. Live, the module is saved back under the release's names.

A family supplies, as data and small hooks:
- `mtp_names` (for messages) and `mtp_depth` (a pattern whose group 1 is an MTP layer's index);
- `mtp_carried()`: the checkpoint's MTP tensors held so far, under the names the key map reads;
- `new_mtp()`: the container to set as `self.mtp`, on the model's device in the dtypes it computes in,
  and `mtp_module`, the MTP module inside it;
- `mtp_released(found, tensors)`: forget the carried tensors once they are parameters;
- `mtp_states(out, next_ids, attention_mask, position_ids)`: the MTP module's normed states (B, T, C) from
  the main forward's output and Emb(t_{i+1})'s ids; optionally `mtp_before_forward()`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import nn

from kiln.errors import ConfigError, KilnError
from kiln.models.common.loss import shift_labels
from kiln.models.common.mtp import mtp_targets, next_inputs
from kiln.models.pretrained import check_tensors, init_module

if TYPE_CHECKING:  # mixed in before a causal LM (ForCausalLM); at run time a plain mixin (see TrainsMtp)
    from kiln.models.common.causal_lm import CausalLMOutput
    from kiln.models.common.causal_lm import ForCausalLM as _CausalLM
else:
    _CausalLM = object

@runtime_checkable
class _InitStd(Protocol):
    """A config that says the std a fresh module is drawn with."""
    initializer_range: float


MTP_HOOKS = ("mtp_module", "mtp_carried", "new_mtp", "mtp_released", "mtp_states")


class TrainsMtp(_CausalLM):
    """The shared MTP machinery; a family supplies the hooks in MTP_HOOKS (see the module docstring).

    Not an abc.ABC: FSDP2 swaps a module's class for a subclass it makes, and ABC's empty __slots__ makes that
    assignment fail ("object layout differs"). A model class missing a hook is refused when it is defined."""

    mtp_loss_parts: tuple[torch.Tensor, torch.Tensor] | None = None
    mtp_names: str = "mtp.*"
    mtp_depth: re.Pattern = re.compile(r"^mtp\.(\d+)\.")

    if TYPE_CHECKING:  # the hooks a family supplies (MTP_HOOKS): defined here they would pass __init_subclass__'s check
        @property
        def mtp_module(self) -> nn.Module | None: ...
        def mtp_carried(self) -> dict[str, torch.Tensor]: ...
        def new_mtp(self) -> nn.Module: ...
        def mtp_released(self, found: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor]) -> None: ...
        def mtp_states(self, out: CausalLMOutput, next_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       position_ids: torch.Tensor | None) -> torch.Tensor: ...

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        missing = [h for h in MTP_HOOKS if not hasattr(cls, h)]
        if issubclass(cls, nn.Module) and missing:
            raise TypeError(f"{cls.__name__} trains MTP but does not define {', '.join(missing)}")

    def mtp_before_forward(self) -> None:
        pass

    def enable_mtp(self, source: str = "the model", fresh: bool = False) -> nn.Module:
        """Make the depth-1 MTP module live from the checkpoint's tensors (or freshly initialised with `fresh`, a
        model built from scratch); they leave the carried tensors and are saved back as parameters."""
        if self.mtp_module is not None:
            return self.mtp_module
        found = self.mtp_carried()
        if not found and not fresh:
            raise ConfigError(f"{source}: the checkpoint has no multi-token-prediction tensors ({self.mtp_names}) "
                              "to train")
        if any((m := self.mtp_depth.match(k)) and int(m.group(1)) > 0 for k in found):
            raise ConfigError(f"{source}: the checkpoint's MTP module has more than one layer; kiln trains depth 1")
        container = self.new_mtp()
        if found:
            tensors, unmatched = self.family.keymap(self.task).to_kiln(found)
            tensors = {k.removeprefix("mtp."): v for k, v in tensors.items()}
            expected = container.state_dict()
            ignored, _ = check_tensors(expected, tensors, set(expected), source, "its MTP module", lambda k: "mtp." + k)
            if ignored or unmatched:
                raise ConfigError(f"{source}: MTP tensor(s) this {self.config.model_type} MTP module has no place "
                                  f"for: {', '.join(sorted('mtp.' + k for k in ignored) + sorted(unmatched))[:300]}")
            with torch.no_grad():  # copied into the dtypes the module computes in (V4 keeps some parts float32)
                for k, v in container.state_dict().items():
                    v.copy_(tensors[k])
            self.mtp_released(found, tensors)
        else:
            if not isinstance(self.config, _InitStd):
                raise ConfigError(f"{source}: the {self.config.model_type} config has no initializer_range to draw "
                                  "a fresh MTP module with")
            init_module(container, self.config.initializer_range)
        self.mtp = container
        module = self.mtp_module
        if module is None:
            raise KilnError(f"{type(self).__name__}: new_mtp's container holds no MTP module")
        return module

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, inputs_embeds=None, labels=None,
                cache=None, logits_to_keep: int = 0, output_router_logits: bool | None = None, targets=None, **more):
        self.mtp_before_forward()
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              inputs_embeds=inputs_embeds, labels=labels, cache=cache, logits_to_keep=logits_to_keep,
                              output_router_logits=output_router_logits, targets=targets, **more)
        self.mtp_after_forward(out, input_ids, labels, targets, attention_mask, position_ids)
        return out

    def mtp_after_forward(self, out, input_ids: torch.Tensor | None, labels: torch.Tensor | None,
                          targets: torch.Tensor | None, attention_mask: torch.Tensor | None,
                          position_ids: torch.Tensor | None) -> None:
        if self.mtp_module is None or not self.training or (labels is None and targets is None):
            return
        if input_ids is None:
            raise KilnError("the MTP loss embeds the next input token: pass input_ids, not inputs_embeds")
        if targets is None:
            if labels is None:  # (one of them is given: see above)
                return
            targets = shift_labels(labels).to(input_ids.device)
        states = self.mtp_states(out, next_inputs(input_ids), attention_mask, position_ids)
        self.mtp_loss_parts = self.head_loss_sum(states, mtp_targets(targets))
