"""The README's LLaVA commands run as a user runs them after the demo (issue 45.5): stage 1 in its own dump
folder trains; pointed at the demo's outputs/ (a Llama checkpoint) it is refused with the cross-family
sentence a resume gives, not declared "nothing to train"; stage 2 with LoRA runs on plain tar shards,
and with --validation.enable on the folder the README's `energon prepare` made. Each command is the
README's own text, shortened to 2 steps, with the repository's paths made absolute and path/to/shards
a folder of generated shards."""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys

import pytest

from conftest import REPO, _env
from image_text_checks import png, write_shard


def _llava_commands() -> list[list[str]]:
    """The README LLaVA section's train.py and energon commands, each as argv."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Vision-language models (LLaVA)", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    text = re.sub(r"\\\n\s*", "", block)
    return [shlex.split(line) for line in text.splitlines()
            if line.startswith(("python3 train.py", "energon prepare"))]


def _run(argv: list[str], cwd, shards: str = "", tensorboard: bool = False) -> subprocess.CompletedProcess:
    argv = [a.replace("path/to/shards", shards) for a in argv]
    if argv[:2] == ["python3", "train.py"]:
        argv = [sys.executable, str(REPO / "train.py"), *argv[2:]]
        argv = [str(REPO / a) if a.startswith("train_configs/") else a for a in argv]
        argv[argv.index("--training.steps") + 1] = "2"
        argv += ["--training.local_batch_size", "2"] + ([] if tensorboard else ["--metrics.no_enable_tensorboard"])
    return subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=600)


def _demo_checkpoint(cwd) -> None:
    """What the demo leaves in ./outputs: a Llama debugmodel's final model at step 20."""
    import torch

    from titanlike.checkpoint.format import model_description
    from titanlike.checkpoint.hf import write_dcp_model
    from titanlike.models.registry import get_model_spec

    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors["debugmodel"], n_layers=1)
    with torch.device("meta"):
        model = spec.model_cls(args)
    state = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in model.state_dict().items()}
    description = model_description("llama3", args, flavor="debugmodel")
    write_dcp_model(state, str(cwd / "outputs" / "checkpoint" / "step-20"),
                    {"contents": "model_only", "step": 20, "model": description})


def test_readme_llava_stage_1_after_the_demo(tmp_path):
    from titanlike.checkpoint.format import published_steps

    _demo_checkpoint(tmp_path)
    assert published_steps(str(tmp_path / "outputs" / "checkpoint")) == [20]
    stage1 = _llava_commands()[0]
    assert "vision_tower,language_model" in stage1 and "--job.dump_folder" in stage1
    proc = _run(stage1, tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (tmp_path / "outputs" / "llava" / "checkpoint" / "step-2").is_dir()

    # Without a dump folder of its own, the demo's Llama checkpoint is refused, not a finished run.
    at = stage1.index("--job.dump_folder")
    proc = _run(stage1[:at] + stage1[at + 2:], tmp_path, tensorboard=True)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "nothing to train" not in out, out[-4000:]
    assert "holds a llama3 debugmodel model but this job's is llava debugmodel (model.name, model.flavor)" in out, \
        out[-4000:]
    # No empty TensorBoard run left behind (the folder keeps only its job lock, observe/run_lock.py).
    assert not [p for p in (tmp_path / "outputs" / "tb").iterdir() if p.is_dir()]


@pytest.mark.skipif(not __import__("shutil").which("energon"), reason="megatron-energon's `energon` is not installed")
def test_readme_llava_stage_2_on_tar_shards_then_validated(tmp_path):
    shards = tmp_path / "shards"
    shards.mkdir()
    for part in range(2):
        members = {}
        for i in range(20):
            members[f"s{part}_{i:03d}.jpg"] = png((i * 11 % 256, 40 * part, 200))
            members[f"s{part}_{i:03d}.txt"] = f"a square of colour {i}".encode()
        write_shard(shards / f"part-{part}.tar", members)
    plain, prepare, validated = _llava_commands()[1:4]
    assert prepare[:2] == ["energon", "prepare"] and "--validation.enable" in validated
    proc = _run(plain, tmp_path, str(shards))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    proc = _run(prepare, tmp_path, str(shards))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    proc = _run(validated, tmp_path, str(shards))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert re.search(r"validation.*loss", out), out[-4000:]
