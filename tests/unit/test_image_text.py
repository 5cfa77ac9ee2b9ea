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


# ------------------------------------------------------------------ hostile shards and Energon folders


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height RGB pixels over a few bytes of data (a decompression bomb
    as far as its header goes: PIL reads the size without decompressing anything)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + \
        chunk(b"IEND", b"")


def write_members(path, members: list) -> str:
    """A tar of (TarInfo, bytes) members written header by header, so that a member may claim a size its
    bytes do not have: an int instead of bytes is a member of that many zero bytes left as a hole
    (a sparse file: a 1 GB member costs no disk and no time)."""
    with open(path, "wb") as f:
        for info, data in members:
            info.size = data if isinstance(data, int) else len(data)
            f.write(info.tobuf())
            padded = -(-info.size // 512) * 512
            if isinstance(data, int):
                f.seek(padded, 1)
            else:
                f.write(data + b"\0" * (padded - len(data)))
        f.write(b"\0" * 1024)
    return str(path)


def hostile_members() -> list:
    import tarfile

    from image_text_checks import png

    def file(name, data):
        return tarfile.TarInfo(name), data

    def link(name, target, kind):
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, target
        return info, b""

    good = png((200, 30, 30))
    thin = io_png((1, 4_000_000))
    return [
        file("ok0.png", good), file("ok0.txt", b"a good caption"),
        file("bomb.png", png_claiming(100_000, 100_000)), file("bomb.txt", b"a decompression bomb"),
        file("thin.png", thin), file("thin.txt", b"1 x 4,000,000 pixels"),
        file("cut.png", good[: len(good) // 2]), file("cut.txt", b"truncated"),
        file("junk.png", b"\x89PNG\r\n\x1a\n" + b"\xff" * 200), file("junk.txt", b"corrupt"),
        file("../up.png", good), file("../up.txt", b"outside the shard"),
        file("/etc/abs.png", good), file("/etc/abs.txt", b"an absolute path"),
        link("sym.png", "/etc/passwd", tarfile.SYMTYPE), file("sym.txt", b"a symbolic link"),
        link("hard.png", "ok0.png", tarfile.LNKTYPE), file("hard.txt", b"a hard link"),
        file("big.json", 1 << 30), file("big.0.png", good),  # a 1 GB JSON sidecar
        file("big2.png", (64 << 20) + 1), file("big2.txt", b"a member past the limit"),
        file("ok1.png", good), file("ok1.txt", b"another good caption"),
    ]


def io_png(size) -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, (9, 9, 9)).save(out, format="PNG")
    return out.getvalue()


def test_hostile_images_and_tar_members_are_skipped_with_a_count_at_indexing(tmp_path, tokenizer, caplog):
    """Each hostile sample is counted and left out when the shards are indexed (one log line), never read
    whole nor decoded past its header: the 1 x 4,000,000 PNG (15 KB, under max_image_pixels) used to pass
    indexing and die mid-training in CLIP's resize (to 8 x 32,000,000 here, 336 x 1.3e9 at LLaVA's size),
    the 1 GB JSON sidecar to be read and parsed whole, and links and `..` / absolute names to be read."""
    import time

    shard = write_members(tmp_path / "hostile.tar", hostile_members())
    started = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="titanlike"):
        blend = objective(max_image_pixels=4096 * 4096).shard_blend(shard, tokenizer, seq_len=SEQ, seed=0)
    (source,) = blend.sources
    assert dict(source.skipped) == {
        "images larger than max_image_pixels": 1,
        "images whose resize would be larger than max_image_pixels (extreme aspect ratios)": 1,
        "images that do not decode": 2,
        "tar members named with .. or an absolute path": 2,
        "tar members that are links or devices": 2,
        "tar members larger than 64 MiB": 2,
    }
    assert len(source) == 2 and time.perf_counter() - started < 30
    (line,) = [r.message for r in caplog.records if "skipped" in r.message]
    assert line.endswith(": skipped 1 samples with images larger than max_image_pixels, 2 samples with images that do "
                         "not decode, 1 samples with images whose resize would be larger than max_image_pixels "
                         "(extreme aspect ratios), 2 samples with tar members larger than 64 MiB, 2 samples with "
                         "tar members named with .. or an absolute path, 2 samples with tar members that are links "
                         "or devices"), line
    assert all(source[i]["pixel_values"].shape == (2, 3, 8, 8) for i in range(2))


def energon_folder(root, split_yaml: str, dataset_yaml: str = "__module__: megatron.energon\n"
                   "__class__: CrudeWebdataset\n"):
    """A folder as `energon prepare` leaves it (one shard of 2 captions), with these split.yaml and
    dataset.yaml texts; no energon needed."""
    import json

    from image_text_checks import png, write_shard

    root.mkdir()
    write_shard(root / "part_0.tar", {"a.png": png((1, 2, 3)), "a.txt": b"one", "b.png": png((4, 5, 6)),
                                      "b.txt": b"two"})
    meta = root / ".nv-meta"
    meta.mkdir()
    (meta / ".info.json").write_text(json.dumps({"shard_counts": {"part_0.tar": 2}}))
    (meta / "split.yaml").write_text(split_yaml)
    (meta / "dataset.yaml").write_text(dataset_yaml)
    return str(root)


def test_energon_brace_ranges_and_yaml_alias_bombs_are_refused_before_they_grow(tmp_path, tokenizer):
    """A split.yaml range `x_{0..999999999}.tar` is counted (arithmetically) and refused before a name is
    made (it used to build a list of 10^9 names: a MemoryError traceback); a 1 KB alias bomb ("billion
    laughs") in split.yaml or dataset.yaml is refused at once (it hung for minutes, then a MemoryError,
    and a SIGTERM meanwhile waited); a YAML Python tag is never run (it never was: keep it so)."""
    import time

    def refused(folder, words: str, seconds: float = 10) -> None:
        started = time.perf_counter()
        with pytest.raises(ValueError, match=words) as e:
            objective().shard_blend(folder, tokenizer, seq_len=SEQ, seed=0)
        assert len(str(e.value).splitlines()) == 1 and time.perf_counter() - started < seconds

    ok = energon_folder(tmp_path / "ok", "split_parts:\n  train: ['part_{0..0}.tar']\nexclude: []\n")
    assert len(objective().shard_blend(ok, tokenizer, seq_len=SEQ, seed=0).sources[0]) == 2
    braces = energon_folder(tmp_path / "braces", "split_parts:\n  train: [part_0.tar, 'x_{0..999999999}.tar']\n")
    refused(braces, r"name at least 1,000,000,001 shards \('x_\{0..999999999\}.tar'\), more than the 1,000,000")
    nested = energon_folder(tmp_path / "nested", "split_parts:\n  train: ['x_{0..9999}_{0..9999}.tar']\n"
                            "exclude: ['{a,b}{0..99}']\n")
    refused(nested, "name at least 100,000,200 shards")

    laughs = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    bomb = energon_folder(tmp_path / "bomb", "split_parts:\n  train: [part_0.tar]\n" + laughs)
    refused(bomb, r"split.yaml that cannot be read \(its YAML aliases \(\*name\) repeat more than 1,000,000 nodes")
    bomb_dataset = energon_folder(tmp_path / "bomb_dataset", "split_parts:\n  train: [part_0.tar]\n",
                                  "__module__: megatron.energon\n__class__: CrudeWebdataset\n" + laughs)
    refused(bomb_dataset, "dataset.yaml that cannot be read .its YAML aliases")
    metadataset = tmp_path / "blend.yaml"
    metadataset.write_text("__module__: megatron.energon\n__class__: MetadatasetV2\n" + laughs +
                           "splits:\n  train: {path: ok}\n")
    refused(str(metadataset), r"metadataset .*blend.yaml cannot be read \(its YAML aliases")
    loop = energon_folder(tmp_path / "loop", "listed: &s [part_0.tar]\nsplit_parts:\n  train: *s\n  val: *s\n")
    assert len(objective().shard_blend(loop, tokenizer, seq_len=SEQ, seed=0).sources[0]) == 2  # an alias is fine
    cycle = energon_folder(tmp_path / "cycle", "split_parts:\n  train: &t [part_0.tar, *t]\n")
    refused(cycle, "an alias that refers to itself|a YAML alias that refers to itself")

    marker = tmp_path / "ran"
    for text in (f"!!python/object/apply:os.system ['touch {marker}']\n",
                 f"__module__: megatron.energon\n__class__: !!python/name:os.system\nx: !!python/object/apply:"
                 f"os.system ['touch {marker}']\n"):
        tagged = energon_folder(tmp_path / f"tag{len(list(tmp_path.iterdir()))}",
                                "split_parts:\n  train: [part_0.tar]\n", text)
        refused(tagged, "dataset.yaml that cannot be read")
    assert not marker.exists()
