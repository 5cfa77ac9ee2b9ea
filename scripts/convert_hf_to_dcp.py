#!/usr/bin/env python
"""Convert a Hugging Face model folder (safetensors) to a model-only titanlike DCP checkpoint.

    python scripts/convert_hf_to_dcp.py path/to/Llama-3.2-1B ckpt/step-0 [--dtype float32]

The output loads as `--checkpoint.initial_load_path ckpt/step-0` (any parallel layout),
with `titanlike.load_model`, and converts back with convert_dcp_to_hf.py. To fine-tune
without converting, pass the Hugging Face folder itself with --checkpoint.initial_load_in_hf.
Runs in one process and holds the whole model in host memory.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help="Hugging Face model folder (config.json + *.safetensors)")
    parser.add_argument("output", help="DCP checkpoint folder to write")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="cast the weights (default: keep the stored dtype)")
    args = parser.parse_args(argv)

    import torch

    from titanlike.checkpoint import CheckpointError, import_hf_to_dcp

    try:
        import_hf_to_dcp(args.input, args.output, dtype=getattr(torch, args.dtype) if args.dtype else None)
    except (CheckpointError, ValueError, KeyError) as e:
        print(f"convert_hf_to_dcp: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} from {args.input}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
