"""Print the import graph of titanlike's packages: each package and the packages it imports.

    python scripts/import_graph.py                     # titanlike/*: package -> packages it imports
    python scripts/import_graph.py --cycles            # also the module-level cycles (titanlike, estimation)
    python scripts/import_graph.py --file-level        # leave out imports inside functions

Read from the source (ast), so an import inside a function counts unless --file-level is given;
imports under `if TYPE_CHECKING:` never count (they do not run). A package is a folder directly
under titanlike/ (models, objectives, data, ...); an edge to itself is left out.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def module_name(path: Path, root: Path = REPO) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path = REPO, file_level: bool = False,
               source: str | None = None) -> list[tuple[int, str]]:
    """(line, module) of every import the file (or `source` in its place) runs: relative imports
    resolved, `from a import b` counted as a.b (b may be a submodule), TYPE_CHECKING blocks skipped,
    and function bodies skipped when `file_level`."""
    package = module_name(path, root)
    if path.name != "__init__.py":
        package = package.rpartition(".")[0]
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if file_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
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
    return found


def module_graph(roots: tuple[str, ...], file_level: bool = False) -> dict[str, set[str]]:
    """module -> the modules of `roots` it imports (`a.b.name` resolved to the longest known module)."""
    files = {module_name(p): p for r in roots for p in sorted((REPO / r).rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for _, imported in imports_of(path, file_level=file_level):
            while imported and imported not in files:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                targets.add(imported)
        graph[name] = targets
    return graph


def package_of(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (len(parts) == 2 and module in _PACKAGES) else parts[0]


_PACKAGES = {f"titanlike.{p.name}" for p in (REPO / "titanlike").iterdir() if (p / "__init__.py").is_file()}


def package_graph(file_level: bool = False) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for module, targets in module_graph(("titanlike",), file_level).items():
        source = package_of(module)
        graph[source] |= {package_of(t) for t in targets} - {source}
    return dict(graph)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for node in sorted(graph):
        if node not in index:
            connect(node)
    return sorted(found)


def short(name: str) -> str:
    return name.removeprefix("titanlike.") if name != "titanlike" else name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file-level", action="store_true",
                        help="count only imports at file level, not those inside functions")
    parser.add_argument("--cycles", action="store_true",
                        help="also print the cycles between packages and between modules "
                             "(titanlike and estimation)")
    args = parser.parse_args(argv)

    graph = package_graph(args.file_level)
    for package in sorted(graph):
        print(f"{short(package):12} -> {', '.join(sorted(short(t) for t in graph[package])) or '-'}")
    if args.cycles:
        print("\npackage cycles:")
        for component in cycles(graph) or [["none"]]:
            print("  " + " <-> ".join(short(p) for p in component))
        print("\nmodule cycles:")
        for component in cycles(module_graph(("titanlike", "estimation"), args.file_level)) or [["none"]]:
            print(f"  ({len(component)}) " + " <-> ".join(short(m) for m in component))
    return 0


if __name__ == "__main__":
    sys.exit(main())
