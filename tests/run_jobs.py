"""Run several train.py jobs one after another in the same processes (tests only).

    torchrun --nproc_per_node=4 tests/run_jobs.py jobs.json     (or plain python for one process)

jobs.json is a list of {"name": ..., "argv": [...]}. Starting 4 or 8 Python processes that import
torch and join a gloo group costs 10-25 s on the 2-core CI machine, more than a tiny parity job
itself; paying it once per world size instead of once per layout is what keeps the suite's
distributed tests inside the CI budget. Each job goes through train.py's main as
`python train.py argv` would (without the estimator's memory check, which has tests of its own), on
the process group created here, which the trainer leaves
standing (it only tears down a group it created).

Each finished job writes `<name>.rc` (its exit code) and every rank's output goes to stdout
with a `=== job <name>` banner, so the test that asked for a job can show what it printed. A job
that fails or raises stops the whole batch: other ranks may be waiting in a collective it never
reached, and the jobs after it are reported as never finished.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(jobs_file: str) -> int:
    sys.path.insert(0, str(REPO))
    import torch.distributed as dist

    from titanlike.cli.train import main as train_main

    jobs = json.loads(Path(jobs_file).read_text())
    status_folder = Path(jobs_file).parent
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    if world_size > 1:
        dist.init_process_group("gloo")
    try:
        for job in jobs:
            print(f"=== job {job['name']}", flush=True)
            print(f"=== job {job['name']}", file=sys.stderr, flush=True)
            start = time.perf_counter()
            try:
                # No pre-flight check (tests/conftest.py's TEST_JOB_CHECKS says why); with several ranks the
                # memory check skips itself anyway (a process group exists).
                rc = train_main(job["argv"], "train.py", checks=[])
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
                os._exit(1)  # torchrun stops the other ranks
            if rank == 0:
                # What each job costs (the suite's budget is counted in these): `=== job <name>: <s> s`.
                print(f"=== job {job['name']}: {time.perf_counter() - start:.1f} s", flush=True)
                (status_folder / f"{job['name']}.rc").write_text(str(rc))
            if rc != 0:
                # A failed job may have torn the process group down (train.main does on some errors).
                return rc
            if dist.is_initialized():
                dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
