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
import subprocess
import sys
from pathlib import Path

import pytest

import titanlike.models

MODELS = Path(titanlike.models.__file__).parent
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
# What importing the model registry must not load (a subprocess, so that nothing this test process
# imported before counts).
NOT_LOADED = ("titanlike.objectives", "titanlike.data", "titanlike.parallel", "titanlike.train", "titanlike.checkpoint")


def _under(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == root or module.startswith(root + ".") for root in roots)


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def titanlike_imports(path: Path, source: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of every titanlike module the file (or `source` in its place) imports, at file
    level or inside a function; relative imports resolved, `from package import name` counted as
    package.name (a name may be a submodule), the body of `if TYPE_CHECKING:` left out."""
    package = ".".join(path.relative_to(MODELS.parent.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found = []

    def visit(node: ast.AST) -> None:
        if _type_checking_only(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{parent}.{base}" if base else parent
            found.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text() if source is None else source, str(path)))
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


def test_importing_the_model_registry_loads_nothing_above_the_models():
    """The whole chain, not only direct imports: a fresh interpreter imports the registry, then every
    family (model_names), and lists what it loaded."""
    code = ("import sys, titanlike.models.registry as r; print(' '.join(sorted(sys.modules))); r.model_names(); "
            "print(' '.join(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=MODELS.parent.parent).stdout.splitlines()
    for when, loaded in zip(("importing titanlike.models.registry", "importing every family"), out):
        wrong = sorted(m for m in loaded.split() if _under(m, NOT_LOADED))
        assert wrong == [], f"{when} loads {', '.join(wrong)}"
    assert "titanlike.models.llama3" in out[1].split()  # the families did load


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
