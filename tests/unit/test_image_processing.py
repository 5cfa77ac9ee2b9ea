"""Image preprocessing (titanlike/data/images.py) against transformers' own CLIP and SigLIP image
processors (their PIL backend, the one transformers uses without torchvision) on images drawn here
with PIL: sizes wider, taller and smaller than the crop, odd sizes, and the modes a dataset holds
(RGB, RGBA, grayscale, a palette with transparency)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image, ImageDraw
from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

from titanlike.data.images import ImageProcessor

SIZES = [(64, 48), (37, 91), (20, 13), (100, 100), (33, 34)]  # (width, height)
MODES = ["RGB", "RGBA", "L", "P"]


def drawn(width: int, height: int, mode: str, seed: int) -> Image.Image:
    """Noise with shapes on it (edges are where resampling filters differ), in the given mode."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 256, (height, width, 4), dtype=torch.uint8, generator=g)
    image = Image.fromarray(noise.numpy(), "RGBA")
    draw = ImageDraw.Draw(image)
    draw.ellipse((width // 5, height // 4, width // 2, height - 2), fill=(250, 20, 30, 128))
    draw.rectangle((width // 2, 1, width - 2, height // 3), fill=(10, 200, 90, 255))
    if mode == "P":
        image = image.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=16)
        image.info["transparency"] = 3
        return image
    return image.convert(mode)


PROCESSORS = {
    "clip_224": (ImageProcessor.clip(24), CLIPImageProcessorPil(size={"shortest_edge": 24},
                                                                crop_size={"height": 24, "width": 24})),
    "clip_crop_smaller": (ImageProcessor.clip(30, crop=22),
                          CLIPImageProcessorPil(size={"shortest_edge": 30}, crop_size={"height": 22, "width": 22})),
    "siglip": (ImageProcessor.siglip(28), SiglipImageProcessorPil(size={"height": 28, "width": 28})),
}


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_equal_to_transformers(name):
    ours, theirs = PROCESSORS[name]
    # Read from transformers' own settings too: what a preprocessor_config.json says.
    from_config = ImageProcessor.from_config(theirs.to_dict())
    seed = 0
    for width, height in SIZES:
        for mode in MODES:
            image = drawn(width, height, mode, seed)
            seed += 1
            want = theirs(images=image, return_tensors="pt")["pixel_values"][0]
            for processor in (ours, from_config):
                got = processor(image)
                assert got.dtype == torch.float32 and got.shape == want.shape, (width, height, mode)
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=lambda m: f"{width}x{height} {mode}: {m}")


def test_clip_pads_an_image_smaller_than_its_crop():
    # Resized to shortest edge 8 the image is 8 x 16; the 12 x 12 crop pads the short side with zeros
    # (black after rescale is -mean/std) as transformers does.
    ours = ImageProcessor(shortest_edge=8, crop=(12, 12))
    theirs = CLIPImageProcessorPil(size={"shortest_edge": 8}, crop_size={"height": 12, "width": 12})
    image = drawn(16, 8, "RGB", 0)
    torch.testing.assert_close(ours(image), theirs(images=image, return_tensors="pt")["pixel_values"][0],
                               rtol=0, atol=1e-6)


def test_settings_it_does_not_reproduce_are_refused():
    with pytest.raises(ValueError, match="resample 2 is not supported"):
        ImageProcessor.from_config({**CLIPImageProcessorPil().to_dict(), "resample": 2})
