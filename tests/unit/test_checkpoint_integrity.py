"""What reaches the disk is what was meant, in one process: checksums catch flipped bytes, a full
disk fails a save cleanly, a model with non-finite parameters is never saved, and the leftovers of
an unfinished save are removed before anything else of the job writes.

The same through train.py (and on 2 ranks): tests/integration/test_checkpoint_faults.py.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from faults import disk_full, flip_two_bytes
from test_checkpoint_manager import Job, assert_same_tensors, run

from titanlike.checkpoint import CheckpointError, load_model, published_steps
from titanlike.checkpoint import format as fmt

FULL = "--checkpoint.no_last_save_model_only"


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """Full checkpoints at steps 3 and 6, and the parameters after step 3."""
    root = tmp_path_factory.mktemp("two")
    job = Job(root, FULL)
    job.start()
    job.train(3)
    after_3 = job.params()
    job.train(3)
    job.manager.close()
    return root, after_3


@pytest.fixture
def saved(two_checkpoints, tmp_path):
    root, after_3 = two_checkpoints
    shutil.copytree(root / "checkpoint", tmp_path / "checkpoint")
    return tmp_path, after_3


# ------------------------------------------------------------------ checksums


def test_sidecar_records_a_checksum_of_every_file(saved):
    root, _ = saved
    path = root / "checkpoint" / "step-6"
    crcs = json.loads((path / "titanlike.json").read_text())["checksums"]["crc32"]
    assert sorted(crcs) == sorted(n for n in os.listdir(path) if n != "titanlike.json") == [".metadata", "__0_0.distcp"]
    assert all(crcs[n] == fmt.file_crc32(str(path / n)) for n in crcs)
    assert fmt.verify_checksums(str(path)) is None


def test_flipped_bytes_in_the_latest_checkpoint_stop_the_resume_naming_the_file(saved):
    root, _ = saved
    file = flip_two_bytes(str(root / "checkpoint" / "step-6"))
    with pytest.raises(CheckpointError, match=(
            rf"^checkpoint file {file} is corrupt: its CRC-32 is [0-9a-f]{{8}}, but titanlike.json recorded "
            rf"[0-9a-f]{{8}} when it was saved; the newest checkpoint that verifies is {root}/checkpoint/step-3: "
            r"resume from it with --checkpoint.load_step 3 or --checkpoint.fallback_on_corruption$")):
        Job(root).start()
    # An explicit load_step never falls back.
    with pytest.raises(CheckpointError, match=rf"^checkpoint file {file} is corrupt: .* when it was saved$"):
        Job(root, "--checkpoint.load_step", "6", "--checkpoint.fallback_on_corruption").start()
    with pytest.raises(CheckpointError, match=rf"^checkpoint file {file} is corrupt"):
        load_model(root / "checkpoint" / "step-6")


def test_fallback_on_corruption_resumes_from_the_newest_checkpoint_that_verifies(saved, caplog):
    root, after_3 = saved
    flip_two_bytes(str(root / "checkpoint" / "step-6"))
    job = Job(root, "--checkpoint.fallback_on_corruption")
    with caplog.at_level("WARNING", logger="titanlike"):
        assert job.start() == 3
    assert_same_tensors(job.params(), after_3)
    assert "is corrupt" in caplog.text and "resuming from" in caplog.text and "step-3 instead" in caplog.text


def test_a_damaged_index_counts_as_corruption(saved):
    root, _ = saved
    with open(root / "checkpoint" / "step-6" / ".metadata", "r+b") as f:
        f.write(b"garbage")
    with pytest.raises(CheckpointError, match=r"step-6/\.metadata is damaged .*; the newest checkpoint that "
                                              r"verifies is .*step-3"):
        Job(root).start()
    assert Job(root, "--checkpoint.fallback_on_corruption").start() == 3


def test_a_file_the_checksums_do_not_cover_is_corruption(saved):
    root, _ = saved
    sidecar = root / "checkpoint" / "step-6" / "titanlike.json"
    info = json.loads(sidecar.read_text())
    del info["checksums"]["crc32"]["__0_0.distcp"]
    sidecar.write_text(json.dumps(info))
    with pytest.raises(CheckpointError, match=r"step-6: titanlike.json has no checksum for __0_0.distcp, which "
                                              r"\.metadata names; the newest"):
        Job(root).start()


# ------------------------------------------------------------------ a full disk


@pytest.mark.parametrize("mode", ["disabled", "async"])
def test_no_space_left_removes_the_partial_save_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch, mode):
    job = Job(tmp_path, FULL, "--checkpoint.async_mode", mode, "--checkpoint.interval", "2", steps=6)
    job.start()
    job.train(2)
    disk_full(monkeypatch, "step-4.tmp", budget=20_000)
    folder = job.folder()
    with pytest.raises(CheckpointError, match=(
            rf"^no space left on device while saving step 4 to {folder}/step-4; removed the partial save, "
            rf"{folder}/step-2 stays the latest checkpoint$")):
        job.train(2)
        job.train(2)  # async: the failure surfaces when the save in flight is waited for (step 6's save)
    assert sorted(os.listdir(folder)) == ["step-2"]
    monkeypatch.undo()
    resumed = Job(tmp_path, FULL, steps=6)
    assert resumed.start() == 2


def test_no_space_for_the_index_or_the_sidecar_is_reported_alike(tmp_path, monkeypatch):
    job = Job(tmp_path, FULL, "--checkpoint.interval", "2", steps=4)
    job.start()
    job.train(2)
    original = fmt.write_sidecar

    def full_sidecar(folder, info):
        original(folder, info)
        raise OSError(28, "No space left on device", os.path.join(folder, fmt.SIDECAR))

    monkeypatch.setattr(fmt, "write_sidecar", full_sidecar)
    with pytest.raises(CheckpointError, match=r"^no space left on device while saving step 4 to .*step-4; removed "
                                              r"the partial save, .*step-2 stays the latest checkpoint$"):
        job.train(2)
    assert sorted(os.listdir(job.folder())) == ["step-2"]
    monkeypatch.undo()
    # The index: DCP's coordinator writes it after every rank's data.
    disk_full(monkeypatch, "step-4.tmp/.metadata", budget=0)
    with pytest.raises(CheckpointError, match=r"^no space left on device while saving step 4 to"):
        job.manager.save(4)
    assert sorted(os.listdir(job.folder())) == ["step-2"]


def test_leftovers_are_removed_when_the_manager_is_built(tmp_path):
    """Before the trainer builds its metrics writers: a partial save that filled the disk must not
    stop the relaunch first (the trainer builds the manager before the MetricsLogger)."""
    run(tmp_path, 3, FULL, steps=3)
    folder = tmp_path / "checkpoint"
    (folder / "step-5.tmp").mkdir()
    (folder / "step-5.tmp" / "__0_0.distcp").write_bytes(b"\0" * 1000)
    (folder / "step-1.purge").mkdir()
    Job(tmp_path)  # no load()
    assert sorted(os.listdir(folder)) == ["step-3"]


# ------------------------------------------------------------------ non-finite parameters


def test_a_step_with_non_finite_parameters_is_not_saved(tmp_path):
    job = Job(tmp_path, FULL, steps=9)
    job.start()
    job.train(3)
    with torch.no_grad():
        job.parts[0].layers["1"].feed_forward.w2.weight[3, 5] = float("inf")
    with pytest.raises(CheckpointError, match=r"^step 6 has non-finite parameters \(first: "
                                              r"layers\.1\.feed_forward\.w2\.weight\); not saving it$"):
        job.manager.save(6)
    with pytest.raises(CheckpointError, match=r"^step 9 has non-finite parameters"):
        job.manager.save(9)  # the last step's model-only export too
    assert sorted(os.listdir(job.folder())) == ["step-3"] and published_steps(job.folder()) == [3]
