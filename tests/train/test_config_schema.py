"""Each recipe owns its [data] keys: the core DataSection holds only the keys every recipe reads, the
registry assembles one run-config model per recipe, and a key of another recipe is refused naming the
key and the recipe it belongs to. The shipped example configs and `kiln init` templates still load."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from kiln.data.shards import MANIFEST
from kiln.errors import ConfigError
from kiln.parallel.config import ParallelSection
from kiln.train.config import DataSection, RunConfig, load_run_config, parse_run_config
from kiln.train.recipes import EXTENSIONS, RECIPES, recipe_for, run_config_model
from kiln.train.recipes.dpo import PreferenceData
from kiln.train.recipes.embedding import EmbeddingData
from kiln.train.recipes.finetune import FineTuneData
from kiln.train.recipes.grpo import PromptsData
from kiln.train.recipes.images import ImageData
from kiln.train.recipes.kto import UnpairedData
from kiln.train.recipes.pretrain import PretrainData
from kiln.train.recipes.reward_model import RewardData
from kiln.train.recipes.sft import SFTData

ROOT = Path(__file__).resolve().parents[2]


def _table(task: str, train: str, **data) -> dict:
    return {"model": {"family": "qwen3", "task": task}, "data": {"train": train, **data}, "train": {"steps": 1}}


@pytest.fixture
def shards(tmp_path) -> Path:
    d = tmp_path / "shards"
    d.mkdir()
    (d / MANIFEST).write_text("{}")  # what tells a pretrain run apart; its content is read at build time
    return d


def test_the_core_data_section_holds_only_the_common_keys():
    assert set(DataSection.model_fields) == {"train", "eval", "max_length"}
    assert {"pack", "train_on"} <= set(SFTData.model_fields) and "within_doc" not in SFTData.model_fields
    assert {"within_doc", "prefetch", "dtype", "val_fraction"} <= set(PretrainData.model_fields)
    assert "pack" not in PretrainData.model_fields and "pack" not in FineTuneData.model_fields
    assert {r.name: r.data_schema for r in RECIPES.values()} == {
        "pretrain": PretrainData, "sft": SFTData, "image-classification": ImageData,
        "sentence-embedding": EmbeddingData, "fine-tune": FineTuneData, "dpo": PreferenceData, "grpo": PromptsData,
        "reward-model": RewardData, "kto": UnpairedData, "distill": SFTData}


def test_each_recipe_validates_its_own_data_keys(tmp_path, shards):
    sft = parse_run_config(_table("causal-lm", "chat.jsonl", pack=False, train_on="all"))
    assert type(sft).recipe == "sft" and isinstance(sft.data, SFTData) and sft.data.pack is False
    assert recipe_for(sft) is RECIPES["sft"]
    ft = parse_run_config(_table("sequence-classification", "rows.jsonl", label_field="topic"))
    assert type(ft).recipe == "fine-tune" and ft.data.label_field == "topic"
    pre = parse_run_config(_table("causal-lm", str(shards), within_doc=True, prefetch=4))
    assert type(pre).recipe == "pretrain" and pre.data.within_doc and pre.data.prefetch == 4
    raw = tmp_path / "ids.npy"
    raw.write_bytes(b"")
    assert type(parse_run_config(_table("causal-lm", str(raw), val_fraction=0.1))).recipe == "pretrain"
    # the dump (checkpoints keep it, a resume compares it) carries the recipe's own keys
    assert sft.model_dump(mode="json")["data"]["train_on"] == "all"
    assert pre.model_dump(mode="json")["data"]["within_doc"] is True
    assert isinstance(pre.parallel, ParallelSection)


@pytest.mark.parametrize("task, where, key, owner, runs", [
    ("sequence-classification", "rows.jsonl", "pack", "sft", "fine-tune"),
    ("token-classification", "rows.jsonl", "train_on", "sft", "fine-tune"),
    ("causal-lm", "chat.jsonl", "within_doc", "pretrain", "sft"),
    ("causal-lm", "chat.jsonl", "val_fraction", "pretrain", "sft"),
    ("causal-lm", "SHARDS", "pack", "sft", "pretrain"),
    ("causal-lm", "SHARDS", "text_field", "fine-tune", "pretrain"),
])
def test_a_key_of_another_recipe_is_refused_naming_key_and_recipe(shards, task, where, key, owner, runs):
    table = _table(task, str(shards) if where == "SHARDS" else where, **{key: 1})
    with pytest.raises(ConfigError) as e:
        parse_run_config(table, "run.toml")
    msg = str(e.value)
    assert f"run.toml: unknown key 'data.{key}'" in msg
    assert f"runs the {runs} recipe" in msg and f"data.{key} belongs to the {owner} recipe" in msg


def test_a_key_no_recipe_has_is_plainly_unknown(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\nfamily = "bert"\n\n[data]\ntrain = "rows.jsonl"\npacking = true\n\n[train]\nsteps = 1\n')
    with pytest.raises(ConfigError) as e:
        load_run_config(toml)
    assert str(e.value) == f"{toml}:6: unknown key 'data.packing'"


def test_bad_values_of_recipe_keys_name_them(shards):
    with pytest.raises(ConfigError, match=r"data\.val_fraction must be a finite number >= 0 and < 1, got 1\.5"):
        parse_run_config(_table("causal-lm", str(shards), val_fraction=1.5))
    with pytest.raises(ConfigError, match="data.max_length must be >= 1, got 0"):
        parse_run_config(_table("causal-lm", "chat.jsonl", max_length=0))
    with pytest.raises(ConfigError, match="data.train_on"):
        parse_run_config(_table("causal-lm", "chat.jsonl", train_on="replies"))


def test_relative_data_paths_resolve_before_the_recipe_is_chosen(tmp_path, shards):
    """data.train relative to the TOML's folder decides the recipe (run from any working directory)."""
    toml = tmp_path / "run.toml"
    toml.write_text('[model]\nfamily = "qwen3"\ntask = "causal-lm"\n\n[data]\ntrain = "shards"\nwithin_doc = true\n\n'
                    '[train]\nsteps = 1\n')
    cfg = load_run_config(toml)
    assert type(cfg).recipe == "pretrain" and cfg.data.train == str(shards)


def test_one_model_per_recipe_with_every_extension_table():
    for name, recipe in RECIPES.items():
        model = run_config_model(name)
        assert issubclass(model, RunConfig) and model.recipe == name
        assert model.model_fields["data"].annotation is recipe.data_schema
        assert {"hpn", "grow", "ff", "moe"} <= set(model.model_fields)
    assert run_config_model("sft") is run_config_model("sft")  # built once


def test_the_core_config_imports_no_recipe():
    tree = ast.parse((ROOT / "kiln" / "train" / "config.py").read_text(encoding="utf-8"))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert imported and not any(m.startswith("kiln.train.recipes") for m in imported)


@pytest.mark.parametrize("path", sorted((ROOT / "examples").rglob("*.toml")), ids=lambda p: p.name)
def test_every_example_config_validates_for_its_recipe(path, tmp_path):
    """The examples' data is made by their run.py; stand-ins of the same kind (records, or a shard
    directory) let their configs be checked as they are written."""
    table = tomllib.loads(path.read_text(encoding="utf-8"))
    data = table["data"]
    for key in ("train", "eval"):
        if key in data:
            is_shards = data[key].rstrip("/").endswith("shards")
            stand_in = tmp_path / key / ("shards" if is_shards else Path(data[key]).name)
            if is_shards:
                stand_in.mkdir(parents=True, exist_ok=True)
                (stand_in / MANIFEST).write_text("{}")
            data[key] = str(stand_in)
    cfg = parse_run_config(table, str(path))
    wants = "pretrain" if data["train"].endswith("shards") else "sft" if cfg.model.task == "causal-lm" else "fine-tune"
    selected = [e.recipe for e in EXTENSIONS.values() if getattr(e, "recipe", None) and e.section in table]
    assert type(cfg).recipe == (selected[0] if selected else wants)  # a table that brings its recipe ([grpo]) wins
