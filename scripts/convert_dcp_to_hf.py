#!/usr/bin/env python
"""Convert a titanlike DCP checkpoint to a Hugging Face folder (e.g. llama3 -> LlamaForCausalLM).

    python scripts/convert_dcp_to_hf.py outputs/checkpoint/step-1000 hf_out [--dtype bfloat16]

IN is a full or model-only checkpoint written by titanlike (its titanlike.json names the
model), or a checkpoint folder of step-N checkpoints (the latest is taken). OUT receives
model-0000i-of-0000n.safetensors, model.safetensors.index.json, config.json,
generation_config.json, and the tokenizer the model was trained with as tokenizer.json +
tokenizer_config.json (same ids as titanlike's tokenizer), so that AutoModelForCausalLM and
AutoTokenizer both load OUT. The tokenizer is the one titanlike.json records, or --tokenizer;
one that cannot be converted is copied with a note on how to load it, and the weights are
written either way. A DCP checkpoint without titanlike.json (e.g. torchtitan's) needs
--model-name/--flavor/--vocab-size.
Runs in one process and holds the whole model in host memory.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("input", help="DCP checkpoint folder (step-N) or a folder of step-N checkpoints")
    parser.add_argument("output", help="Hugging Face folder to write")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB")
    parser.add_argument("--model-name", default="llama3", help="family, when IN has no titanlike.json")
    parser.add_argument("--flavor", help="flavor, when IN has no titanlike.json")
    parser.add_argument("--vocab-size", type=int, help="vocabulary size, when IN has no titanlike.json")
    parser.add_argument("--tokenizer", help="tokenizer file (tiktoken ranks) to include, instead of the one "
                                            "IN's titanlike.json records")
    args = parser.parse_args(argv)

    import torch

    from titanlike.checkpoint.format import CheckpointError, model_description, resolve_checkpoint_folder
    from titanlike.checkpoint.hf import export_dcp_to_hf
    from titanlike.models.registry import get_model_spec

    description = None
    try:
        if args.flavor:
            spec = get_model_spec(args.model_name)
            if args.flavor not in spec.flavors:
                raise ValueError(f"model {spec.name} has no flavor {args.flavor!r}; "
                                 f"flavors: {', '.join(spec.flavors)}")
            flavor = spec.flavors[args.flavor]
            if args.vocab_size:
                flavor = flavor.update_from_config(vocab_size=args.vocab_size, seq_len=flavor.context_len)
            description = model_description(spec.name, flavor)
        src = resolve_checkpoint_folder(args.input)
        tokenizer = export_dcp_to_hf(src, args.output, dtype=getattr(torch, args.dtype),
                                     max_shard_bytes=parse_size(args.max_shard_size), description=description,
                                     tokenizer_path=args.tokenizer)
    except (CheckpointError, ValueError, KeyError) as e:
        print(f"convert_dcp_to_hf: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} from {src}")
    if tokenizer.converted:
        print(f"tokenizer: {tokenizer.message}")
    else:
        hint = "" if args.tokenizer else " (--tokenizer names one)"
        print(f"convert_dcp_to_hf: warning: {tokenizer.message}{hint}", file=sys.stderr)
    return 0


def parse_size(text: str) -> int:
    units = {"KB": 1e3, "MB": 1e6, "GB": 1e9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
    t = text.strip().upper()
    for unit, scale in units.items():
        if t.endswith(unit) and t[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(t[: -len(unit)]) * scale)
    if t.isdigit():
        return int(t)
    raise ValueError(f"--max-shard-size {text!r} is not a size like 5GB or 500MB")


if __name__ == "__main__":
    sys.exit(main())
