"""The whole chain of imports beneath the model registry (issue 41 item 6), in a fresh interpreter: a
process of its own, so that nothing this test process imported before counts
(tests/unit/test_model_imports.py checks each file's own imports)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What importing the model registry must not load.
NOT_LOADED = ("titanlike.objectives", "titanlike.data", "titanlike.parallel", "titanlike.train", "titanlike.checkpoint")


def _under(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == root or module.startswith(root + ".") for root in roots)


def test_importing_the_model_registry_loads_nothing_above_the_models():
    """The whole chain, not only direct imports: a fresh interpreter imports the registry, then every
    family (model_names), and lists what it loaded."""
    code = ("import sys, titanlike.models.registry as r; print(' '.join(sorted(sys.modules))); r.model_names(); "
            "print(' '.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO).stdout.splitlines()
    for when, loaded in zip(("importing titanlike.models.registry", "importing every family"), out):
        wrong = sorted(m for m in loaded.split() if _under(m, NOT_LOADED))
        assert wrong == [], f"{when} loads {', '.join(wrong)}"
    assert "titanlike.models.llama3" in out[1].split()  # the families did load
