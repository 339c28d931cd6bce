"""image-classification: a label per image, from an image folder (one sub-folder per class, its name the label)
or records (JSONL/CSV) of an image path (relative to the records file) and a label. Images are resized to the
model's square input and normalised (kiln.data.images.ImageClassifierProcessor); the label set comes from the
config, the source head or the data (sorted, numbers in numeric order)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.data import read_records
from kiln.data.hfdata import source_sha256
from kiln.data.images import ImageClassifierProcessor
from kiln.data.records import Record
from kiln.errors import ConfigError, KilnError
from kiln.hub.files import folder_files, why_unreadable
from kiln.models.tasks import IMAGE_CLASSIFICATION, get_task
from kiln.parallel.world import World
from kiln.train.config import DataSection, RunConfig
from kiln.train.recipes.base import RunParts, add_lora, build_model
from kiln.train.recipes.finetune import FineTune, RecordsData, label_set

SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff")


class ImageData(RecordsData):
    """[data] of an image-classification run."""
    image_field: str = "image"          # records: the image's path, relative to the records file
    label_field: str = "label"
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    max_image_pixels: int | None = None  # refuse source images larger than this (width x height)


def read_image_records(path: str, d: ImageData) -> list[Record]:
    """Records {image_field: absolute path, label_field: label} from a class-per-folder tree or a records file."""
    root = Path(path)
    if root.is_dir() and any(p.is_dir() or (p.is_symlink() and not p.exists() and not p.suffix)
                             for p in root.iterdir()):
        # one listing of the whole tree, so every class folder's unreadable images are named at once
        files = folder_files(root, lambda f: f.parent.parent == root and f.suffix.lower() in SUFFIXES,
                             recursive=True, what="image", empty_ok=False)
        rows = [Record({d.image_field: str(f), d.label_field: f.parent.name}, str(f)) for f in files]
        if not rows:
            raise KilnError(f"{root}: no images ({', '.join(SUFFIXES)}) in its class folders")
        return rows
    out, bad = [], []
    for r in read_records(path, d.format):
        image = r.get(d.image_field)
        if not isinstance(image, str):
            raise KilnError(f"{r.where}: {d.image_field!r} must be an image path, got {type(image).__name__}")
        why = why_unreadable(root.parent / image, empty_ok=False)
        if why is not None:
            bad.append(f"{r.where}: {root.parent / image} {why}")
        out.append(Record({**r.fields, d.image_field: str(root.parent / image)}, r.where))
    if bad:  # every image is checked before the first is encoded, and all that cannot be read are named
        raise KilnError(f"{len(bad)} image{'s' if len(bad) > 1 else ''} named in {path} cannot be read: "
                        + "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else ""))
    return out


def encode_images(records: list[Record], labels: list[str], processor: ImageClassifierProcessor,
                  d: ImageData) -> list[dict[str, torch.Tensor]]:
    label2id = {name: i for i, name in enumerate(labels)}
    out = []
    for r in records:
        label = str(r.get(d.label_field))
        if label not in label2id:
            raise KilnError(f"{r.where}: label {label!r} is not in the label set [{', '.join(label2id)}]")
        pixels = processor([r.get(d.image_field)], what=r.where)[0]
        out.append({"pixel_values": pixels, "labels": torch.tensor(label2id[label])})
    return out


class ImageClassificationRecipe(FineTune):
    name = "image-classification"
    summary = "an image classifier (ViT) on an image folder or records of image path + label"
    when = f"model.task = {IMAGE_CLASSIFICATION!r}"
    data_schema: type[DataSection] = ImageData

    def matches(self, task: str, data: Mapping[str, Any]) -> bool:
        return task == IMAGE_CLASSIFICATION

    def fingerprint(self, cfg: RunConfig, labels: list[str] | None) -> dict[str, Any]:
        d = cfg.data
        sha = source_sha256(d.train) if Path(d.train).is_file() else None
        return {"train": str(d.train), "train_sha256": sha, "labels": labels}

    def build(self, cfg: RunConfig, on_model: Callable[[nn.Module], None], world: World) -> RunParts:
        d = cfg.data
        assert isinstance(d, ImageData), f"{self.name} builds from its own [data] schema, got {type(d).__name__}"
        task = get_task(cfg.model.task, "model.task")
        train_records = read_image_records(d.train, d)
        eval_records = read_image_records(d.eval, d) if d.eval else None
        labels = label_set(cfg, task, train_records)
        model = build_model(cfg, labels, need_tokenizer=False)
        on_model(model)
        size = getattr(model.config, "image_size", None)
        if size is None:
            raise ConfigError(f"model.task = {IMAGE_CLASSIFICATION!r} needs an image model (config image_size); "
                              f"{getattr(model.config, 'model_type', None)!r} has none")
        add_lora(cfg, model)
        processor = ImageClassifierProcessor(size=size, image_mean=tuple(d.image_mean), image_std=tuple(d.image_std),
                                             max_input_pixels=d.max_image_pixels)
        assert labels is not None  # a label set: image classification reads one from the data
        train = encode_images(train_records, labels, processor, d)
        evals = encode_images(eval_records, labels, processor, d) if eval_records else None
        return RunParts(model, train, eval_data=evals, fingerprint=self.fingerprint(cfg, labels))


RECIPE = ImageClassificationRecipe()
