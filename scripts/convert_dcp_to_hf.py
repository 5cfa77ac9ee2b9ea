#!/usr/bin/env python
"""Convert a titanlike DCP checkpoint to a Hugging Face folder (e.g. llama3 -> LlamaForCausalLM).

    python scripts/convert_dcp_to_hf.py outputs/checkpoint/step-1000 hf_out [--dtype bfloat16]
    python scripts/convert_dcp_to_hf.py ckpt/step-1000 hf_out --model_name llama3 --model_flavor 8B \\
        --export_dtype bfloat16 --hf_assets_path assets/hf/Llama-3.1-8B    # torchtitan's spellings

The program is titanlike/cli/convert.py (`titanlike-convert to-hf` after pip install); --help lists
its options (--max-shard-size, --tokenizer, --model-name, --flavor, --vocab-size, ...).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titanlike.cli.convert import parse_size  # noqa: E402,F401
from titanlike.cli.convert import to_hf as _to_hf  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    return _to_hf(argv, prog="convert_dcp_to_hf.py")


if __name__ == "__main__":
    sys.exit(main())
