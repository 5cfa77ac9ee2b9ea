"""Image captioning for vision-language models (LLaVA's stage 1 data): the prompt is BOS and an image's
placeholder tokens, the target the caption; the loss is on the caption's tokens (and its EOS) only.

Samples carry `pixel_values` (batch, images, channels, height, width) beside the token window; the
model replaces each sample's placeholders by its images' features (models/llava). The data so far is
the synthetic caption set of titanlike/data/image_captions.py (training.dataset default); image-text
shards (WebDataset, Energon) are issue 31's next step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from titanlike.objectives.base import BatchContext, FieldShapes, Microbatch, Objective, refuse_pretraining_options

if TYPE_CHECKING:
    from titanlike.config.schema import JobConfig
    from titanlike.models.args import LayoutDegrees


class ImageCaption(Objective):
    name = "image_caption"
    predicts_next_token = True

    def __init__(self, *, image_token_id: int, tokens_per_image: int, image_size: int, processor: str = "clip",
                 **loss_options):
        """processor: the tower's image preprocessing, "clip" (shorter edge to image_size, center crop) or
        "siglip" (squashed to image_size x image_size), as transformers' processors of those towers."""
        from titanlike.data.images import ImageProcessor

        super().__init__(**loss_options)
        self.image_token_id = image_token_id
        self.tokens_per_image = tokens_per_image
        makers = {"clip": ImageProcessor.clip, "siglip": ImageProcessor.siglip}
        if processor not in makers:
            raise ValueError(f"image processor {processor!r} is unknown; known: {', '.join(makers)}")
        self.processor: ImageProcessor = makers[processor](image_size)

    def validate(self, cfg: JobConfig, dims: LayoutDegrees, *, model: str) -> None:
        refuse_pretraining_options(cfg, self.name)
        for option, section in (("training", cfg.training), ("validation", cfg.validation)):
            dataset = section.dataset
            if dataset is not None and dataset != "default" and (option == "training" or cfg.validation.enable):
                raise ValueError(f"{option}.dataset {dataset} holds no images; the {self.name} objective reads the "
                                 "synthetic image-caption set (dataset default) so far")
        if cfg.training.seq_len < self.tokens_per_image + 3:
            raise ValueError(f"training.seq_len {cfg.training.seq_len} cannot hold an image's {self.tokens_per_image} "
                             f"tokens and a caption; set it to at least {self.tokens_per_image + 3}")

    def validate_dataset(self, dataset: str, dataset_path: str | None, *, option: str = "training") -> None:
        if dataset != "default" or dataset_path:
            raise ValueError(f"{option}.dataset {dataset} holds no images; the {self.name} objective reads the "
                             "synthetic image-caption set (dataset default, no dataset_path) so far")

    def sample_fields(self, seq_len: int) -> FieldShapes:
        height, width = self.processor.output_size()
        return {"inputs": ((seq_len,), "int64"), "labels": ((seq_len,), "int64"),
                "pixel_values": ((1, 3, height, width), "float32")}

    def samples(self, dataset: str, *, dataset_path, tokenizer, seq_len, seed, num_samples=None, split=None,
                split_name="train"):
        from titanlike.data.image_captions import SyntheticCaptions
        from titanlike.data.loader import GlobalSamples

        self.validate_dataset(dataset, dataset_path)
        source = SyntheticCaptions(tokenizer, seq_len=seq_len, seed=seed, image_token_id=self.image_token_id,
                                   tokens_per_image=self.tokens_per_image, processor=self.processor, split=split_name)
        # Every index draws its own image: already in random order.
        return GlobalSamples(source, shuffle=False, fields=source.fields)

    def prepare(self, batch: dict[str, torch.Tensor], ctx: BatchContext) -> Microbatch:
        return Microbatch(batch["inputs"].to(ctx.device), batch["labels"].to(ctx.device),
                          fields={"pixel_values": batch["pixel_values"].to(ctx.device)})


__all__ = ["ImageCaption"]
