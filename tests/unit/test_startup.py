"""Start-up (issue 45, item 13): `--help` imports only what it prints. train.py's help imports neither
its memory check (estimation/fits.py) nor the planner, and neither it nor titanlike-plan's imports
torch._dynamo or torch.distributed.tensor (with sympy); titanlike-eval's and titanlike-generate's import
no torch (lm-eval's parser and the titanlike model's lines; titanlike/inference/arguments.py's options).
Each runs in a fresh process, whose modules are the ones counted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, _env

pytestmark = pytest.mark.slow  # fresh interpreters

# Modules a command's --help has no use for, each a few tenths of a second of CPU or more.
HEAVY_FOR_HELP = {"torch.distributed.tensor", "torch.distributed.tensor.parallel", "torch.distributed.fsdp", "sympy"}


def _modules_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after `code` (which prints help to stdout)."""
    script = code + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)), file=sys.stderr)"
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout
    return set(json.loads(proc.stderr.strip().splitlines()[-1]))


def test_train_py_help_imports_no_memory_check_and_no_planner():
    modules = _modules_after("import train\ntrain.main(['--help'])")
    assert "estimation.fits" not in modules and "titanlike.train.plan" not in modules
    assert "titanlike.train.trainer" not in modules
    # torch._dynamo is about a second of CPU (docs/performance.md): the families' module-level
    # torch.compiler.disable waits for the first call (models/common/eager.py).
    assert "torch._dynamo" not in modules
    # torch.distributed.tensor (sympy with it) is about 0.6 s: the sharding styles build their
    # ParallelStyles at parallelize time (models/common/sharding.py), model code checks for DTensors
    # through models/common/dtensor.py.
    assert not modules & HEAVY_FOR_HELP, sorted(modules & HEAVY_FOR_HELP)


def test_titanlike_plan_help_imports_no_dynamo_and_no_probe():
    modules = _modules_after("import sys\nfrom estimation.plan import console_main\n"
                             "sys.argv = ['titanlike-plan', '--help']\ntry:\n    console_main()\n"
                             "except SystemExit:\n    pass")
    assert "torch._dynamo" not in modules and "estimation.probe" not in modules
    assert "titanlike.train.plan" not in modules
    assert not modules & HEAVY_FOR_HELP, sorted(modules & HEAVY_FOR_HELP)


def test_titanlike_eval_help_imports_no_torch():
    modules = _modules_after("from titanlike.cli.eval import main\nmain(['--help'])")
    assert "lm_eval" in modules and "torch" not in modules


def test_titanlike_generate_help_imports_no_torch():
    modules = _modules_after("import sys\nfrom titanlike.cli.generate import console_main\n"
                             "sys.argv = ['titanlike-generate', '--help']\ntry:\n    console_main()\n"
                             "except SystemExit:\n    pass")
    assert "titanlike.inference.arguments" in modules and "torch" not in modules


def test_eager_only_is_never_traced_like_torch_compiler_disable():
    """models/common/eager.py: a function made eager at its first call still runs outside the graph
    when a compiled function reaches it, first call included, as a torch.compiler.disable'd one."""
    import torch

    from titanlike.models.common.eager import eager_only

    seen = []

    @eager_only
    def outside(x):
        seen.append(torch.compiler.is_compiling())
        return x + 1

    compiled = torch.compile(lambda x: outside(x * 2) * 3, backend="eager")
    for n in (3, 3, 4):
        assert torch.equal(compiled(torch.ones(n)), torch.full((n,), 9.0))
    assert seen == [False, False, False]
