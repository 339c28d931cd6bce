"""FSDP2 turns each module it shards into an instance of a class it makes on the fly, (FSDPModule, cls), by
assigning `__class__`; CPython refuses that when the two layouts differ (an abc.ABC base's empty __slots__ did
so for the MTP families and failed every multi-process run of them). Checked for every kiln module class, cheaply:
no model is built and no process group is needed."""

import importlib
import pkgutil

import pytest
from torch import nn
from torch.distributed.fsdp import FSDPModule

import kiln.models


def _module_classes() -> list[type[nn.Module]]:
    for info in pkgutil.walk_packages(kiln.models.__path__, "kiln.models."):
        importlib.import_module(info.name)
    seen, todo = {}, [nn.Module]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub.__module__.startswith("kiln.") and sub not in seen.values():
                seen[f"{sub.__module__}.{sub.__qualname__}"] = sub
            todo.append(sub)
    return [seen[k] for k in sorted(seen)]


CLASSES = _module_classes()


def test_the_walk_finds_the_families():
    names = {c.__name__ for c in CLASSES}
    assert {"V4ForCausalLM", "ImageTextForCausalLM", "TextForCausalLM"} <= names
    assert len(CLASSES) > 50


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: f"{c.__module__.rsplit('.', 1)[-1]}.{c.__qualname__}")
def test_fsdp_can_take_over_the_class(cls):
    made = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    obj = cls.__new__(cls)
    object.__setattr__(obj, "__class__", made)
    assert isinstance(obj, FSDPModule)


def test_an_mtp_model_missing_a_hook_is_refused_when_defined():
    from kiln.models.mtp import TrainsMtp

    with pytest.raises(TypeError, match="Broken trains MTP but does not define .*mtp_states"):
        type("Broken", (TrainsMtp, nn.Module), {"mtp_module": None, "mtp_carried": None, "new_mtp": None,
                                                 "mtp_released": None})
