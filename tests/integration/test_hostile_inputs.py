"""Issue 33: hostile files, careless relaunches and faults outside the training loop, each refused in
one sentence (docs/reliability.md lists every case).

In-process wherever no process is needed (a Trainer, the converters' functions, train.main); one
torchrun launch of 2 ranks checks that a verdict rank 0 reaches on a hostile Hugging Face config.json
reaches every rank.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, TINY_JOB, _env

JOB = [*TINY_JOB, "--training.local_batch_size", "2", "--training.steps", "2", "--metrics.log_freq", "1"]


def _cfg(dump, *extra):
    from titanlike.config import load_job_config

    return load_job_config([*JOB, "--job.dump_folder", str(dump), *extra])


def _trainer(dump, *extra):
    from titanlike.train.plan import plan_job
    from titanlike.train.trainer import Trainer

    return Trainer(plan_job(_cfg(dump, *extra), 1))


def _main(*args: str) -> int:
    import train

    return train.main(list(args))


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


# ------------------------------------------------------------------ 1. the folder lock


@pytest.mark.parametrize("option, folder", [
    ("checkpoint.folder", "B/checkpoint"),
    ("metrics.save_tb_folder", "B/tb"),
])
def test_a_folder_another_job_writes_is_refused_whatever_path_leads_there(tmp_path, option, folder):
    from titanlike.train.trainer import TrainingError

    # Job A writes into B's folders through an absolute path; job B reaches them as its own.
    first = _trainer(tmp_path / "A", "--checkpoint.enable", "--metrics.enable_tensorboard",
                     f"--{option}", str(tmp_path / folder))
    try:
        with pytest.raises(TrainingError) as e:
            _trainer(tmp_path / "B", "--checkpoint.enable", "--metrics.enable_tensorboard")
        assert str(e.value).startswith(
            f"{option} {tmp_path / folder} is in use by another titanlike job (pid {os.getpid()} on "), e.value
        # Nothing of B's stays locked: once A is gone, B runs.
    finally:
        first.close()
    _trainer(tmp_path / "B", "--checkpoint.enable").close()


def test_an_output_folder_that_cannot_be_created_is_one_sentence(tmp_path):
    from titanlike.train.trainer import TrainingError

    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(TrainingError, match=rf"^job.dump_folder {tmp_path}/file/run cannot be created or used as a "
                                            r"folder \(Not a directory\)$"):
        _trainer(tmp_path / "file" / "run")


# ------------------------------------------------------------------ 2. a checkpoint of another family

FULL = ["--checkpoint.enable", "--checkpoint.no_last_save_model_only"]


@pytest.fixture(scope="module")
def qwen3_run(tmp_path_factory):
    """Two steps of Qwen3's debug model, a full checkpoint at step 2."""
    dump = tmp_path_factory.mktemp("qwen3")
    assert _main(*JOB, *FULL, "--model.name", "qwen3", "--job.dump_folder", str(dump)) == 0
    return dump


def test_a_checkpoint_of_another_family_is_refused_unless_a_partial_load_is_asked_for(qwen3_run, tmp_path, capsys,
                                                                                     caplog):
    folder = tmp_path / "ckpt"
    shutil.copytree(qwen3_run / "checkpoint", folder)
    resume = [*JOB, *FULL, "--training.steps", "3", "--job.dump_folder", str(tmp_path / "llama"),
              "--checkpoint.folder", str(folder)]
    assert _main(*resume) == 1
    assert _last_line(capsys.readouterr().err) == (
        f"training error: checkpoint {folder}/step-2 holds a qwen3 debugmodel model but this job's is llama3 "
        "debugmodel (model.name, model.flavor): loading it would drop or misread weights; resume it with its own "
        "model, or pass --checkpoint.allow_partial_load to load only the tensors the two models share")
    # A sidecar that names this family (an older or edited one): the extra tensors give it away.
    from faults import reseal

    info = json.loads((folder / "step-2" / "titanlike.json").read_text())
    info["model"] = {"name": "llama3", "args": info["model"]["args"]}
    (folder / "step-2" / "titanlike.json").write_text(json.dumps(info))
    reseal(str(folder / "step-2"))
    assert _main(*resume) == 1
    assert _last_line(capsys.readouterr().err) == (
        f"training error: checkpoint {folder}/step-2 holds 16 model tensor(s) this job's model does not have (e.g. "
        "layers.0.attention.k_norm.weight, layers.0.attention.q_norm.weight, layers.1.attention.k_norm.weight); was "
        "it written for another model? pass --checkpoint.allow_partial_load to load only the tensors the two models "
        "share")
    # Asked for: the shared tensors load, the rest is named.
    with caplog.at_level("WARNING", logger="titanlike"):
        assert _main(*resume, "--checkpoint.allow_partial_load") == 0
    assert "16 model tensor(s) of" in caplog.text


# ------------------------------------------------------------------ 3. nothing a checkpoint records leads out of it


def _convert_dcp_to_hf(*args: str) -> int:
    sys.path.insert(0, str(REPO / "scripts"))
    import convert_dcp_to_hf

    return convert_dcp_to_hf.main(list(args))


def _edit_sidecar(step: Path, edit) -> None:
    """Change a checkpoint's sidecar as an attacker can: checksums resealed, then the JSON edited."""
    from faults import reseal

    info = json.loads((step / "titanlike.json").read_text())
    info["tokenizer"] = {}  # (resealing would store a tokenizer it names by path)
    (step / "titanlike.json").write_text(json.dumps(info))
    reseal(str(step))
    info = json.loads((step / "titanlike.json").read_text())
    edit(info)
    (step / "titanlike.json").write_text(json.dumps(info))


def test_a_checkpoint_stores_its_tokenizer_and_no_recorded_path_is_followed(qwen3_run, tmp_path, capsys):
    step = tmp_path / "step-2"
    shutil.copytree(qwen3_run / "checkpoint" / "step-2", step)
    info = json.loads((step / "titanlike.json").read_text())
    assert info["tokenizer"]["files"] == ["tokenizer.tiktoken"] and "path" not in info["tokenizer"]
    assert "tokenizer.tiktoken" in info["checksums"]["crc32"]
    assert _convert_dcp_to_hf(str(step), str(tmp_path / "hf")) == 0
    assert "tokenizer: tokenizer.json and tokenizer_config.json from " in capsys.readouterr().out

    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-LINE\n")
    (step / "tokenizer.tiktoken").unlink()

    def by_path(info):
        info["tokenizer"] = {"bos_id": 1, "eos_id": 2, "path": str(secret)}

    _edit_sidecar(step, by_path)
    assert _convert_dcp_to_hf(str(step), str(tmp_path / "out")) == 0
    err = capsys.readouterr().err
    assert "SECRET" not in err and not (tmp_path / "out" / "tokenizer.tiktoken").exists()
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "generation_config.json",
                                                    "model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    assert f"the checkpoint names its tokenizer by a path outside itself ({secret}), which is not read" in err

    # A link inside the checkpoint is not followed either, listed in the checksums or not.
    os.symlink(secret, step / "tokenizer.tiktoken")

    def by_link(info):
        info["tokenizer"] = {"bos_id": 1, "eos_id": 2, "files": ["tokenizer.tiktoken"]}
        del info["checksums"]["crc32"]["tokenizer.tiktoken"]

    _edit_sidecar(step, by_link)
    assert _convert_dcp_to_hf(str(step), str(tmp_path / "out")) == 0
    err = capsys.readouterr().err
    assert "SECRET" not in err and not (tmp_path / "out" / "tokenizer.tiktoken").exists()
    assert "tokenizer file 'tokenizer.tiktoken' is not a plain file inside" in err
    (step / "tokenizer.tiktoken").unlink()
    _edit_sidecar(step, lambda info: info["tokenizer"].update(files=["../secret.txt"]))
    assert _convert_dcp_to_hf(str(step), str(tmp_path / "out")) == 0
    assert "tokenizer file '../secret.txt' is not a plain file inside" in capsys.readouterr().err
    # The index or the checksums naming a file outside the checkpoint: refused.
    _edit_sidecar(step, lambda info: info["checksums"]["crc32"].update({"../secret.txt": "00000000"}))
    assert _convert_dcp_to_hf(str(step), str(tmp_path / "out")) == 1
    assert _last_line(capsys.readouterr().err) == (
        f"convert_dcp_to_hf: checkpoint {step}: titanlike.json names '../secret.txt', which is not a plain file of "
        "the checkpoint")


# ------------------------------------------------------------------ 4. checksums cannot be switched off


def test_a_checkpoint_without_its_sidecar_is_refused_and_the_fallback_still_works(tmp_path, capsys):
    from faults import flip_two_bytes

    dump = tmp_path / "run"
    job = [*JOB, *FULL, "--checkpoint.interval", "1", "--job.dump_folder", str(dump)]
    assert _main(*job) == 0
    folder = dump / "checkpoint"
    flip_two_bytes(str(folder / "step-2"), "model.tok_embeddings.weight")
    (folder / "step-2" / "titanlike.json").unlink()
    capsys.readouterr()
    assert _main(*job, "--training.steps", "3") == 1
    assert _last_line(capsys.readouterr().err) == (
        f"training error: checkpoint {folder}/step-2 has no titanlike.json, but its index says titanlike checkpoint "
        "format 2 wrote it, which records every file's checksum there: its files cannot be verified; the newest "
        f"checkpoint that verifies is {folder}/step-1: resume from it with --checkpoint.load_step 1 or "
        "--checkpoint.fallback_on_corruption")
    assert _main(*job, "--training.steps", "3", "--checkpoint.fallback_on_corruption") == 0
    # A model-only export (its index is marked too): the converter, told the model, refuses it.
    (folder / "step-3" / "titanlike.json").unlink()
    capsys.readouterr()
    assert _convert_dcp_to_hf(str(folder / "step-3"), str(tmp_path / "hf"), "--flavor", "debugmodel",
                              "--vocab-size", "2048") == 1
    assert _last_line(capsys.readouterr().err) == (
        f"convert_dcp_to_hf: checkpoint {folder}/step-3 has no titanlike.json, but its index says titanlike "
        "checkpoint format 2 wrote it, which records every file's checksum there: its files cannot be verified")
