"""What tests/unit/test_image_text.py and tests/integration/test_image_text_energon.py both use, written
once (imported like tests/family_checks.py): PNG images and tar shards written with PIL and tarfile, the
shards of captions and conversations, and the image-caption objective at a tiny image size."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from titanlike.objectives.image_caption import ImageCaption

IMAGE_TOKEN, PER_IMAGE, SEQ = 1803, 4, 64


def png(color, size=(12, 10)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


def write_shard(path, members: dict[str, bytes]) -> str:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def objective(max_images=2, max_image_pixels=40 * 40) -> ImageCaption:
    # A CLIP processor to 8x8: two 4x4 patches a side, 4 placeholders per image.
    return ImageCaption(image_token_id=IMAGE_TOKEN, tokens_per_image=PER_IMAGE, image_size=8,
                        max_images=max_images, max_image_pixels=max_image_pixels)


def caption_and_chat_shards(root: Path) -> tuple[str, str]:
    """Two shards in root: captions (12 good, 4 bad: undecodable, truncated, too large, a stray mark)
    and conversations with two images each (6 good, 2 whose marks do not match their images)."""
    good = png((200, 30, 30))
    captions = {f"c{i:03d}.png": png((i * 9 % 256, 40, 200)) for i in range(12)}
    captions.update({f"c{i:03d}.txt": f"caption number {i}".encode() for i in range(12)})
    captions.update({
        "bad1.png": b"\x89PNG\r\n\x1a\nnot really", "bad1.txt": b"corrupt",
        "bad2.png": good[: len(good) // 2], "bad2.txt": b"truncated",
        "big.png": png((0, 0, 0), size=(64, 64)), "big.txt": b"too large",
        "mark.png": good, "mark.txt": b"<image> a caption with a mark",
    })
    turn = {"messages": [{"role": "user", "content": "<image>\nWhat is left of <image>?"},
                         {"role": "assistant", "content": "A red square."}]}
    chats = {}
    for i in range(6):
        chats[f"v{i}.json"] = json.dumps(turn).encode()
        chats[f"v{i}.0.png"] = png((10, 20 * i, 30))
        chats[f"v{i}.1.jpg"] = good  # a PNG under a .jpg name: PIL reads the bytes, not the name
    chats["odd.json"] = json.dumps(turn).encode()
    chats["odd.0.png"] = good  # two marks, one image
    spelled = {"messages": [{"role": "user", "content": "<image> or <|image|>?"},
                            {"role": "assistant", "content": "No."}]}
    chats["spelled.json"] = json.dumps(spelled).encode()  # the text writes the image token itself
    chats["spelled.0.png"] = good
    return write_shard(root / "captions.tar", captions), write_shard(root / "chats.tar", chats)
