"""Image-text samples from WebDataset tar shards, blended by weight (issue 31 item 2).

A shard is a plain tar file; a sample is the members that share a key (the file name up to its first
dot), WebDataset's convention: `k.png` + `k.txt` is an image-caption pair; `k.json` ({"messages":
[...]}, the SFT conversation format, `<image>` marking where each image goes) with images `k.0.png`,
`k.1.jpg`, ... (taken in the order of their extensions) is a conversation. Shards are read with the
stdlib `tarfile` (no dependency): the members' offsets are indexed once, the bytes read on demand,
so the source is map-style and a sample is a pure function of its index: the loader's global indexing
gives the same samples in the same order on any data-parallel degree, and a resumed run the samples
of the uninterrupted one.

A caption pair becomes BOS, the image's placeholders, the caption, EOS, the loss on the caption and
EOS; a conversation is rendered with the chat template (data/chat_template.py) with each `<image>`
expanded to the image's placeholders, the loss on the assistant turns. Bad samples are counted and
skipped when the shards are indexed (one log line of counts): an image that does not decode (corrupt,
truncated), an image larger than max_image_pixels or whose resize would be (an extreme aspect ratio),
`<image>` marks and images that do not pair up, a sample longer than seq_len + 1 tokens (its images
cannot be cut), a sample with no text, a sample with a member that is a link, is named with `..` or
an absolute path, or is larger than shards.MAX_MEMBER_BYTES (never read).

Blending: sample s of the blend comes from dataset build_blending_indices(weights)[s] (the text
blend's rule, data/blend.py), its n-th sample of that dataset being the n-th of the dataset's own
permutation by (seed, dataset, epoch): deterministic, no state but the sample number.
"""

from __future__ import annotations

import logging
from collections import Counter

import numpy as np

from titanlike.data.errors import DataError
from titanlike.data.shards import (IMAGE_MARK, Content, Member, _decode, _Skip, conversation_messages, refused_member,
                                   shard_files, shard_samples, webdataset_content)

logger = logging.getLogger("titanlike")

IGNORE_INDEX = -100  # models/outputs.py's, restated: data/ does not import the models


def image_token_text(tokenizer, image_token_id: int) -> str:
    """The special token's text a rendered conversation holds where an image goes; DataError, one
    sentence, for an id that is no special token (text could produce it)."""
    names = {v: k for k, v in (getattr(tokenizer, "special_tokens", None) or {}).items()}
    if image_token_id not in names:
        raise DataError(f"the image token id {image_token_id} is not a special token of the tokenizer, so text "
                        "could produce it; give the model the id of its <|image|> token")
    return names[image_token_id]


def expand_images(ids: list[int], mask: list[bool], image_token_id: int, per_image: int) -> tuple[list, list]:
    """Each image token of a rendered conversation as its image's per_image placeholders (never
    trained on); the other tokens and their loss mask as they are."""
    tokens, trained = [], []
    for token, on in zip(ids, mask):
        run = per_image if token == image_token_id else 1
        tokens += [token] * run
        trained += [bool(on) and run == 1] * run
    return tokens, trained


class ImageTextSource:
    """The valid samples of some shards, as {"inputs", "labels"} (seq_len,) int64 and "pixel_values"
    (max_images, 3, H, W) float32 (images past a sample's own are zeros: the model's splice leaves
    them unused). tokens_per_image: placeholders per image; processor: data/images.ImageProcessor."""

    def __init__(self, path: str, tokenizer, *, seq_len: int, image_token_id: int, tokens_per_image: int,
                 processor, max_images: int = 1, max_image_pixels: int | None = None, template=None,
                 split_name: str = "train"):
        self.path, self.tokenizer, self.seq_len = path, tokenizer, seq_len
        self.image_token_id, self.tokens_per_image, self.processor = image_token_id, tokens_per_image, processor
        self.max_images, self.max_image_pixels, self._template = max_images, max_image_pixels, template
        self.image_token_text = image_token_text(tokenizer, image_token_id)
        self.records: list[tuple[np.ndarray, np.ndarray, list[Member]]] = []
        self.skipped: Counter = Counter()
        from titanlike.data.energon import ENERGON_PARTS, EnergonDataset, is_energon_dataset

        if is_energon_dataset(path):
            # A folder `energon prepare` made: the shards of one split part, read by its field map.
            dataset = EnergonDataset(path, ENERGON_PARTS.get(split_name, split_name))
            samples, read = dataset.samples(), dataset.content
        else:
            samples = ((key, members) for shard in shard_files(path) for key, members in shard_samples(shard))
            read = webdataset_content
        for key, members in samples:
            try:
                refused_member(members)
                self.records.append(self._tokenize(read(members)))
            except _Skip as e:
                self.skipped[str(e)] += 1
        if self.skipped:
            logger.warning(f"{path}: skipped " + ", ".join(f"{n} samples with {why}" for why, n in
                                                            sorted(self.skipped.items())))
        if not self.records:
            raise DataError(f"{path} holds no usable image-text sample ({sum(self.skipped.values())} skipped)")
        height, width = processor.output_size()
        self.fields = {"inputs": ((seq_len,), "int64"), "labels": ((seq_len,), "int64"),
                       "pixel_values": ((max_images, 3, height, width), "float32")}

    @property
    def template(self):
        if self._template is None:
            from titanlike.data.chat_template import load_chat_template

            self._template = load_chat_template("auto", self.tokenizer, option="training.dataset_path")
        return self._template

    def _tokenize(self, content: Content) -> tuple[np.ndarray, np.ndarray, list[Member]]:
        images = content.images
        if len(images) > self.max_images:
            raise _Skip("more images than max_images")
        for image in images:
            _decode(image, self.max_image_pixels, self.processor)  # checked once here; decoded again when read
        t = self.tokenizer
        if content.messages is not None:
            messages = content.messages
            marks = sum(str(m.get("content", "")).count(IMAGE_MARK) for m in messages)
            if marks != len(images):
                raise _Skip("<image> marks that do not match their images")
            messages = [{**m, "content": str(m.get("content", "")).replace(IMAGE_MARK, self.image_token_text)}
                        for m in messages]
            from titanlike.data.chat_template import tokenize_conversation

            try:
                ids, mask = tokenize_conversation(self.template, t, messages)
            except Exception:
                raise _Skip("conversations the chat template refuses") from None
            if ids.count(self.image_token_id) != len(images):  # the text spelled the token itself
                raise _Skip("<image> marks that do not match their images")
            tokens, trained = expand_images(ids, mask, self.image_token_id, self.tokens_per_image)
        else:
            caption = content.caption
            if len(images) != 1:
                raise _Skip("<image> marks that do not match their images")
            if IMAGE_MARK in caption or not caption:
                raise _Skip("<image> marks that do not match their images" if caption else "no text")
            prompt = [t.bos_id] + [self.image_token_id] * self.tokens_per_image
            answer = t.encode(caption, bos=False, eos=False) + [t.eos_id]
            tokens, trained = prompt + answer, [False] * len(prompt) + [True] * len(answer)
        if len(tokens) > self.seq_len + 1:
            raise _Skip("more tokens than seq_len + 1")
        inputs = np.full(self.seq_len, t.eos_id, dtype=np.int64)
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        inputs[:len(tokens) - 1] = tokens[:-1]
        targets = np.asarray(tokens[1:], dtype=np.int64)
        labels[:len(tokens) - 1] = np.where(np.asarray(trained[1:], dtype=bool), targets, IGNORE_INDEX)
        return inputs, labels, images

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        inputs, labels, images = self.records[index]
        height, width = self.processor.output_size()
        pixels = np.zeros((self.max_images, 3, height, width), dtype=np.float32)
        for i, member in enumerate(images):
            pixels[i] = self.processor(_decode(member, None)).numpy()
        return {"inputs": inputs.copy(), "labels": labels.copy(), "pixel_values": pixels}

    def __repr__(self) -> str:
        return f"ImageTextSource({self.path!r}, {len(self)} samples)"


class BlendedImageText:
    """Map-style blend of sources by weight: sample s is sample n of dataset j (build_blending_indices),
    n read through the dataset's permutation of (seed, j, epoch), epoch = n // len(dataset)."""

    def __init__(self, sources, weights, *, seed: int, size: int | None = None):
        from titanlike.data.blend import build_blending_indices

        w = np.asarray(weights, dtype=np.float64)
        if len(w) != len(sources) or np.any(w < 0) or w.sum() <= 0:
            raise DataError("a blend needs one non-negative weight per dataset with a positive sum, got "
                            f"{list(weights)}")
        self.sources, self.seed = list(sources), seed
        self.size = int(size or sum(len(s) for s in sources))
        self.dataset_index, self.dataset_sample_index = build_blending_indices((w / w.sum()).tolist(), self.size)
        self.fields = self.sources[0].fields
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def __len__(self) -> int:
        return self.size

    def source_of(self, s: int) -> tuple[int, int]:
        """(dataset, its record number) of blended sample s."""
        j = int(self.dataset_index[s])
        epoch, n = divmod(int(self.dataset_sample_index[s]), len(self.sources[j]))
        if (j, epoch) not in self._perms:
            self._perms[(j, epoch)] = np.random.default_rng([self.seed, j, epoch]).permutation(len(self.sources[j]))
        return j, int(self._perms[(j, epoch)][n])

    def __getitem__(self, s: int) -> dict[str, np.ndarray]:
        j, n = self.source_of(s)
        return self.sources[j][n]

    def __repr__(self) -> str:
        return f"BlendedImageText({self.sources!r})"


__all__ = ["BlendedImageText", "Content", "IMAGE_MARK", "ImageTextSource", "conversation_messages", "expand_images",
           "image_token_text", "shard_files", "shard_samples", "webdataset_content"]
