"""titanlike-eval as a user on a CPU machine walks it (issue 45): the README's local-task example runs
offline without `--device`, `--help` describes the `titanlike` model first, and lm-eval from Python
finds model="titanlike" once titanlike.inference.harness is imported."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import REPO
from lm_eval_assets import build_assets

lm_eval = pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_assets(tmp_path_factory.mktemp("lm_eval"))


def _readme_local_task() -> tuple[dict[str, str], list[str]]:
    """The README's local-task example: the files its heredocs write and titanlike-eval's arguments."""
    readme = (REPO / "README.md").read_text()
    block = readme[readme.index("mkdir -p my_tasks"):]
    block = block[:block.index("```")]
    files = {name: body for name, body in re.findall(r"cat > (\S+) <<'\w+'\n(.*?)\n\w+\n", block, re.S)}
    command = block[block.index("titanlike-eval"):].replace("\\\n", " ").split()
    return files, command[1:]


def test_the_readme_local_task_runs_offline_on_cpu_without_a_device(assets, tmp_path, monkeypatch, capsys):
    import lm_eval.tasks
    import torch

    from lm_eval_assets import offline
    from titanlike.cli.eval import main

    class LocalTasks(lm_eval.tasks.TaskManager):
        """The README's task only (lm-eval indexes its thousands of built-in tasks first, ~30 s here)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalTasks)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU machine, even on a GPU box
    offline(monkeypatch)
    files, argv = _readme_local_task()
    assert "--device" not in argv and set(files) == {"my_tasks/tiny.jsonl", "my_tasks/tiny.yaml"}
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_tasks").mkdir()
    for name, body in files.items():
        (tmp_path / name).write_text(body + "\n")
    argv = [a.replace("checkpoint=outputs/checkpoint", f"checkpoint={assets['hf']}") for a in argv]
    assert main([*argv, "--output_path", str(tmp_path / "out")]) == 0, capsys.readouterr().err[-3000:]
    (results,) = (tmp_path / "out").rglob("results_*.json")
    result = json.loads(results.read_text())
    assert 0 <= result["results"]["tiny"]["acc,none"] <= 1
    assert "checkpoint" in str(result["config"]["model_args"])


def test_help_describes_the_titanlike_model_before_lm_evals_help():
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "eval.py"), "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ours, theirs = proc.stdout.index("--model titanlike"), proc.stdout.index("usage:")
    assert ours < theirs
    head = proc.stdout[:theirs]
    for arg in ("checkpoint=", "tokenizer=", "dtype=", "max_length=", "max_gen_toks=", "add_bos_token=", "cpu"):
        assert arg in head, arg


def test_lm_eval_from_python_knows_the_model_once_the_harness_is_imported():
    # A fresh interpreter: the test process may have registered it through titanlike.cli.eval already.
    code = ("import lm_eval.api.registry as r\n"
            "assert 'titanlike' not in r.model_registry\n"
            "import titanlike.inference.harness as h\n"
            "assert r.get_model('titanlike') is h.TitanlikeLM\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]
