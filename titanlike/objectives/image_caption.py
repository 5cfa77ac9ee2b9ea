"""Image captioning for vision-language models (LLaVA's stage 1 data): the prompt is BOS and an image's
placeholder tokens, the target the caption; the loss is on the caption's tokens (and its EOS) only.

Samples carry `pixel_values` (batch, images, channels, height, width) beside the token window; the
model replaces each sample's placeholders by its images' features (models/llava). The data: the
synthetic caption set of titanlike/data/image_captions.py (training.dataset default), or WebDataset
shards of caption pairs and conversations, blended by weight (training.dataset webdataset,
titanlike/data/image_text.py). prompt() builds a generation prompt with images the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from titanlike.objectives.base import BatchContext, FieldShapes, Microbatch, Objective, refuse_pretraining_options

if TYPE_CHECKING:
    from titanlike.config.schema import JobConfig
    from titanlike.models.args import LayoutDegrees


# Where a prompt's text puts an image (LLaVA's convention).
IMAGE_MARK = "<image>"


class ImageCaption(Objective):
    name = "image_caption"
    predicts_next_token = True

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

    def validate(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str) -> None:
        refuse_pretraining_options(cfg, self.name)
        for option, section in (("training", cfg.training), ("validation", cfg.validation)):
            if section.dataset is not None and (option == "training" or cfg.validation.enable):
                self.validate_dataset(section.dataset, section.dataset_path, option=option)
        # Every sample carries max_images images' placeholders, BOS, and at least one caption token and EOS.
        need = self.max_images * self.tokens_per_image + 3
        if cfg.training.seq_len < need:
            raise ValueError(f"training.seq_len {cfg.training.seq_len} cannot hold llava.max_images "
                             f"{self.max_images} x {self.tokens_per_image} image tokens and a caption; set it to "
                             f"at least {need}")

    def validate_dataset(self, dataset: str, dataset_path: str | None, *, option: str = "training") -> None:
        if dataset == "webdataset":
            if not dataset_path:
                raise ValueError(f"{option}.dataset webdataset needs {option}.dataset_path: a .tar shard, a folder of "
                                 "them, or a blend 'weight path weight path ...'")
            return
        if self.max_images > 1 and dataset == "default":
            raise ValueError(f"llava.max_images {self.max_images} needs {option}.dataset webdataset: the synthetic "
                             "captions have one image each")
        if dataset != "default" or dataset_path:
            raise ValueError(f"{option}.dataset {dataset} holds no images; the {self.name} objective reads "
                             "webdataset shards or the synthetic image-caption set (dataset default, no dataset_path)")

    def sample_fields(self, seq_len: int) -> FieldShapes:
        height, width = self.processor.output_size()
        return {"inputs": ((seq_len,), "int64"), "labels": ((seq_len,), "int64"),
                "pixel_values": ((self.max_images, 3, height, width), "float32")}

    def samples(self, dataset: str, *, dataset_path, tokenizer, seq_len, seed, num_samples=None, split=None,
                split_name="train"):
        from titanlike.data.image_captions import SyntheticCaptions
        from titanlike.data.loader import GlobalSamples

        self.validate_dataset(dataset, dataset_path)
        if dataset == "webdataset":
            return GlobalSamples(self.shard_blend(dataset_path, tokenizer, seq_len=seq_len, seed=seed),
                                 shuffle=False, fields=self.sample_fields(seq_len))
        source = SyntheticCaptions(tokenizer, seq_len=seq_len, seed=seed, image_token_id=self.image_token_id,
                                   tokens_per_image=self.tokens_per_image, processor=self.processor, split=split_name)
        # Every index draws its own image: already in random order.
        return GlobalSamples(source, shuffle=False, fields=source.fields)

    def shard_blend(self, dataset_path: str, tokenizer, *, seq_len: int, seed: int):
        """The samples of WebDataset shards, one path or a blend 'weight path weight path ...'
        (data/image_text.py): a pure function of (dataset_path, seed) and the sample number."""
        from titanlike.data.blend import parse_blend
        from titanlike.data.image_text import BlendedImageText, ImageTextSource

        paths, weights = parse_blend(dataset_path)
        sources = [ImageTextSource(path, tokenizer, seq_len=seq_len, image_token_id=self.image_token_id,
                                   tokens_per_image=self.tokens_per_image, processor=self.processor,
                                   max_images=self.max_images, max_image_pixels=self.max_image_pixels)
                   for path in paths]
        return BlendedImageText(sources, weights or [len(s) for s in sources], seed=seed)

    def prompt(self, tokenizer, text: str, images=()) -> tuple[list[int], dict[str, torch.Tensor]]:
        """BOS, then the text with each `<image>` mark replaced by an image's placeholders (a text
        without marks: the images first, as the caption samples put them); pixel_values (1, images,
        C, H, W) for the prefill. ValueError, one sentence, when marks and images do not pair up."""
        pieces = text.split(IMAGE_MARK)
        marks = len(pieces) - 1
        if marks and marks != len(images):
            raise ValueError(f"the prompt has {marks} {IMAGE_MARK} mark(s) but {len(images)} image(s) were given")
        if not marks and images:
            pieces = [""] * len(images) + [text]
        ids = [tokenizer.bos_id]
        for i, piece in enumerate(pieces):
            if i:
                ids += [self.image_token_id] * self.tokens_per_image
            if piece:
                ids += tokenizer.encode(piece, bos=False, eos=False)
        if not images:
            return ids, {}
        return ids, {"pixel_values": torch.stack([self.processor(image) for image in images])[None]}

    def prepare(self, batch: dict[str, torch.Tensor], ctx: BatchContext) -> Microbatch:
        return Microbatch(batch["inputs"].to(ctx.device), batch["labels"].to(ctx.device),
                          fields={"pixel_values": batch["pixel_values"].to(ctx.device)})


__all__ = ["ImageCaption"]
