"""WebDataset tar shards as titanlike/data reads them: a sample is the members sharing a key (the file
name up to its first dot), indexed once by offset and read on demand, and what one sample says
(`Content`: its images and a caption or a conversation). Both readers of image-text data use it:
data/image_text.py (`training.dataset webdataset`) and data/energon.py (folders Energon prepared),
which is why it is a module of its own rather than a part of either.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from dataclasses import dataclass

from titanlike.data.errors import DataError

IMAGE_MARK = "<image>"
IMAGE_SUFFIXES = ("png", "jpg", "jpeg", "webp", "bmp", "gif", "ppm")


@dataclass(frozen=True)
class Member:
    shard: str
    offset: int
    size: int

    def read(self) -> bytes:
        with open(self.shard, "rb") as f:
            f.seek(self.offset)
            return f.read(self.size)


def shard_files(path: str) -> list[str]:
    """A .tar file, or the .tar files of a folder (sorted). DataError, one sentence, for neither."""
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".tar"))
        if not files:
            raise DataError(f"{path} holds no .tar shard")
        return files
    if not os.path.isfile(path):
        raise DataError(f"the shard {path} does not exist")
    return [path]


def shard_samples(shard: str) -> list[tuple[str, dict[str, Member]]]:
    """(key, {extension: member}) of every sample of a shard, in the shard's order."""
    samples: dict[str, dict[str, Member]] = {}
    try:
        with tarfile.open(shard, "r:") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                base = os.path.basename(info.name)
                if "." not in base:
                    continue
                stem, ext = base.split(".", 1)
                key = os.path.join(os.path.dirname(info.name), stem)
                samples.setdefault(key, {})[ext.lower()] = Member(shard, info.offset_data, info.size)
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"the shard {shard} cannot be read as a tar file: {e}") from None
    return list(samples.items())


class _Skip(Exception):
    """A sample counted and left out; the message is the reason's name."""


def _decode(member: Member, max_pixels: int | None):
    from PIL import Image

    try:
        with Image.open(io.BytesIO(member.read())) as image:
            if max_pixels is not None and image.width * image.height > max_pixels:
                raise _Skip("images larger than max_image_pixels")
            image.load()
            return image.convert("RGB")
    except _Skip:
        raise
    except Exception:  # PIL raises OSError, SyntaxError, ValueError... for bad bytes
        raise _Skip("images that do not decode") from None


@dataclass(frozen=True)
class Content:
    """What one sample says, before tokenizing: its images (in order) and either a caption (an
    image-caption pair) or the messages of a conversation (each `<image>` where an image goes)."""
    images: list[Member]
    caption: str | None = None
    messages: list[dict] | None = None


# LLaVA's own JSON ({"conversations": [{"from": "human", "value": ...}]}) names the roles so.
_LLAVA_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


def conversation_messages(value) -> list[dict]:
    """{"messages": [{"role", "content"}, ...]} (the SFT format) or LLaVA's {"conversations": [{"from",
    "value"}, ...]} as messages; _Skip for anything else."""
    try:
        if "messages" in value:
            messages = [dict(m) for m in value["messages"]]
        else:
            messages = [{"role": _LLAVA_ROLES[m["from"]], "content": str(m["value"])} for m in value["conversations"]]
        if not messages or not all(isinstance(m.get("content", ""), str) for m in messages):
            raise ValueError
        return messages
    except Exception:
        raise _Skip("conversations that are not {\"messages\": [...]} JSON") from None


def webdataset_content(members: dict[str, Member]) -> Content:
    """A sample in this module's convention: `json` a conversation with images `0.png`, `1.jpg`, ...
    (in the order of their extensions), or an image and its `txt` caption."""
    images = [members[ext] for ext in sorted(members) if ext.rsplit(".", 1)[-1] in IMAGE_SUFFIXES]
    if "json" in members:
        try:
            value = json.loads(members["json"].read())
        except Exception:
            raise _Skip("conversations that are not {\"messages\": [...]} JSON") from None
        return Content(images, messages=conversation_messages(value if isinstance(value, dict) else {}))
    if "txt" in members:
        return Content(images, caption=members["txt"].read().decode("utf-8", errors="replace").strip())
    raise _Skip("no text")


__all__ = ["Content", "IMAGE_MARK", "IMAGE_SUFFIXES", "Member", "conversation_messages", "shard_files", "shard_samples",
           "webdataset_content"]
