"""The README's first steps work on a fresh setup (issue 32 item 5): the base install reads torchtitan's
tokenizer.json folders, and the demo saves its final model so that the README's next command,
`scripts/generate.py outputs/checkpoint`, samples from it; the end-of-run summary says what was saved."""

from __future__ import annotations

import re
import subprocess
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from conftest import REPO, _env


def _base_dependencies() -> set[str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in deps}


def test_tokenizers_is_a_base_dependency():
    # torchtitan's TOMLs name a tokenizer.json folder (model.hf_assets_path), which `tokenizers` reads: after
    # `bash scripts/setup.sh` (no extras) they must load, as the README's torchtitan section says.
    assert {"tokenizers", "huggingface-hub"} <= _base_dependencies()


def test_readme_runs_the_demo_then_samples_from_its_checkpoint():
    # The first commands a reader meets: set up and train the demo, then sample from what it saved.
    readme = (REPO / "README.md").read_text()
    first_block = readme.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert first_block[0] == "bash scripts/setup.sh && python3 train.py --job.config_file train_configs/debug_model.toml"
    assert first_block[1].startswith("python3 scripts/generate.py outputs/checkpoint ")
    # and how long the demo and the suite take on a 2-core machine
    assert re.search(r"\| the demo .*\| \d+ min \d+ s", readme) and re.search(r"\| the test suite .*\| \d+ min \d+ s", readme)


def test_demo_saves_its_final_model_and_generate_samples_from_it(tmp_path):
    dump = tmp_path / "outputs"
    # The demo preset as the README runs it, shortened: no override of its [checkpoint] table.
    job = [sys.executable, str(REPO / "train.py"), "--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
           "--training.steps", "2", "--training.seq_len", "32", "--training.local_batch_size", "2",
           "--metrics.no_enable_tensorboard", "--job.dump_folder", str(dump)]
    proc = subprocess.run(job, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert (dump / "checkpoint" / "step-2").is_dir(), out[-4000:]
    summary = out[out.index("run summary:"):]
    assert (f"checkpoints:     {dump / 'checkpoint'} (latest: step-2, the model only; "
            f"sample: python scripts/generate.py {dump / 'checkpoint'})") in summary, summary

    gen = subprocess.run([sys.executable, str(REPO / "scripts" / "generate.py"), str(dump / "checkpoint"),
                          "--prompt", "In the beginning", "--max-new-tokens", "4"],
                         cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert gen.stdout.strip().startswith("In the beginning"), gen.stdout
