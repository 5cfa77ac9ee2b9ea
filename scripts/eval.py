"""Evaluate a titanlike checkpoint with lm-evaluation-harness (lm-eval's command line with the
`titanlike` model registered; titanlike/cli/eval.py, `titanlike-eval` after pip install).

    python scripts/eval.py --model titanlike --model_args checkpoint=outputs/checkpoint --tasks hellaswag
    torchrun --nproc-per-node 2 scripts/eval.py --model titanlike --model_args checkpoint=... --tasks ...
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titanlike.cli.eval import main, register  # noqa: E402

__all__ = ["main", "register"]

if __name__ == "__main__":
    sys.exit(main(prog="eval.py"))
