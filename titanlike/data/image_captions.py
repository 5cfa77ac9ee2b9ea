"""A synthetic image-caption set drawn with PIL: the debug dataset of vision-language models, the way the
embedded corpus is the text models' (no download, any size, a pure function of (seed, index)).

Sample i: an image of random size (40 to 64 pixels a side) on a gray background with one or two shapes
(circle, square, triangle) in one of four colors, and its caption ("a red circle and a blue square.").
It becomes a window of token ids, BOS, the image's placeholder tokens, the caption and EOS (padding
after it), whose labels are the caption's tokens and EOS only: the loss is on the text targets; and
its pixel values, processed by the tower's image processor (titanlike/data/images.py).
"""

from __future__ import annotations

import numpy as np

from titanlike.data.errors import DataError
from titanlike.data.images import ImageProcessor

COLORS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (230, 210, 30)}
SHAPES = ("circle", "square", "triangle")
IGNORE_INDEX = -100  # titanlike.models.outputs.IGNORE_INDEX (data/ does not import the models)
# Held-out samples (split "valid") are drawn from their own stream of the seed.
_SPLIT_STREAMS = {"train": 0, "valid": 1, "test": 2}


def draw_sample(seed: int, index: int, split: str = "train"):
    """(PIL image, caption) of sample `index`."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng([seed, _SPLIT_STREAMS[split], index])
    width, height = (int(v) for v in rng.integers(40, 65, size=2))
    image = Image.new("RGB", (width, height), (128, 128, 128))
    draw = ImageDraw.Draw(image)
    words = []
    count = int(rng.integers(1, 3))
    for slot in range(count):
        color = list(COLORS)[int(rng.integers(len(COLORS)))]
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        # Side by side: shape k in the k-th vertical band, so two shapes never overlap.
        left, right = slot * width // count + 2, (slot + 1) * width // count - 2
        size = min(right - left, height - 4)
        top = int(rng.integers(2, height - size - 1)) if height - size - 1 > 2 else 2
        box = (left, top, left + size, top + size)
        if shape == "circle":
            draw.ellipse(box, fill=COLORS[color])
        elif shape == "square":
            draw.rectangle(box, fill=COLORS[color])
        else:
            draw.polygon([(left, top + size), (left + size, top + size), (left + size // 2, top)], fill=COLORS[color])
        words.append(f"a {color} {shape}")
    return image, " and ".join(words) + "."


class SyntheticCaptions:
    """Map-style source of `length` samples, each {"inputs", "labels"} (seq_len,) int64 and
    {"pixel_values"} (1, channels, size, size) float32."""

    def __init__(self, tokenizer, *, seq_len: int, seed: int, image_token_id: int, tokens_per_image: int,
                 processor: ImageProcessor, split: str = "train", length: int = 1_000_000):
        if image_token_id not in tokenizer.special_tokens.values():
            raise DataError(f"the image token id {image_token_id} is not a special token of the tokenizer "
                            f"{tokenizer.path}, so text could produce it; give the model the id of its <|image|> token")
        if seq_len < tokens_per_image + 3:
            raise DataError(f"training.seq_len {seq_len} cannot hold an image's {tokens_per_image} tokens and a "
                            f"caption; set it to at least {tokens_per_image + 3}")
        self.tokenizer, self.seq_len, self.seed, self.split = tokenizer, seq_len, seed, split
        self.image_token_id, self.tokens_per_image, self.processor = image_token_id, tokens_per_image, processor
        self.length = length
        height, width = processor.output_size()
        self.fields = {"inputs": ((seq_len,), "int64"), "labels": ((seq_len,), "int64"),
                       "pixel_values": ((1, 3, height, width), "float32")}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        image, caption = draw_sample(self.seed, index, self.split)
        t = self.tokenizer
        prompt = [t.bos_id] + [self.image_token_id] * self.tokens_per_image
        answer = t.encode(caption, bos=False, eos=False)[: self.seq_len - len(prompt)] + [t.eos_id]
        window = np.full(self.seq_len + 1, t.eos_id, dtype=np.int64)
        tokens = (prompt + answer)[: self.seq_len + 1]
        window[: len(tokens)] = tokens
        labels = window[1:].copy()
        # Targets: the answer's tokens only (not the image placeholders, not the padding after EOS).
        labels[: len(prompt) - 1] = IGNORE_INDEX
        labels[len(tokens) - 1:] = IGNORE_INDEX
        return {"inputs": window[:-1], "labels": labels,
                "pixel_values": self.processor(image).numpy()[None]}


__all__ = ["COLORS", "SHAPES", "SyntheticCaptions", "draw_sample"]
