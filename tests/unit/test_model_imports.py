"""Model families stay independent: a family package imports itself and the shared model code only,
and the model code sits at the bottom of the package graph: it imports none of the packages that
apply it (objectives, data, parallel, train, checkpoint, inference, cli), so importing the registry
loads none of them.

Read from the source (ast), so every import counts, including one inside a function; one under
`if TYPE_CHECKING:` does not (it never runs). What one family shares with another lives in
titanlike/models/common/, which imports no family. A family names its objective by its registered
name (ModelSpec.objective), which titanlike/objectives/registry.py resolves.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

import titanlike.models

MODELS = Path(titanlike.models.__file__).parent
_spec = importlib.util.spec_from_file_location("import_graph", MODELS.parent.parent / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_graph)
SHARED = "common"
FAMILIES = sorted(p.name for p in MODELS.iterdir() if (p / "__init__.py").is_file() and p.name != SHARED)

# What a family may import from titanlike besides its own package: the shared model code and the
# contracts its spec fills (issue 26: the module-hook protocol, and the config loader's leaf package
# for a family's own config section).
ALLOWED_ROOTS = (
    "titanlike.models.common",
    "titanlike.models.args",
    "titanlike.models.outputs",
    "titanlike.models.registry",
    "titanlike.models.spec_types",
    "titanlike.models.protocol",
    "titanlike.config",
)
# The packages that apply the models: nothing under titanlike/models imports them.
APPLIERS = ("titanlike.objectives", "titanlike.parallel", "titanlike.train", "titanlike.data", "titanlike.checkpoint",
            "titanlike.inference", "titanlike.cli")


def _under(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == root or module.startswith(root + ".") for root in roots)


def titanlike_imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of every titanlike module the file (or `source` in its place) imports, at file
    level or inside a function; relative imports resolved, `from package import name` counted as
    package.name (a name may be a submodule), the body of `if TYPE_CHECKING:` left out (the scanner of
    scripts/import_graph.py)."""
    found = import_graph.imports_of(path, MODELS.parent.parent, source=source)
    return [(line, module) for line, module in found if _under(module, ("titanlike",))]


def test_every_family_folder_is_found():
    assert {"llama3", "qwen3", "mixtral", "deepseek_v3"} <= set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_family_imports_only_itself_and_the_shared_model_code(family):
    own = (f"titanlike.models.{family}",)
    wrong = [f"{path.relative_to(MODELS)}:{line} imports {module}"
             for path in sorted((MODELS / family).rglob("*.py"))
             for line, module in titanlike_imports(path)
             if not _under(module, own + ALLOWED_ROOTS)]
    assert wrong == [], "a family imports only its own package and " + ", ".join(ALLOWED_ROOTS)


@pytest.mark.parametrize("family", FAMILIES)
def test_only_the_package_builds_from_the_hf_adapter(family):
    """The adapter reads the model's args; the model knows nothing of Hugging Face (no import cycle)."""
    adapter = f"titanlike.models.{family}.hf_adapter"
    wrong = [f"{path.relative_to(MODELS)}:{line} imports {module}"
             for path in sorted((MODELS / family).rglob("*.py")) if path.name not in ("__init__.py", "hf_adapter.py")
             for line, module in titanlike_imports(path) if _under(module, (adapter,))]
    assert wrong == []


def test_shared_model_code_imports_no_family():
    shared = [*sorted((MODELS / SHARED).rglob("*.py")), *sorted(MODELS.glob("*.py"))]
    families = tuple(f"titanlike.models.{family}" for family in FAMILIES)
    wrong = [f"{path.relative_to(MODELS)}:{line} imports {module}"
             for path in shared for line, module in titanlike_imports(path) if _under(module, families)]
    assert wrong == []


def test_model_code_imports_none_of_the_packages_that_apply_it():
    wrong = [f"{path.relative_to(MODELS)}:{line} imports {module}"
             for path in sorted(MODELS.rglob("*.py")) for line, module in titanlike_imports(path)
             if _under(module, APPLIERS)]
    assert wrong == []


def test_the_scan_sees_relative_and_nested_imports():
    source = "import torch\nfrom .hf_adapter import KEYS\ndef f():\n    from titanlike.models import qwen3\n"
    assert titanlike_imports(MODELS / "llama3" / "model.py", source) == [
        (2, "titanlike.models.llama3.hf_adapter.KEYS"), (4, "titanlike.models.qwen3")]


def test_the_scan_leaves_out_type_checking_blocks_only():
    source = ("from typing import TYPE_CHECKING\nimport typing\n"
              "if TYPE_CHECKING:\n    from titanlike.data import loader\n"
              "else:\n    from titanlike.train import step\nif typing.TYPE_CHECKING:\n    import titanlike.parallel\n"
              "class A:\n    def f(self):\n        import titanlike.objectives.sft\n")
    assert titanlike_imports(MODELS / "registry.py", source) == [(6, "titanlike.train.step"),
                                                                 (11, "titanlike.objectives.sft")]
