"""Image captioning for vision-language models (LLaVA's stage 1 data): the prompt is BOS and an image's
placeholder tokens, the target the caption; the loss is on the caption's tokens (and its EOS) only.

Samples carry `pixel_values` (batch, images, channels, height, width) beside the token window; the
model replaces each sample's placeholders by its images' features (models/llava). The data: the
synthetic caption set of titanlike/data/image_captions.py (training.dataset default), or WebDataset
shards of caption pairs and conversations, blended by weight (training.dataset webdataset,
titanlike/data/image_text.py); a folder prepared with Megatron Energon is read by its metadata
(titanlike/data/energon.py). Generation prompts with images are built the same way by
titanlike/inference/processor.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from titanlike.data.loader import add_dataset_reader, find_dataset_kind, register_dataset_kind
from titanlike.models.common.image_tokens import image_index
from titanlike.objectives.base import (
    BatchContext,
    FieldShapes,
    Microbatch,
    Objective,
    cut_sequence,
    compile_options,
    refuse_pretraining_options,
    target_count,
)
from titanlike.objectives.registry import register_family_objective

if TYPE_CHECKING:
    from titanlike.config.schema import JobConfig
    from titanlike.models.args import BaseModelArgs, LayoutDegrees




class ImageCaption(Objective):
    name = "image_caption"
    generation = "text"

    def __init__(self, *, image_token_id: int, tokens_per_image: int, image_size: int, processor: str = "clip",
                 max_images: int = 1, max_image_pixels: int | None = None, **loss_options):
        """processor: the tower's image preprocessing, "clip" (shorter edge to image_size, center crop) or
        "siglip" (squashed to image_size x image_size), as transformers' processors of those towers."""
        from titanlike.data.images import ImageProcessor

        super().__init__(**loss_options)
        self.image_token_id = image_token_id
        self.tokens_per_image = tokens_per_image
        self.max_images, self.max_image_pixels = max_images, max_image_pixels
        makers = {"clip": ImageProcessor.clip, "siglip": ImageProcessor.siglip}
        if processor not in makers:
            raise ValueError(f"image processor {processor!r} is unknown; known: {', '.join(makers)}")
        self.processor: ImageProcessor = makers[processor](image_size)

    @classmethod
    def for_job(cls, cfg: JobConfig, args: BaseModelArgs, **options) -> ImageCaption:
        """options: what the family's ModelSpec.objective_options gives (image_token_id, tokens_per_image,
        image_size, processor, max_images, max_image_pixels)."""
        return cls(**options, **compile_options(cfg))

    def _validate_job(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str) -> None:
        refuse_pretraining_options(cfg, self.name)
        for option, section in (("training", cfg.training), ("validation", cfg.validation)):
            if section.dataset is not None and (option == "training" or cfg.validation.enable):
                self._check_dataset(section.dataset, section.dataset_path, option=option)
        t = cfg.training
        reader = _caption_reader(t.dataset)
        if cfg.validation.enable and cfg.validation.dataset is None and reader is not None and t.dataset_path:
            reader.check_held_out(t.dataset_path)
        # Every sample carries max_images images' placeholders, BOS, and at least one caption token and EOS.
        need = self.max_images * self.tokens_per_image + 3
        if cfg.training.seq_len < need:
            raise ValueError(f"training.seq_len {cfg.training.seq_len} cannot hold llava.max_images "
                             f"{self.max_images} x {self.tokens_per_image} image tokens and a caption; set it to "
                             f"at least {need}")

    def _check_held_out(self, dataset: str) -> None:
        # A kind that gives image captions holds some out (its reader's check_held_out checks the paths).
        if _caption_reader(dataset) is None:
            super()._check_held_out(dataset)

    def _check_dataset(self, dataset: str, dataset_path: str | None, *, option: str = "training") -> None:
        reader = _caption_reader(dataset)
        if reader is None:
            raise _no_images(self.name, dataset, option)
        reader.check(self, dataset, dataset_path, option=option)


    def sample_fields(self, seq_len: int) -> FieldShapes:
        height, width = self.processor.output_size()
        return {"inputs": ((seq_len,), "int64"), "labels": ((seq_len,), "int64"),
                "pixel_values": ((self.max_images, 3, height, width), "float32")}

    def samples(self, dataset: str, *, dataset_path, tokenizer, seq_len, seed, num_samples=None, split=None,
                split_name="train"):
        self._check_dataset(dataset, dataset_path)
        return _caption_reader(dataset).samples(self, dataset_path, tokenizer, seq_len=seq_len, seed=seed,
                                                split_name=split_name)

    def shard_blend(self, dataset_path: str, tokenizer, *, seq_len: int, seed: int, split_name: str = "train"):
        """The samples of WebDataset shards, one path or a blend 'weight path weight path ...'
        (data/image_text.py): a pure function of (dataset_path, seed) and the sample number. An Energon
        folder gives its split part of that name (train, or val for split_name valid)."""
        from titanlike.data.blend import parse_blend
        from titanlike.data.image_text import BlendedImageText, ImageTextSource

        from titanlike.data.energon import ENERGON_PARTS, is_metadataset, metadataset_blend

        paths, weights = parse_blend(dataset_path)
        parts = [split_name] * len(paths)
        if any(is_metadataset(path) for path in paths):
            if len(paths) > 1:
                raise ValueError(f"an Energon metadataset ({next(p for p in paths if is_metadataset(p))}) is a blend "
                                 "of its own: give it alone as the dataset path")
            paths, weights, parts = map(list, zip(*metadataset_blend(paths[0], ENERGON_PARTS.get(split_name,
                                                                                                  split_name))))
        sources = [ImageTextSource(path, tokenizer, seq_len=seq_len, image_token_id=self.image_token_id,
                                   tokens_per_image=self.tokens_per_image, processor=self.processor,
                                   max_images=self.max_images, max_image_pixels=self.max_image_pixels,
                                   split_name=part)
                   for path, part in zip(paths, parts)]
        return BlendedImageText(sources, weights or [len(s) for s in sources], seed=seed)

    def prepare(self, batch: dict[str, torch.Tensor], ctx: BatchContext) -> Microbatch:
        inputs, labels = batch["inputs"].to(ctx.device), batch["labels"].to(ctx.device)
        pixel_values = batch["pixel_values"].to(ctx.device)
        if ctx.cp_positions is None:
            return Microbatch(inputs, {"labels": labels}, target_count(labels), fields={"pixel_values": pixel_values})
        # Context parallel: each rank keeps its slice of the tokens and the image rows its placeholders
        # take (counted over the whole sequence first), and every rank encodes the sample's images whole.
        index = image_index(inputs, self.image_token_id)
        placeholders = (index >= 0).sum(1)
        torch._assert_async(((placeholders <= pixel_values.shape[1] * self.tokens_per_image)
                             & (placeholders % self.tokens_per_image == 0)).all(),
                            "the <image> placeholders do not match the images: each image takes "
                            f"{self.tokens_per_image} placeholders, in order")
        labels = cut_sequence(labels, ctx)
        return Microbatch(cut_sequence(inputs, ctx), {"labels": labels}, target_count(labels),
                          positions=ctx.cp_positions,
                          fields={"pixel_values": pixel_values, "image_index": cut_sequence(index, ctx)})


def _caption_reader(dataset: str | None):
    """The image-caption reader of a dataset kind (DatasetKind.readers), None where it gives none."""
    kind = find_dataset_kind(dataset)
    return kind.readers.get("image_captions") if kind is not None else None


def _no_images(objective: str, dataset: str, option: str) -> ValueError:
    return ValueError(f"{option}.dataset {dataset} holds no images; the {objective} objective reads "
                      "webdataset shards or the synthetic image-caption set (dataset default, no dataset_path)")


class SyntheticCaptionReader:
    """The default kind's image captions: the synthetic set of data/image_captions.py, one image a
    sample, which draws held-out images for validation."""

    def check(self, objective: ImageCaption, dataset: str, dataset_path: str | None, *, option: str) -> None:
        if objective.max_images > 1:
            raise ValueError(f"llava.max_images {objective.max_images} needs {option}.dataset webdataset: the "
                             "synthetic captions have one image each")
        if dataset_path:
            raise _no_images(objective.name, dataset, option)

    def check_held_out(self, dataset_path: str) -> None:
        pass

    def samples(self, objective: ImageCaption, dataset_path, tokenizer, *, seq_len, seed, split_name):
        from titanlike.data.image_captions import SyntheticCaptions
        from titanlike.data.loader import GlobalSamples

        source = SyntheticCaptions(tokenizer, seq_len=seq_len, seed=seed, image_token_id=objective.image_token_id,
                                   tokens_per_image=objective.tokens_per_image, processor=objective.processor,
                                   split=split_name)
        # Every index draws its own image: already in random order.
        return GlobalSamples(source, shuffle=False, fields=source.fields)


class ShardCaptionReader:
    """The webdataset kind's image captions: WebDataset shards or Energon folders, blended by weight
    (ImageCaption.shard_blend); only a folder energon prepare made holds out a split (its val part)."""

    def check(self, objective: ImageCaption, dataset: str, dataset_path: str | None, *, option: str) -> None:
        if not dataset_path:
            raise ValueError(f"{option}.dataset {dataset} needs {option}.dataset_path: a .tar shard, a folder of "
                             "them (or one energon prepare made), or a blend 'weight path weight path ...'")

    def check_held_out(self, dataset_path: str) -> None:
        from titanlike.data.blend import parse_blend
        from titanlike.data.energon import is_energon_dataset, is_metadataset

        plain = [path for path in parse_blend(dataset_path)[0]
                 if not (is_energon_dataset(path) or is_metadataset(path))]
        if plain:
            raise ValueError("validation needs validation.dataset and validation.dataset_path: the shards "
                             f"{plain[0]} hold out no split (a folder energon prepare made gives its val part)")

    def samples(self, objective: ImageCaption, dataset_path, tokenizer, *, seq_len, seed, split_name):
        from titanlike.data.loader import GlobalSamples

        blend = objective.shard_blend(dataset_path, tokenizer, seq_len=seq_len, seed=seed, split_name=split_name)
        return GlobalSamples(blend, shuffle=False, fields=objective.sample_fields(seq_len))


def _webdataset_source(*, dataset_path, tokenizer, seq_len, seed, num_samples=None, split=None, split_name="train"):
    # Only this objective reads image-text shards (ImageCaption.samples); any other asks the kind's source.
    from titanlike.data.errors import DataError

    raise DataError("webdataset shards hold image-text samples: train them with a vision-language model (model.name "
                    "llava)")


register_family_objective(ImageCaption.name, ImageCaption.for_job)

register_dataset_kind("webdataset", _webdataset_source, shuffle=False,
                      readers={"image_captions": ShardCaptionReader()})
add_dataset_reader("default", "image_captions", SyntheticCaptionReader())

__all__ = ["ImageCaption", "image_index"]
