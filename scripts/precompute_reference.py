"""Precompute DPO's reference log-probabilities and store them with the preference data.

    python scripts/precompute_reference.py OUT.jsonl -- <the DPO job's train.py options>

Then train with --training.dataset_path OUT.jsonl --dpo.reference precomputed (no reference model).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The program is titanlike/cli/precompute_reference.py.
from titanlike.cli.precompute_reference import main, precompute  # noqa: E402

__all__ = ["main", "precompute"]

if __name__ == "__main__":
    sys.exit(main(prog="precompute_reference.py"))
