"""Start-up of the commands' --help, in fresh processes: modules imported and their cumulative import time
(`python -X importtime`), wall and CPU time (min of --rounds).

    python scripts/bench_help.py [--rounds 3] [--before OTHER_CHECKOUT]

With --before, the same commands run from another checkout too (e.g. a worktree of main), interleaved
with this one's, so that both see the same load. CPU time (user + sys) moves less than wall time on a
shared machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

COMMANDS = {
    "python3 train.py --help": ["train.py", "--help"],
    "titanlike-plan --help": ["-c", "import sys; sys.argv = ['titanlike-plan', '--help']\n"
                              "from estimation.plan import console_main; console_main()"],
    "titanlike-generate --help": ["-c", "import sys; sys.argv = ['titanlike-generate', '--help']\n"
                                  "from titanlike.cli.generate import console_main; console_main()"],
    "titanlike-eval --help": ["-c", "import sys; sys.argv = ['titanlike-eval', '--help']\n"
                              "from titanlike.cli.eval import console_main; console_main()"],
}


def run(tree: Path, args: list[str], *, importtime: bool = False) -> tuple[float, float, str]:
    """(wall seconds, CPU seconds, stderr) of one fresh interpreter running args in tree."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    proc = subprocess.run([sys.executable, *(["-X", "importtime"] if importtime else []), *args], cwd=tree, env=env,
                          capture_output=True, text=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, proc.stderr


def imports(stderr: str) -> tuple[int, float]:
    """(modules imported, seconds of the top-level imports' cumulative time) from -X importtime's lines."""
    rows = [line.split("|") for line in stderr.splitlines() if line.startswith("import time:") and "[us]" not in line]
    top = [int(r[1]) for r in rows if r[2].startswith(" ") and not r[2].startswith("  ")]
    return len(rows), sum(top) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", type=Path, help="another checkout to measure the same way, first")
    args = parser.parse_args()
    trees = ([("before", args.before.resolve())] if args.before else []) + [("this", REPO)]
    for name, command in COMMANDS.items():
        found = {label: (imports(run(tree, command, importtime=True)[2]), [], []) for label, tree in trees}
        for _ in range(args.rounds):
            for label, tree in trees:
                wall, cpu, _ = run(tree, command)
                found[label][1].append(wall)
                found[label][2].append(cpu)
        for label, ((count, seconds), walls, cpus) in found.items():
            print(f"{name:28s} {label:6s} imports {count:5d}  importtime {seconds:5.2f} s  wall min {min(walls):5.2f} s"
                  f"  cpu min {min(cpus):5.2f} s")
    print(f"load average {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()
