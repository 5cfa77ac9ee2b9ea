"""Image preprocessing for vision towers, equal to transformers' CLIPImageProcessor and
SiglipImageProcessor (their PIL backend) on PIL images, written with PIL and torch (no torchvision).

The steps, in transformers' order:
  1. RGB: an image with alpha (or a palette transparency) is composited onto white, any other mode
     converted to RGB;
  2. resize with PIL's bicubic filter, on 8-bit pixels: CLIP scales the shorter edge to `size` (the
     longer one to int(size * long / short)), SigLIP squashes to size x size, aspect ratio not kept;
  3. center crop (CLIP) to crop x crop, the top-left corner at ((H - crop) // 2, (W - crop) // 2);
     an image smaller than the crop is padded with zeros around it first (as transformers does);
  4. rescale by 1/255 (in float64, then float32) and normalize per channel, (x - mean) / std, in float32.

The policy for images of any size is therefore the tower's processor's: CLIP keeps the aspect ratio
and loses the borders of the longer side, SigLIP keeps everything and distorts it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch

# transformers' image_utils: OPENAI_CLIP_MEAN / STD and IMAGENET_STANDARD_MEAN / STD.
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
STANDARD_MEAN = (0.5, 0.5, 0.5)
STANDARD_STD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class ImageProcessor:
    """shortest_edge: resize the shorter edge to it (aspect kept), else resize to (height, width);
    crop: (height, width) of the center crop, None for none."""

    height: int | None = None
    width: int | None = None
    shortest_edge: int | None = None
    crop: tuple[int, int] | None = None
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD
    rescale_factor: float = 1 / 255

    def __post_init__(self) -> None:
        if (self.shortest_edge is None) == (self.height is None or self.width is None):
            raise ValueError("an image processor resizes to shortest_edge or to height and width, one of the two")

    @classmethod
    def clip(cls, size: int = 224, crop: int | None = None) -> ImageProcessor:
        """CLIPImageProcessor's defaults (LLaVA-1.5's is clip(336))."""
        crop = size if crop is None else crop
        return cls(shortest_edge=size, crop=(crop, crop), mean=CLIP_MEAN, std=CLIP_STD)

    @classmethod
    def siglip(cls, size: int = 224) -> ImageProcessor:
        """SiglipImageProcessor's defaults."""
        return cls(height=size, width=size, mean=STANDARD_MEAN, std=STANDARD_STD)

    @classmethod
    def of_tower(cls, kind: str, size: int) -> ImageProcessor:
        """The processor of a vision tower of that kind ("clip" or "siglip") at that image size;
        ValueError, one sentence, for another kind."""
        makers = {"clip": cls.clip, "siglip": cls.siglip}
        if kind not in makers:
            raise ValueError(f"image processor {kind!r} is unknown; known: {', '.join(makers)}")
        return makers[kind](size)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ImageProcessor:
        """From a preprocessor_config.json of CLIPImageProcessor or SiglipImageProcessor (ValueError,
        one sentence, for settings we do not reproduce)."""
        kind = config.get("image_processor_type", "")
        for key, want in (("do_resize", True), ("do_rescale", True), ("do_normalize", True), ("resample", 3)):
            if config.get(key, want) != want:
                raise ValueError(f"image processor {kind or '?'}: {key} {config[key]!r} is not supported "
                                 f"(only {want!r})")
        size = config.get("size", {})
        crop = config.get("crop_size") if config.get("do_center_crop", False) else None
        return cls(height=size.get("height"), width=size.get("width"), shortest_edge=size.get("shortest_edge"),
                   crop=None if crop is None else (crop["height"], crop["width"]),
                   mean=tuple(config.get("image_mean", CLIP_MEAN)), std=tuple(config.get("image_std", CLIP_STD)),
                   rescale_factor=config.get("rescale_factor", 1 / 255))

    def hf_config(self, kind: str) -> dict[str, Any]:
        """preprocessor_config.json of transformers' image processor of a tower of that kind ("clip" or
        "siglip") as this one processes: what from_config reads back, and what AutoProcessor loads from an
        export of a vision-language model."""
        config = {"image_processor_type": {"clip": "CLIPImageProcessor", "siglip": "SiglipImageProcessor"}[kind],
                  "do_convert_rgb": True, "do_resize": True, "resample": 3, "do_rescale": True,
                  "rescale_factor": self.rescale_factor, "do_normalize": True, "image_mean": list(self.mean),
                  "image_std": list(self.std), "do_center_crop": self.crop is not None,
                  "size": ({"shortest_edge": self.shortest_edge} if self.shortest_edge is not None
                           else {"height": self.height, "width": self.width})}
        if self.crop is not None:
            config["crop_size"] = {"height": self.crop[0], "width": self.crop[1]}
        return config

    def output_size(self) -> tuple[int, int] | None:
        """(height, width) of every processed image, None when it depends on the image (no crop, shortest edge)."""
        if self.crop is not None:
            return self.crop
        return None if self.shortest_edge is not None else (self.height, self.width)

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        if self.shortest_edge is None:
            return self.height, self.width
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def __call__(self, image) -> torch.Tensor:
        """A PIL image -> (3, height, width) float32 pixel values."""
        from PIL import Image

        image = to_rgb(image)
        height, width = self.resized_size(image.height, image.width)
        image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(height, width, 3)
        pixels = pixels.permute(2, 0, 1)
        if self.crop is not None:
            pixels = center_crop(pixels, *self.crop)
        x = (pixels.double() * self.rescale_factor).float()
        mean = torch.tensor(self.mean, dtype=torch.float32)[:, None, None]
        std = torch.tensor(self.std, dtype=torch.float32)[:, None, None]
        return (x - mean) / std


def to_rgb(image):
    """An RGB PIL image; alpha composited onto white, as transformers' convert_to_rgb."""
    from PIL import Image

    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def center_crop(pixels: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(C, H, W) -> (C, height, width) around the center; zero padding first where the image is smaller."""
    h, w = pixels.shape[-2:]
    if h < height or w < width:
        new_h, new_w = max(h, height), max(w, width)
        padded = pixels.new_zeros(pixels.shape[0], new_h, new_w)
        top, left = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
        padded[:, top:top + h, left:left + w] = pixels
        pixels, h, w = padded, new_h, new_w
    top, left = (h - height) // 2, (w - width) // 2
    return pixels[:, top:top + height, left:left + width]


__all__ = ["ImageProcessor", "center_crop", "to_rgb"]
