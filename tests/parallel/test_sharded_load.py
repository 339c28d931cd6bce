"""Build on meta, shard, then read (kiln.parallel.sharded_load): each rank's tensors equal a whole load then
the same plans, bit for bit, in the checkpoint's dtype; each rank holds about its share."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.errors import WeightsError
from kiln.models.auto import AutoConfig, from_config, load_pretrained
from kiln.parallel.sharded_load import empty_pretrained, read_shards
from tests.spawn import spawn

from tests.parallel import sharded_load_workers as sw

QWEN3 = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
MOE = dict(vocab_size=99, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_experts=4,
           num_experts_per_tok=2, norm_topk_prob=True)


def _save(path, family: str, size: dict, tie: bool = False):
    model = from_config(AutoConfig.for_model(family, tie_word_embeddings=tie, **size), task="causal-lm", seed=0)
    model.to(torch.bfloat16).save_pretrained(path, max_shard_bytes=8_000)  # several files and an index
    return path


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharded_load")
    return {"qwen3": _save(root / "qwen3", "qwen3", QWEN3), "moe": _save(root / "moe", "qwen3_moe", MOE),
            "tied": _save(root / "tied", "qwen3", QWEN3, tie=True)}


@pytest.mark.parametrize("name", ["qwen3", "moe", "tied"])
def test_one_process_read_equals_a_whole_load(dirs, name):
    whole = load_pretrained(dirs[name], task="causal-lm")
    lean = empty_pretrained(dirs[name], task="causal-lm")
    read_shards(lean, dirs[name])
    a, b = whole.state_dict(), lean.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype == torch.bfloat16 and torch.equal(a[k], b[k]), k
    ids = torch.randint(1, 99, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(whole(ids).logits, lean(ids).logits)


def test_a_shape_that_disagrees_with_the_config_is_named(dirs):
    lean = empty_pretrained(dirs["qwen3"], task="causal-lm", intermediate_size=40)
    with pytest.raises(WeightsError, match=r"mlp\.(gate|up|down)_proj\.weight.*shape .*expects"):
        read_shards(lean, dirs["qwen3"])


def test_an_index_naming_a_missing_file_is_named(dirs, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(dirs["qwen3"], broken)
    next(broken.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(WeightsError, match="names shard file\\(s\\) that are not in the directory: model-00002"):
        empty_pretrained(broken, task="causal-lm")


@pytest.mark.slow
@pytest.mark.parametrize("mode,name", [("fsdp", "qwen3"), ("tp", "qwen3"), ("fsdp-lora", "qwen3"), ("tp-fsdp", "qwen3"), ("ep", "moe"),
                                       ("ep-fsdp", "moe"), ("fsdp", "tied"), ("pp", "qwen3"),
                                       ("pp", "tied"), ("pp-fsdp", "qwen3")])
def test_each_rank_reads_what_a_whole_load_then_shard_gives(dirs, tmp_path, mode, name):
    world = 4 if mode in ("tp-fsdp", "ep-fsdp", "pp-fsdp") else 2
    spawn(sw.compare, world, (str(dirs[name]), mode, str(tmp_path)))
    for rank in range(world):
        r = json.loads((tmp_path / f"{mode}-rank{rank}.json").read_text())
        assert r["problems"] == [], (rank, r["problems"][:5])
        if mode in ("fsdp", "pp"):  # every tensor split over 2 ranks, or 2 stages: about half the model each
            assert r["bytes"] <= 0.6 * r["whole_bytes"], r
        if mode.startswith("fsdp"):  # a trained embedding shards; LoRA's frozen one stays whole (no root gather)
            assert r["embedding_sharded"] == (mode == "fsdp"), r


def test_a_model_built_on_meta_answers_the_packing_question(dirs):
    """SFT asks `packs_samples` before any weight is read: a meta-built model asks its family's tiny model."""
    lean = empty_pretrained(dirs["qwen3"], task="causal-lm")
    assert next(lean.parameters()).is_meta
    assert lean.packs_samples() == load_pretrained(dirs["qwen3"], task="causal-lm").packs_samples() is True
