"""tests/run_jobs.py for jobs of the toy family: register it, then run the jobs through train.main.

    torchrun --nproc_per_node=2 tests/toy_jobs.py jobs.json     (or plain python for one process)

This is how a user trains a family of their own: import the module that registers it (its ModelSpec,
its objective and config section), then call train.main; titanlike never imports code a config names.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/: toy_family, run_jobs

import toy_family  # noqa: E402,F401  (registers the toy family, its objective and [toy_copy])
from run_jobs import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
