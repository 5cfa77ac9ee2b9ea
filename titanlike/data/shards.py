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
# No image or caption of a real dataset comes near this; a member that claims more (a 1 GB JSON sidecar)
# is never read, since reading then parsing it whole while indexing would run the host out of memory.
MAX_MEMBER_BYTES = 64 << 20


@dataclass(frozen=True)
class Member:
    """A tar member's bytes in its shard; `refused` names why it is never read (a link, a name with `..`
    or an absolute path, a size over MAX_MEMBER_BYTES): its sample is counted and skipped."""
    shard: str
    offset: int
    size: int
    refused: str | None = None

    def read(self) -> bytes:
        if self.refused is not None:
            raise _Skip(self.refused)
        with open(self.shard, "rb") as f:
            f.seek(self.offset)
            return f.read(self.size)


def _refusal(info: tarfile.TarInfo) -> str | None:
    """Why a tar member is never read, or None. We read members by offset and never extract them, so
    a link or a `../` name cannot reach outside the shard; they are still refused, as no shard a tool
    writes holds them and what they point to is not the sample's."""
    if not info.isfile():
        return "tar members that are links or devices"
    if info.name.startswith("/") or ".." in info.name.split("/"):
        return "tar members named with .. or an absolute path"
    if info.size > MAX_MEMBER_BYTES:
        return f"tar members larger than {MAX_MEMBER_BYTES >> 20} MiB"
    return None


def refused_member(members: dict[str, Member]) -> None:
    """_Skip when one of a sample's members is refused (the whole sample is left out)."""
    for member in members.values():
        if member.refused is not None:
            raise _Skip(member.refused)


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
    """(key, {extension: member}) of every sample of a shard, in the shard's order (folders left out;
    refused members kept, marked, so that their sample is counted when it is skipped)."""
    samples: dict[str, dict[str, Member]] = {}
    try:
        with tarfile.open(shard, "r:") as tar:
            for info in tar:
                if info.isdir():
                    continue
                base = os.path.basename(info.name)
                if "." not in base:
                    continue
                stem, ext = base.split(".", 1)
                key = os.path.join(os.path.dirname(info.name), stem)
                samples.setdefault(key, {})[ext.lower()] = Member(shard, info.offset_data, info.size,
                                                                    _refusal(info))
    except (tarfile.TarError, OSError, EOFError) as e:
        raise DataError(f"the shard {shard} cannot be read as a tar file: {e}") from None
    return list(samples.items())


class _Skip(Exception):
    """A sample counted and left out; the message is the reason's name."""


def _decode(member: Member, max_pixels: int | None, processor=None):
    """The member as an RGB PIL image; _Skip when it does not decode or, from its header alone (before
    any pixel is decompressed), when it or its resize by `processor` would hold more than max_pixels."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(member.read())) as image:
            if max_pixels is not None and image.width * image.height > max_pixels:
                raise _Skip("images larger than max_image_pixels")
            if max_pixels is not None and processor is not None:
                # CLIP's resize keeps the aspect ratio: a 1 x 4,000,000 image under the limit becomes
                # 336 x 1.3e9 pixels, an out-of-memory kill mid-training.
                height, width = processor.resized_size(image.height, image.width)
                if height * width > max_pixels:
                    raise _Skip("images whose resize would be larger than max_image_pixels (extreme aspect ratios)")
            image.load()
            return image.convert("RGB")
    except _Skip:
        raise
    except Image.DecompressionBombError:  # PIL's own cap, past max_image_pixels if the user set it higher
        raise _Skip("images larger than max_image_pixels") from None
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


__all__ = ["Content", "IMAGE_MARK", "IMAGE_SUFFIXES", "MAX_MEMBER_BYTES", "Member", "conversation_messages",
           "refused_member", "shard_files", "shard_samples", "webdataset_content"]
