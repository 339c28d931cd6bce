"""The recipe shortcut flags of `kiln train` (`--d-model 64` = `--set model.config.hidden_size=64`),
declared here so that `kiln train --help` builds its options without importing the recipes (they
import torch, ~3 s).

The recipes' own `shortcuts` (kiln.train.recipes) stay the source of truth: `kiln train` maps the
flag values through them at run time, and tests/cli/test_help_light.py fails when this table and
`kiln.train.recipes.shortcuts()` differ in any flag, key, multiplicity or order.
"""

from __future__ import annotations

from typing import NamedTuple


class Flag(NamedTuple):
    """One shortcut, with the attribute names of kiln.train.recipes.Shortcut."""
    flag: str                # python name; the option is --flag-with-dashes
    key: str                 # dotted run-config key it sets
    multiple: bool = False   # repeatable, collected into a list


# In kiln.train.recipes.shortcuts() order: the recipes (pretrain, sft, fine-tune), then the extensions.
_FLAGS = (
    Flag("d_model", "model.config.hidden_size"),  # pretrain
    Flag("d_state", "model.config.state_size"),
    Flag("d_conv", "model.config.conv_kernel"),
    Flag("expand", "model.config.expand"),
    Flag("layers", "model.config.num_hidden_layers"),
    Flag("scale", "hpn.scale"),  # [hpn]
    Flag("prototype_mode", "hpn.mode"),
    Flag("proto_dim", "hpn.proto_dim"),
    Flag("objectives", "hpn.objectives"),
    Flag("placement", "grow.placement"),  # [grow]
    Flag("target_layers", "grow.target_layers"),
    Flag("grow_at", "grow.at_step"),
    Flag("freeze", "grow.freeze", multiple=True),
    Flag("freeze_after", "grow.freeze_after", multiple=True),
    Flag("ff_lr", "ff.ff_lr"),  # [ff]
    Flag("bp_cadence_steps", "ff.bp_cadence_steps"),
    Flag("gradient_surgery_method", "ff.surgery"),
    Flag("balance", "moe.balance"),  # [moe]
    Flag("mtp_weight", "moe.mtp_weight"),
    Flag("indexer", "moe.indexer"),
)


def shortcuts() -> list[Flag]:
    """The `kiln train` shortcut options, in help order."""
    return list(_FLAGS)
