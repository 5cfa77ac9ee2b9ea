"""Image-text WebDataset shards (titanlike/data/image_text.py), written by the test with tarfile and PIL:
caption pairs and conversations with `<image>` marks become samples whose loss is on the caption or the
assistant turns only; bad samples are counted and skipped; a weighted blend of two shard sets gives the
same samples in the same order on 1 and 2 data-parallel ranks, and a resumed loader continues with the
samples of the uninterrupted one."""

from __future__ import annotations

import io
import json
import logging
import tarfile

import numpy as np
import pytest
import torch

from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
from titanlike.data.image_text import IGNORE_INDEX
from titanlike.data.loader import build_dataloader_from_source
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


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
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
    return write_shard(root / "captions.tar", captions), write_shard(root / "chats.tar", chats)


def test_captions_and_conversations_become_samples_and_bad_ones_are_counted(shards, tokenizer, caplog):
    captions, chats = shards
    with caplog.at_level(logging.WARNING, logger="titanlike"):
        blend = objective().shard_blend(f"1 {captions} 1 {chats}", tokenizer, seq_len=SEQ, seed=0)
    a, b = blend.sources
    assert (len(a), len(b)) == (12, 6)
    assert dict(a.skipped) == {"images that do not decode": 2, "images larger than max_image_pixels": 1,
                               "<image> marks that do not match their images": 1}
    assert dict(b.skipped) == {"<image> marks that do not match their images": 1}
    assert len([r for r in caplog.records if "skipped" in r.message]) == 2

    pair = a[0]
    inputs, labels = pair["inputs"], pair["labels"]
    assert list(inputs[:1 + PER_IMAGE]) == [tokenizer.bos_id] + [IMAGE_TOKEN] * PER_IMAGE
    caption = tokenizer.encode("caption number 0", bos=False, eos=False) + [tokenizer.eos_id]
    assert list(labels[labels != IGNORE_INDEX]) == caption
    assert pair["pixel_values"].shape == (2, 3, 8, 8) and not pair["pixel_values"][1].any()

    chat = b[0]
    assert (chat["inputs"] == IMAGE_TOKEN).sum() == 2 * PER_IMAGE
    trained = tokenizer.decode([int(t) for t in chat["labels"][chat["labels"] != IGNORE_INDEX]])
    assert "A red square." in trained and "What is left" not in trained
    assert chat["pixel_values"][1].any()  # the second image is there


def test_a_blend_is_the_same_on_any_data_parallel_degree_and_resumes_exactly(shards, tokenizer):
    captions, chats = shards
    samples = objective().samples("webdataset", dataset_path=f"0.7 {captions} 0.3 {chats}", tokenizer=tokenizer,
                                  seq_len=SEQ, seed=3)
    blend = samples.source
    drawn = [blend.source_of(s)[0] for s in range(len(blend))]
    assert abs(np.mean(drawn) - 0.3) < 0.06

    def loader(rank, degree):
        return build_dataloader_from_source(samples.source, seq_len=SEQ, local_batch_size=4 // degree,
                                            global_batch_size=4, dp_rank=rank, dp_degree=degree,
                                            sample_fields=samples.fields)

    def take(it, n):
        return [next(it) for _ in range(n)]

    one = take(iter(loader(0, 1)), 6)
    halves = [take(iter(loader(r, 2)), 6) for r in range(2)]
    for step in range(6):
        for field in ("inputs", "labels", "pixel_values"):
            joined = torch.cat([halves[0][step][field], halves[1][step][field]])
            assert torch.equal(joined, one[step][field]), (step, field)

    first = loader(0, 1)
    it = iter(first)
    take(it, 3)
    state = first.state_dict()
    resumed = loader(0, 1)
    resumed.load_state_dict(state)
    for want, got in zip(one[3:], take(iter(resumed), 3)):
        assert all(torch.equal(want[f], got[f]) for f in want)
    # Another seed orders the datasets' samples otherwise.
    other = objective().samples("webdataset", dataset_path=f"0.7 {captions} 0.3 {chats}", tokenizer=tokenizer,
                                seq_len=SEQ, seed=4).source
    assert [other.source_of(s) for s in range(10)] != [blend.source_of(s) for s in range(10)]


def test_a_job_on_shards_it_cannot_read_is_refused_in_one_sentence(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="needs training.dataset_path"):
        objective().validate_dataset("webdataset", None)
    with pytest.raises(ValueError, match="does not exist"):
        objective().shard_blend(str(tmp_path / "missing.tar"), tokenizer, seq_len=SEQ, seed=0)
    (tmp_path / "junk.tar").write_bytes(b"x" * 1000)
    with pytest.raises(ValueError, match="cannot be read as a tar file") as e:
        objective().shard_blend(str(tmp_path / "junk.tar"), tokenizer, seq_len=SEQ, seed=0)
    assert len(str(e.value).splitlines()) == 1
