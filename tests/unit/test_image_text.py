"""Image-text WebDataset shards (titanlike/data/image_text.py), written by the test with tarfile and PIL:
caption pairs and conversations with `<image>` marks become samples whose loss is on the caption or the
assistant turns only; bad samples are counted and skipped; unreadable shards are refused in one sentence.

A blend of shard sets on 1 and 2 data-parallel ranks and resumed, and datasets prepared with Megatron
Energon (its `energon prepare` starts a worker): tests/integration/test_image_text_energon.py."""

from __future__ import annotations

import logging

import pytest

from image_text_checks import IMAGE_TOKEN, PER_IMAGE, SEQ, caption_and_chat_shards, objective
from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
from titanlike.data.image_text import IGNORE_INDEX


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return caption_and_chat_shards(tmp_path_factory.mktemp("shards"))


def test_captions_and_conversations_become_samples_and_bad_ones_are_counted(shards, tokenizer, caplog):
    captions, chats = shards
    with caplog.at_level(logging.WARNING, logger="titanlike"):
        blend = objective().shard_blend(f"1 {captions} 1 {chats}", tokenizer, seq_len=SEQ, seed=0)
    a, b = blend.sources
    assert (len(a), len(b)) == (12, 6)
    assert dict(a.skipped) == {"images that do not decode": 2, "images larger than max_image_pixels": 1,
                               "<image> marks that do not match their images": 1}
    assert dict(b.skipped) == {"<image> marks that do not match their images": 2}
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


def test_a_job_on_shards_it_cannot_read_is_refused_in_one_sentence(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="needs training.dataset_path"):
        objective()._check_dataset("webdataset", None)
    with pytest.raises(ValueError, match="does not exist"):
        objective().shard_blend(str(tmp_path / "missing.tar"), tokenizer, seq_len=SEQ, seed=0)
    (tmp_path / "junk.tar").write_bytes(b"x" * 1000)
    with pytest.raises(ValueError, match="cannot be read as a tar file") as e:
        objective().shard_blend(str(tmp_path / "junk.tar"), tokenizer, seq_len=SEQ, seed=0)
    assert len(str(e.value).splitlines()) == 1
