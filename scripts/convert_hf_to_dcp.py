#!/usr/bin/env python
"""Convert a Hugging Face model folder (safetensors) to a model-only titanlike DCP checkpoint.

    python scripts/convert_hf_to_dcp.py path/to/Llama-3.2-1B ckpt/step-0 [--dtype float32]
    python scripts/convert_hf_to_dcp.py path/to/Llama-3.1-8B ckpt/step-0 --model_name llama3   # torchtitan's

The output loads as `--checkpoint.initial_load_path ckpt/step-0` (any parallel layout),
with `titanlike.load_model`, and converts back with convert_dcp_to_hf.py. To fine-tune
without converting, pass the Hugging Face folder itself with --checkpoint.initial_load_in_hf.
The program is titanlike/cli/convert.py (`titanlike-convert from-hf` after pip install).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titanlike.cli.convert import from_hf as _from_hf  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return _from_hf(argv, prog="convert_hf_to_dcp.py")


if __name__ == "__main__":
    sys.exit(main())
