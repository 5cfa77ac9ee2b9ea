#!/usr/bin/env python
"""Convert a Megatron-LM checkpoint (torch_dist or legacy torch format) to a model-only titanlike DCP checkpoint.

    python scripts/convert_megatron_to_dcp.py megatron/checkpoints ckpt/step-0 --model.name llama3 --model.flavor 8B \
        [--true-vocab-size 128256] [--dtype bfloat16]

The output loads as `--checkpoint.initial_load_path ckpt/step-0` (any parallel layout) and with
titanlike.load_model. The program is titanlike/cli/convert.py (`titanlike-convert from-megatron` after pip
install).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titanlike.cli.convert import from_megatron as _from_megatron  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return _from_megatron(argv, prog="convert_megatron_to_dcp.py")


if __name__ == "__main__":
    sys.exit(main())
