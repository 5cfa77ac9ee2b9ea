"""Every command-line entry point answers -h / --help: exit 0, its own options on stdout, no traceback.

The entry points are found here, not listed: every scripts/*.py and estimation/*.py with an
`if __name__ == "__main__":` block, and every shell script in scripts/ (a `#!...sh` first line).
A script's own options are the `--options` and argparse positionals its source names, and for a
shell script the environment settings it reads with a default (`${NAME:-...}`); train.py's job
options (`--<section>.key`) do not count, so a script that only prints train.py's help fails.
Python entry points run in this process (runpy as __main__, argv and stdout swapped; torch is
imported once), shell scripts under bash in parallel threads; once per entry point and flag, in one
module-scoped fixture.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
import os
import re
import runpy
import subprocess
import traceback
import sys
from pathlib import Path

import pytest

from titanlike.config import JobConfig

REPO = Path(__file__).resolve().parents[2]
# -h is argparse's own alias of --help (the shell scripts test both in one case statement); checking
# --help alone halves the cost (each run imports torch).
FLAGS = ("--help",)
_MAIN = re.compile(r"""^if __name__ == ["']__main__["']:""", re.M)
_SHEBANG_SH = re.compile(r"#!.*\b(ba|z|da|k)?sh\b")
_OPTION = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*(?:\.[\w-]+)?")
_POSITIONAL = re.compile(r"""add_argument\(\s*["']([A-Za-z]\w*)["']""")
_ENV_SETTING = re.compile(r"\$\{([A-Z][A-Z0-9_]*):[-=]")
# train.py's option sections, and the `--section.key` placeholder of its usage line.
_JOB_SECTIONS = {f.name for f in dataclasses.fields(JobConfig)} | {"section"}


def _is_shell(path: Path) -> bool:
    with open(path, "rb") as f:
        return bool(_SHEBANG_SH.match(f.readline().decode(errors="replace")))


def entry_points() -> list[Path]:
    python = [p for folder in ("scripts", "estimation") for p in sorted((REPO / folder).glob("*.py"))
              if _MAIN.search(p.read_text())]
    shell = [p for p in sorted((REPO / "scripts").iterdir()) if p.is_file() and p.suffix != ".py" and _is_shell(p)]
    return python + shell


def own_options(path: Path) -> set[str]:
    text = path.read_text()
    options = {o for o in _OPTION.findall(text)
               if o != "--help" and not ("." in o and o[2:].split(".")[0] in _JOB_SECTIONS)}
    options |= set(_POSITIONAL.findall(text))
    if _is_shell(path):
        options |= set(_ENV_SETTING.findall(text))
    return options


ENTRY_POINTS = entry_points()


def _run_shell(path: Path, flag: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        return subprocess.run(["bash", str(path), flag], cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        return subprocess.CompletedProcess(e.cmd, -1, out, f"timed out after {e.timeout} s")


def _run_python(path: Path, flag: str) -> subprocess.CompletedProcess:
    """The script as `python path flag` runs it, in this process: argparse's help exits by SystemExit."""
    stdout, stderr, code = io.StringIO(), io.StringIO(), 0
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(path), flag]
    sys.path.insert(0, str(path.parent))  # as `python path` puts the script's folder first
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        stderr.write(traceback.format_exc())
        code = 1
    finally:
        sys.argv, sys.path[:] = saved_argv, saved_path
    return subprocess.CompletedProcess([sys.executable, str(path), flag], code, stdout.getvalue(), stderr.getvalue())


@pytest.fixture(scope="module")
def help_runs() -> dict[tuple[str, str], subprocess.CompletedProcess]:
    jobs = [(p, flag) for p in ENTRY_POINTS for flag in FLAGS]
    shell = [job for job in jobs if _is_shell(job[0])]
    with concurrent.futures.ThreadPoolExecutor(max_workers=(os.cpu_count() or 2) + 2) as pool:
        pending = {job: pool.submit(_run_shell, *job) for job in shell}
        done = {job: _run_python(*job) for job in jobs if job not in pending}
        done.update({job: future.result() for job, future in pending.items()})
    return {(str(p.relative_to(REPO)), flag): done[p, flag] for p, flag in jobs}


def test_entry_points_are_found():
    names = {str(p.relative_to(REPO)) for p in ENTRY_POINTS}
    assert {"scripts/bench.py", "estimation/estimate.py", "scripts/multinode_train.sh"} <= names


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("path", ENTRY_POINTS, ids=lambda p: str(p.relative_to(REPO)))
def test_help(path: Path, flag: str, help_runs):
    name = str(path.relative_to(REPO))
    proc = help_runs[name, flag]
    out = f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    assert proc.returncode == 0, f"{name} {flag} exited {proc.returncode}\n{out}"
    assert "Traceback" not in proc.stdout + proc.stderr, f"{name} {flag}\n{out}"
    options = own_options(path)
    assert options, f"{name} names no options in its source, so its help cannot be checked"
    assert any(o in proc.stdout for o in options), (
        f"{name} {flag}: stdout names none of its own options ({', '.join(sorted(options))})\n{out}")
