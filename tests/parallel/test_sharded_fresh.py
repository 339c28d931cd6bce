"""A new head and an adapter beside the weights on a read shard by shard (kiln.models.loading.fresh), in one
process: the tensors, the load report and the generator state a whole load gives. The ranks' pieces under the plans:
tests/parallel/test_sharded_load.py (the FRESH and "adapter" cases of its spawn)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.errors import WeightsError
from kiln.hub.weights import tensor_spans
from kiln.interop.tiny import TINY, make_tiny
from kiln.models.auto import AutoConfig, from_config, load_whole
from kiln.parallel.sharded_load import init_adapters, lean_pretrained, load_to_device, read_shards
from tests.parallel import sharded_load_workers as sw

QWEN3 = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_fresh")
    out = {}
    for name, family, size, task in (("qwen3", "qwen3", QWEN3, "causal-lm"), ("qwen3-base", "qwen3", QWEN3, "base"),
                                     ("roberta-base", "roberta", TINY["roberta"], "base")):
        model = from_config(AutoConfig.for_model(family, tie_word_embeddings=False, **size), task=task, seed=0)
        model.to(torch.bfloat16).save_pretrained(root / name, max_shard_bytes=8_000)
        out[name] = root / name
    out["adapter"] = sw.with_adapter(root / "adapter", out["qwen3"])
    out["roberta-mlm"] = make_tiny("roberta", "masked-lm", root / "roberta-mlm")  # lm_head.dense vs classifier.dense
    out["modernbert-base"] = make_tiny("modernbert", "base", root / "modernbert-base")  # its own init of a new head
    return out


def _same(whole, lean) -> None:
    a, b = whole.state_dict(), lean.state_dict()
    assert a.keys() == b.keys() and lean.load_report == whole.load_report
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert [(n, p.requires_grad) for n, p in whole.named_parameters()] == \
        [(n, p.requires_grad) for n, p in lean.named_parameters()]


@pytest.mark.parametrize("name,task", [("qwen3-base", "causal-lm"), ("roberta-base", "token-classification"),
                                       ("roberta-mlm", "sequence-classification"), ("adapter", "causal-lm"),
                                       ("modernbert-base", "sequence-classification")])
def test_a_new_head_or_an_adapter_is_put_on_as_a_whole_load_puts_it(dirs, name, task):
    """A base checkpoint loaded with a head it lacks (a causal-LM's lm_head, a classifier), a masked-LM one as a
    classifier (its MLM head dropped), or a checkpoint with a PEFT adapter beside it (ModernBERT: its own init of
    the transform and classifier, children first, the read backbone untouched): read, not loaded whole; the
    same tensors, report and trainability as a whole load from the same seed, and the generator left where the whole
    load leaves it (LoRA's init draws next: the Trainer's init_adapters draws from there), for the read and for one
    process (`load_to_device`) alike."""
    changes = {"labels": ["a", "b"]} if task != "causal-lm" else {}
    whole = load_whole(dirs[name], task=task, seed=7, **changes)
    after = torch.get_rng_state()
    assert whole.load_report.initialized or name == "adapter"
    torch.manual_seed(99)  # what a load draws it draws from its seed, whatever happened before
    lean = lean_pretrained(dirs[name], task, 7, **changes)
    assert lean is not None and torch.equal(torch.get_rng_state(), after)
    torch.manual_seed(98)
    init_adapters(lean, "cpu", lean.deferred_read.seed)  # nothing left to draw: it puts the generator back
    assert torch.equal(torch.get_rng_state(), after)
    read_shards(lean, dirs[name])
    _same(whole, lean)
    torch.manual_seed(99)
    direct = load_to_device(dirs[name], "cpu", task=task, seed=7, **changes)
    assert torch.equal(torch.get_rng_state(), after)
    _same(whole, direct)


def test_a_tensor_the_checkpoint_owes_is_named_by_the_plan_as_by_the_whole_load(dirs, tmp_path):
    owing = tmp_path / "owing"
    shutil.copytree(dirs["qwen3"], owing)
    index = json.loads((owing / "model.safetensors.index.json").read_text())
    home = owing / index["weight_map"]["lm_head.weight"]  # a causal-LM checkpoint without its own head
    save_file({k: v for k, v in load_file(str(home)).items() if k != "lm_head.weight"}, str(home))
    assert "lm_head.weight" not in tensor_spans(home)
    with pytest.raises(WeightsError, match="missing tensor.*lm_head"):  # the plan runs the whole load's checks
        lean_pretrained(owing, "causal-lm", 0)
    with pytest.raises(WeightsError, match="missing tensor.*lm_head"):
        load_whole(owing, task="causal-lm")
