"""Datasets prepared with Megatron Energon (titanlike/data/energon.py), built here by energon's own
`energon prepare` (run in-process; it starts a worker process) on shards of captions, VQA pairs and raw
conversations: we read the same samples in the same order as energon's own sequential reader of the
split part (keys, texts and decoded pixels), the val part for validation, and refuse hostile metadata
(code to import, paths out of the folder, shards changed since prepare) in one sentence. A weighted blend
of two shard sets, plain or prepared, gives the same samples in the same order on 1 and 2 data-parallel
ranks, and a resumed loader continues with the samples of the uninterrupted one. Plain shards alone:
tests/unit/test_image_text.py."""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from image_text_checks import IMAGE_TOKEN, PER_IMAGE, SEQ, caption_and_chat_shards, objective, png, write_shard
from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
from titanlike.data.image_text import IGNORE_INDEX
from titanlike.data.loader import build_dataloader_from_source


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return caption_and_chat_shards(tmp_path_factory.mktemp("shards"))


@pytest.mark.parametrize("prepared", [False, True], ids=["webdataset", "energon"])
def test_a_blend_is_the_same_on_any_data_parallel_degree_and_resumes_exactly(shards, energon_datasets, tokenizer,
                                                                             prepared):
    captions, chats = (energon_datasets["captions"], energon_datasets["crude"]) if prepared else shards
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


# ---------------------------------------------------------------------------------------------
# Megatron Energon.


def energon_prepare(folder, *args: str) -> str:
    """energon's own `energon prepare FOLDER ARGS` (its click command, in-process: no 2 s start-up)."""
    from megatron.energon.tools.prepare import command

    command.main([str(folder), "--non-interactive", "--no-progress", "--num-workers", "1", *args],
                 standalone_mode=False)
    return str(folder)


@pytest.fixture(scope="module")
def energon_datasets(tmp_path_factory):
    """Captions in 3 shards (2 train, 1 val; one sample excluded by split.yaml), LLaVA-Pretrain-style VQA
    pairs (the question and answer inside a JSON list, as Megatron's docs map them), and a crude dataset
    in our convention (a two-image conversation, one in LLaVA's {"conversations": ...} form)."""
    root = tmp_path_factory.mktemp("energon")
    (root / "captions").mkdir()
    for s in range(3):
        write_shard(root / "captions" / f"part_{s}.tar",
                    {f"c{s}_{i}.{ext}": png((s * 70, i * 40, 9)) if ext == "png" else f"shard {s} caption {i}".encode()
                     for i in range(4) for ext in ("png", "txt")})
    energon_prepare(root / "captions", "--split-parts", "train:part_{0..1}.tar", "--split-parts", "val:part_2.tar",
                    "--sample-type", "CaptioningSample", "--field-map", '{"image": "png", "caption": "txt"}')
    split = root / "captions" / ".nv-meta" / "split.yaml"
    split.write_text(split.read_text().replace("exclude: []", "exclude:\n- part_1.tar/c1_2"))

    (root / "vqa").mkdir()
    vqa = {}
    for i in range(5):
        turns = [{"from": "human", "value": f"What is in picture {i}?" + ("\n<image>" if i == 3 else "")},
                 {"from": "gpt", "value": f"Square number {i}."}]
        vqa.update({f"q{i}.jpg": png((i * 50, 90, 90)), f"q{i}.json": json.dumps(turns).encode()})
    write_shard(root / "vqa" / "vqa.tar", vqa)
    energon_prepare(root / "vqa", "--split-ratio", "1,0,0", "--sample-type", "VQASample", "--field-map",
                    '{"image": "jpg", "context": "json[0][value]", "answers": "json[1][value]"}')

    (root / "crude").mkdir()
    chats = {}
    for i in range(4):
        if i % 2:
            turn = {"conversations": [{"from": "human", "value": "<image> and <image>: which is brighter?"},
                                      {"from": "gpt", "value": f"The first, {i}."}]}
        else:
            turn = {"messages": [{"role": "user", "content": "<image> and <image>: which is brighter?"},
                                 {"role": "assistant", "content": f"The second, {i}."}]}
        chats.update({f"v{i}.json": json.dumps(turn).encode(), f"v{i}.0.png": png((i * 60, 0, 0)),
                      f"v{i}.1.png": png((0, i * 60, 0))})
    write_shard(root / "crude" / "chats.tar", chats)
    energon_prepare(root / "crude", "--split-ratio", "1,0,0", "--sample-type", "CrudeWebdataset")
    # A metadataset (MetadatasetV2, energon's blend of prepared folders by weight); val: the captions' val part.
    (root / "blend.yaml").write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n"
        "      - weight: 3\n        path: captions\n      - weight: 1\n        path: vqa\n"
        "  val:\n    path: captions\n")
    return {name: str(root / name) for name in ("captions", "vqa", "crude", "blend.yaml")}


def energon_reference(folder: str, part: str) -> list:
    """energon's own reading of a split part: its sequential (validation) loader on one rank."""
    from megatron.energon import WorkerConfig, get_loader, get_val_dataset

    dataset = get_val_dataset(folder, split_part=part, batch_size=None,
                              worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    with warnings.catch_warnings():  # its torch DataLoader asks for pinned memory, which a CPU lacks
        warnings.filterwarnings("ignore", message=".*pin_memory.*")
        return list(get_loader(dataset))


def test_energon_prepared_datasets_read_as_energon_reads_them(energon_datasets, tokenizer):
    from PIL import Image

    from titanlike.data.energon import EnergonDataset

    for name, part in (("captions", "train"), ("captions", "val"), ("vqa", "train")):
        ours = EnergonDataset(energon_datasets[name], part)
        samples = list(ours.samples())
        theirs = energon_reference(energon_datasets[name], part)
        assert [key for key, _ in samples] == [s.__key__ for s in theirs], (name, part)
        for (key, members), sample in zip(samples, theirs):
            content = ours.content(members)
            pixels = np.asarray(Image.open(io.BytesIO(content.images[0].read())).convert("RGB"), dtype=np.float32)
            assert torch.equal(torch.from_numpy(pixels / 255).permute(2, 0, 1), sample.image), key
            if name == "captions":
                assert content.caption == sample.caption
            else:
                assert content.messages[1]["content"] == sample.answers
                context = content.messages[0]["content"]
                assert context == (sample.context if "<image>" in sample.context else "<image>\n" + sample.context)
    assert "c1_2" not in [key for key, _ in EnergonDataset(energon_datasets["captions"]).samples()]

    # Through the objective: the train part for training, the val part for train.py's held-out split,
    # the loss on the caption, the VQA answer and the conversations' assistant turns.
    obj = objective()
    train = obj.shard_blend(energon_datasets["captions"], tokenizer, seq_len=SEQ, seed=0).sources[0]
    val = obj.shard_blend(energon_datasets["captions"], tokenizer, seq_len=SEQ, seed=0, split_name="valid").sources[0]
    assert (len(train), len(val)) == (7, 4)

    def trained(sample) -> str:
        return tokenizer.decode([int(t) for t in sample["labels"][sample["labels"] != IGNORE_INDEX]])

    assert trained(val[0]) == "shard 2 caption 0" + tokenizer.decode([tokenizer.eos_id])
    vqa = obj.shard_blend(energon_datasets["vqa"], tokenizer, seq_len=SEQ, seed=0).sources[0]
    assert len(vqa) == 5 and all((vqa[i]["inputs"] == IMAGE_TOKEN).sum() == PER_IMAGE for i in range(5))
    assert "Square number 3." in trained(vqa[3]) and "picture" not in trained(vqa[3])
    # The metadataset: energon's loader takes it (both datasets drawn), ours blends the same parts by its weights.
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    theirs = get_train_dataset(energon_datasets["blend.yaml"], batch_size=None, shuffle_buffer_size=None,
                               max_samples_per_sequence=None,
                               worker_config=WorkerConfig(rank=0, world_size=1, num_workers=0))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*pin_memory.*")
        drawn = iter(get_loader(theirs))
        assert {type(next(drawn)).__name__ for _ in range(40)} == {"CaptioningSample", "VQASample"}
    blend = obj.shard_blend(energon_datasets["blend.yaml"], tokenizer, seq_len=SEQ, seed=0)
    assert [len(source) for source in blend.sources] == [7, 5]
    assert abs(np.mean([blend.source_of(s)[0] for s in range(len(blend))]) - 0.25) < 0.05
    held_out = obj.shard_blend(energon_datasets["blend.yaml"], tokenizer, seq_len=SEQ, seed=0, split_name="valid")
    assert [len(source) for source in held_out.sources] == [4]
    crude = obj.shard_blend(energon_datasets["crude"], tokenizer, seq_len=SEQ, seed=0).sources[0]
    assert len(crude) == 4 and not crude.skipped
    assert [(crude[i]["inputs"] == IMAGE_TOKEN).sum() for i in range(4)] == [2 * PER_IMAGE] * 4
    assert "The first, 1." in trained(crude[1]) and "brighter" not in trained(crude[1])


def test_hostile_energon_metadata_is_refused_in_one_sentence(energon_datasets, tmp_path, tokenizer):
    import shutil

    def copy(name: str):
        folder = tmp_path / f"{name}_{len(list(tmp_path.iterdir()))}"
        shutil.copytree(energon_datasets[name], folder)
        return folder

    def refused(folder, words: str):
        with pytest.raises(ValueError, match=words) as e:
            objective().shard_blend(str(folder), tokenizer, seq_len=SEQ, seed=0)
        assert len(str(e.value).splitlines()) == 1

    # energon prepare without a field map writes a sample_loader.py for the user to fill in: never run.
    loader = copy("vqa")
    shutil.rmtree(loader / ".nv-meta")
    energon_prepare(loader, "--split-ratio", "1,0,0", "--sample-type", "VQASample")
    assert (loader / ".nv-meta" / "sample_loader.py").is_file()
    refused(loader, "names a sample_loader .* Python code titanlike never runs")
    for yaml_text, words in (
            ("sample_type:\n  __module__: os\n  __class__: system\nfield_map: {}", "not a class of megatron.energon"),
            ("!!python/object/apply:os.system ['true']", "dataset.yaml that cannot be read"),
            ("sample_type:\n  __module__: megatron.energon\n  __class__: OCRSample\nfield_map: {}",
             "holds OCRSample samples"),
            ("sample_type:\n  __module__: megatron.energon\n  __class__: CaptioningSample\n"
             "field_map: {image: png, caption: pyd}", "does not read as text or JSON")):
        folder = copy("captions")
        (folder / ".nv-meta" / "dataset.yaml").write_text(yaml_text)
        refused(folder, words)
    outside = copy("captions")
    split = outside / ".nv-meta" / "split.yaml"
    split.write_text(split.read_text().replace("part_2.tar", "../part_2.tar"))
    with pytest.raises(ValueError, match="outside the folder"):
        objective().shard_blend(str(outside), tokenizer, seq_len=SEQ, seed=0, split_name="valid")
    changed = copy("captions")
    write_shard(changed / "part_0.tar", {"c.png": png((1, 2, 3)), "c.txt": b"one sample now"})
    refused(changed, "holds 1 samples but .* says 4: it changed after energon prepare")
    with pytest.raises(ValueError, match="has no shards in its 'val' split part"):
        objective().shard_blend(energon_datasets["vqa"], tokenizer, seq_len=SEQ, seed=0, split_name="valid")

    joined = tmp_path / "joined.yaml"
    joined.write_text(Path(energon_datasets["blend.yaml"]).read_text().replace("blend:", "blend_epochized:"))
    refused(joined, "titanlike reads blends of .path, weight, split_part. entries")

    # Validation with no dataset of its own reads an Energon folder's val part; plain shards hold none out.
    from titanlike.config.schema import JobConfig

    cfg = JobConfig()
    cfg.training.dataset, cfg.training.seq_len, cfg.validation.enable = "webdataset", SEQ, True
    cfg.training.dataset_path = f"1 {energon_datasets['captions']} 1 {energon_datasets['crude']}"
    objective().validate(cfg, None, model="llava")
    cfg.training.dataset_path = f"1 {energon_datasets['captions']} 1 {tmp_path / 'plain.tar'}"
    with pytest.raises(ValueError, match="plain.tar hold out no split"):
        objective().validate(cfg, None, model="llava")
