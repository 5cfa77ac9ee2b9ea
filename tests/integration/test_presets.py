"""Every preset in train_configs/ starts as a user starts it (issue 45): train.py's main with the
pre-flight checks installed packages register (the estimator's memory check).

The debug presets (`*_debug.toml`, `debug_model.toml`) train two real steps here. The others name GPUs:
each is validated (`--job.validate_only`) as rank 0 of the world its `job.description` names
("(8 GPUs)"), on the H100 its header names (80 GiB for the memory check). What a checkout lacks (a
tokenizer, a Hugging Face folder, a dataset, an earlier stage's checkpoint) is stood in for by a
small file of the same kind, so that a preset is refused only for what it says itself.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from conftest import REPO, read_metrics, train_here

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PRESETS = sorted(glob.glob(str(REPO / "train_configs" / "*.toml")))
GiB = 2**30
DEBUG_VOCAB = 2048  # titanlike/data/assets/debug_tokenizer.tiktoken, what a preset without its tokenizer uses


def _debug(path: str) -> bool:
    return "debug" in Path(path).stem  # *_debug.toml, debug_model.toml, qwen3_debug_moe.toml


def _preset_id(path: str) -> str:
    return Path(path).stem


@pytest.fixture(autouse=True)
def _at_repo_root(monkeypatch):
    # Presets name their files relative to the repository root, where the README runs them.
    monkeypatch.chdir(REPO)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """The teacher distill_debug.toml's header says to make first (a few steps of debugmodel_tiny)."""
    dump = tmp_path_factory.mktemp("teacher")
    os.chdir(REPO)
    run = train_here(["--job.config_file", "train_configs/debug_model.toml", "--model.flavor", "debugmodel_tiny",
                      "--training.seq_len", "64", "--training.steps", "1", "--job.dump_folder", str(dump),
                      "--metrics.no_enable_tensorboard", "--checkpoint.last_save_model_only"])
    assert run.returncode == 0, run.stderr[-3000:]
    return dump / "checkpoint"


@pytest.mark.parametrize("preset", [p for p in PRESETS if _debug(p)], ids=_preset_id)
def test_a_debug_preset_trains_two_steps(preset, tmp_path, teacher):
    argv = ["--job.config_file", preset, "--job.dump_folder", str(tmp_path / "run"), "--training.steps", "2",
            "--metrics.log_freq", "1", "--metrics.enable_jsonl", "--metrics.no_enable_tensorboard",
            "--checkpoint.no_enable", "--validation.no_enable"]
    cfg = tomllib.loads(Path(preset).read_text())
    if cfg.get("training", {}).get("objective") == "distill":
        argv += ["--distill.teacher", str(teacher)]
    run = train_here(argv, checks=None)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "pre-flight check" not in run.stderr, run.stderr[-2000:]  # the memory check ran, not skipped
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2]


def _world(cfg: dict, preset: str) -> int:
    found = re.search(r"\((\d+) GPUs?\)", cfg.get("job", {}).get("description", ""))
    assert found, f"{preset}: job.description names no world, e.g. \"... (8 GPUs)\" (this test validates it there)"
    return int(found.group(1))


def _hf_folder(folder: Path, name: str, flavor: str, vocab_size: int | None = None) -> Path:
    """A Hugging Face folder of the flavor's config.json (vocab_size: another vocabulary), the test
    tokenizer and no tensors."""
    import dataclasses

    from safetensors.torch import save_file

    from titanlike.models.registry import get_model_spec

    spec = get_model_spec(name)
    folder.mkdir()
    args = spec.flavors[flavor]
    args = args if vocab_size is None else dataclasses.replace(args, vocab_size=vocab_size)
    (folder / "config.json").write_text(json.dumps(spec.hf.args_to_config(args)))
    save_file({}, str(folder / "model.safetensors"))
    for f in (REPO / "tests" / "assets" / "tokenizer").glob("tokenizer*.json"):
        shutil.copy(f, folder / f.name)
    return folder


def _stand_ins(cfg: dict, root: Path) -> list[str]:
    """Overrides replacing each file or folder the preset names that this checkout lacks."""
    model, training = cfg.get("model", {}), cfg.get("training", {})
    argv: list[str] = []
    if model.get("tokenizer_path") and not os.path.exists(model["tokenizer_path"]):
        argv += ["--model.tokenizer_path", ""]  # the debug tokenizer
    hf = model.get("hf_assets_path")
    if hf and not os.path.exists(hf):
        argv += ["--model.hf_assets_path", str(_hf_folder(root / "hf", model["name"], model["flavor"]))]
    path = training.get("dataset_path")
    if path and not os.path.exists(path):
        # Conversations (SFT), or prompts with an answer column (GRPO's rewards read it).
        data = ("grpo", "addition.jsonl") if training.get("objective") == "grpo" else ("sft", "reverse_words.jsonl")
        argv += ["--training.dataset_path", str(REPO / "tests" / "assets" / data[0] / data[1])]
    initial = cfg.get("checkpoint", {}).get("initial_load_path")
    if initial and not os.path.exists(initial):
        dcp = root / "dcp"
        dcp.mkdir(exist_ok=True)
        (dcp / ".metadata").write_bytes(b"")
        argv += ["--checkpoint.initial_load_path", str(dcp)]
    teacher = cfg.get("distill", {}).get("teacher")
    if teacher and not os.path.exists(teacher):
        # The teacher is a larger flavor of the student's family (its header names it); the flavor
        # only sizes the stand-in, which validate_only never loads.
        argv += ["--distill.teacher", str(_hf_folder(root / "teacher", model["name"], model["flavor"],
                                                            vocab_size=DEBUG_VOCAB))]
    return argv


@pytest.mark.parametrize("preset", [p for p in PRESETS if not _debug(p)], ids=_preset_id)
def test_a_gpu_preset_validates_on_the_world_it_names(preset, tmp_path, monkeypatch):
    import estimation.fits as fits

    cfg = tomllib.loads(Path(preset).read_text())
    world = _world(cfg, preset)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(min(world, 8)))
    monkeypatch.setattr(fits, "machine_memory", lambda: (80 * GiB, "an 80 GiB H100 has"))
    argv = ["--job.config_file", preset, "--job.validate_only", "--job.dump_folder", str(tmp_path / "run"),
            *_stand_ins(cfg, tmp_path)]
    if cfg.get("float8") is not None or "float8" in cfg.get("model", {}).get("converters", []):
        argv.append("--float8.emulate")  # its SM 8.9 check looks at this machine, which has no H100
    run = train_here(argv, checks=None)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"on world size {world} is valid" in run.stderr
    assert "pre-flight check" not in run.stderr, run.stderr[-2000:]  # the memory check ran, not skipped
