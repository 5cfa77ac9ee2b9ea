"""The docs say what the repository holds: the README's Layout section names every package and test
folder, and no docstring or comment cites a repository file that does not exist."""

import glob
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _layout_section() -> str:
    readme = (REPO / "README.md").read_text()
    start = readme.index("\n## Layout\n")
    end = readme.find("\n## ", start + 1)
    return readme[start:end if end != -1 else None]


def _packages(folder: Path) -> list[str]:
    return sorted(p.parent.name for p in folder.glob("*/__init__.py"))


def test_readme_layout_names_every_package_family_and_test_folder():
    layout = _layout_section()
    missing = [f"titanlike/{name}" for name in _packages(REPO / "titanlike")
               if not re.search(rf"titanlike/{name}\b", layout)]
    missing += [f"titanlike/models/{name}/" for name in _packages(REPO / "titanlike" / "models")
                if not re.search(rf"(?<![\w/]){name}/", layout)]
    missing += [f"tests/{p.name}" for p in sorted((REPO / "tests").iterdir())
                if p.is_dir() and any(p.glob("test_*.py")) and f"tests/{p.name}" not in layout]
    assert not missing, f"README.md's Layout section does not name {', '.join(missing)}"


# A path in the repository as a docstring or comment cites it: under one of the top-level folders, with a
# file name's extension (a folder's bare name, like docs/s in "docs/s and tokens/s", is not a citation).
# Braces ({to,from}) and globs (test_model_protocol*.py) are expanded.
_CITED = re.compile(r"(?<![\w./-])((?:titanlike|estimation|tests|docs|scripts|train_configs|shared)/[\w./{},*-]*[\w}*])")
# What another project holds under the same folder names: a path right after its name ("torchtitan's
# scripts/..."), within a few words, is that project's.
_OTHER_PROJECT = re.compile(r"(torchtitan|megatron|transformers|trl|peft|lm-eval|vllm|picotron|nanogpt)'s\W+(\w+\W+){0,2}$",
                            re.IGNORECASE)


def _expand(path: str) -> list[str]:
    match = re.search(r"\{([^{}]*)\}", path)
    if match is None:
        return [path]
    return [p for alt in match.group(1).split(",") for p in _expand(path[:match.start()] + alt + path[match.end():])]


def _cited_paths(text: str):
    for match in _CITED.finditer(text):
        path = match.group(1)
        if "." not in Path(path).name:  # a folder: not a file citation
            continue
        if _OTHER_PROJECT.search(text[max(0, match.start() - 60):match.start()]):
            continue
        yield text.count("\n", 0, match.start()) + 1, path


def test_every_cited_repository_path_exists():
    missing = []
    for root in ("titanlike", "estimation", "scripts"):
        for file in sorted((REPO / root).rglob("*")):
            if file.suffix not in (".py", ".sh", ".sbatch", ".md", ".toml") or "__pycache__" in file.parts:
                continue
            for line, path in _cited_paths(file.read_text()):
                if not any(glob.glob(str(REPO / p)) for p in _expand(path)):
                    missing.append(f"{file.relative_to(REPO)}:{line} cites {path}")
    assert not missing, "cited files the repository does not hold:\n" + "\n".join(missing)


def test_the_citation_scan_sees_what_it_must():
    text = ("see titanlike/train/step.py and tests/unit/test_{a,b}.py; docs/s and tokens/s;\n"
            "torchtitan's scripts/checkpoint_conversion/convert_to_hf.py; shared/design.md")
    assert [p for _, p in _cited_paths(text)] == ["titanlike/train/step.py", "tests/unit/test_{a,b}.py",
                                                   "shared/design.md"]
    assert _expand("tests/unit/test_{a,b}.py") == ["tests/unit/test_a.py", "tests/unit/test_b.py"]
