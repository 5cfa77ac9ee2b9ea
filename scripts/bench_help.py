"""Start-up of the commands' --help, in fresh processes: modules imported and their cumulative import time
(`python -X importtime`), wall and CPU time (min of --rounds).

    python scripts/bench_help.py [--rounds 3] [--before OTHER_CHECKOUT] [--train]

With --before, the same commands run from another checkout too (e.g. a worktree of main), interleaved
with this one's, so that both see the same load. CPU time (user + sys) moves less than wall time on a
shared machine. With --train, `scripts/run_train.sh --training.steps 4` of the debug model too: wall
time to its step-1 log line and to its end, and the CPU time of every process it starts.
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


def first_step(tree: Path) -> tuple[float, float, float]:
    """(wall seconds to the step-1 log line, wall seconds of the run, CPU seconds of every process) of
    scripts/run_train.sh --training.steps 4 in tree, its outputs in a temporary folder."""
    import tempfile

    env = dict(os.environ, PYTHONPATH=str(tree), NGPU="1")
    with tempfile.TemporaryDirectory() as out:
        before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        proc = subprocess.Popen(["bash", "scripts/run_train.sh", "--training.steps", "4", "--job.dump_folder", out],
                                cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first = None
        for line in proc.stdout:
            if first is None and "step:     1/4" in line:
                first = time.perf_counter() - start
        if proc.wait():
            raise SystemExit(f"run_train.sh failed in {tree} (exit {proc.returncode})")
        wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if first is None:
        raise SystemExit(f"run_train.sh in {tree} logged no step 1")
    return first, wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def imports(stderr: str) -> tuple[int, float]:
    """(modules imported, seconds of the top-level imports' cumulative time) from -X importtime's lines."""
    rows = [line.split("|") for line in stderr.splitlines() if line.startswith("import time:") and "[us]" not in line]
    top = [int(r[1]) for r in rows if r[2].startswith(" ") and not r[2].startswith("  ")]
    return len(rows), sum(top) / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", type=Path, help="another checkout to measure the same way, first")
    parser.add_argument("--train", action="store_true", help="also run_train.sh --training.steps 4 (debug model)")
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
    if args.train:
        runs = {label: [] for label, _ in trees}
        for _ in range(args.rounds):
            for label, tree in trees:
                runs[label].append(first_step(tree))
        for label, rows in runs.items():
            first, wall, cpu = (min(row[i] for row in rows) for i in range(3))
            print(f"{'run_train.sh --training.steps 4':28s} {label:6s} step 1 after {first:6.2f} s  wall min "
                  f"{wall:6.2f} s  cpu min {cpu:6.2f} s")
    print(f"load average {' '.join(open('/proc/loadavg').read().split()[:3])}")


if __name__ == "__main__":
    main()
