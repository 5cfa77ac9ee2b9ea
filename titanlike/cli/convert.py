"""Convert between titanlike's DCP checkpoints and Hugging Face folders, both directions, and import
Megatron-LM checkpoints:

    titanlike-convert to-hf outputs/checkpoint/step-1000 hf_out [--dtype bfloat16]
    titanlike-convert from-hf path/to/Llama-3.2-1B ckpt/step-0 [--dtype float32]
    titanlike-convert from-megatron megatron/checkpoints ckpt/step-0 --model.name llama3 --model.flavor 8B

(scripts/convert_dcp_to_hf.py and scripts/convert_hf_to_dcp.py in a checkout.) torchtitan's spellings
of scripts/checkpoint_conversion/convert_{to,from}_hf.py are accepted: `--model_name`, `--model_flavor`,
`--export_dtype`, `--hf_assets_path` (its tokenizer files go into the export; the safetensors shards
follow --max-shard-size rather than its index). Each runs in one process and holds the whole model in
host memory.
"""

from __future__ import annotations

import argparse
import sys

TO_HF_DOC = """Convert a titanlike DCP checkpoint to a Hugging Face folder (e.g. llama3 -> LlamaForCausalLM).

IN is a full or model-only checkpoint written by titanlike (its titanlike.json names the
model), or a checkpoint folder of step-N checkpoints (the latest is taken). OUT receives
model-0000i-of-0000n.safetensors, model.safetensors.index.json, config.json,
generation_config.json, and the tokenizer the model was trained with as tokenizer.json +
tokenizer_config.json (same ids as titanlike's tokenizer), so that AutoModelForCausalLM and
AutoTokenizer both load OUT. A run that rendered conversations (sft, dpo, reward) recorded its chat
template: it becomes tokenizer_config.json's chat_template, and its end-of-turn ids follow EOS in
generation_config.json's eos_token_id. The tokenizer is the one titanlike.json records, or --tokenizer
(or torchtitan's --hf_assets_path folder); one that cannot be converted is copied with a note on
how to load it, and the weights are written either way. A DCP checkpoint without titanlike.json
(e.g. torchtitan's) needs --model-name/--flavor/--vocab-size."""

FROM_HF_DOC = """Convert a Hugging Face model folder (safetensors) to a model-only titanlike DCP checkpoint.

The output loads as `--checkpoint.initial_load_path OUT` (any parallel layout), with
`titanlike.load_model`, and converts back with to-hf. The model family and its dimensions come from
the folder's config.json (torchtitan's --model_name is checked against it; --model_flavor is not
needed). To fine-tune without converting, pass the Hugging Face folder itself with
--checkpoint.initial_load_in_hf."""


FROM_MEGATRON_DOC = """Convert a Megatron-LM checkpoint (megatron-core GPTModel) to a model-only DCP checkpoint.

IN is the folder Megatron-LM saved into (--save: latest_checkpointed_iteration.txt and iter_XXXXXXX/; the
iteration the tracker names is read) or one iteration folder, in either format: torch_dist (the default
--ckpt-format) or torch (mp_rank_TT[_PPP]/model_optim_rng.pt, merged over tensor- and pipeline-parallel
ranks; virtual pipeline chunks are refused). Only the model's weights are read: no optimizer state, and no
pickled object beyond placeholders for what Megatron-LM stores beside the tensors. The model's family and
flavor are named (a Megatron checkpoint describes its model only in pickled args, not read), sizes no flavor has
with --model.args as train.py takes them (Megatron's names too: num_layers, hidden_size, ...); the vocabulary is
the checkpoint's (Megatron pads it to a multiple of 128 x TP), or its first --true-vocab-size rows: the size
of the tokenizer the job trains with. The
output loads as `--checkpoint.initial_load_path OUT` (any parallel layout) and with `titanlike.load_model`.
Families: llama3 (Megatron-LM's Llama recipes: RMSNorm, SwiGLU, GQA, RoPE, untied), gpt2 (LayerNorm,
learned positions, --openai-gelu, biases, tied), mixtral and qwen3 (QK-norm; MoE experts as SequentialMLP or
Transformer Engine's grouped MLP save them; legacy files of expert-parallel runs are refused)."""


def to_hf(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=TO_HF_DOC.split("\n\n")[0], epilog=TO_HF_DOC.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="DCP checkpoint folder (step-N) or a folder of step-N checkpoints")
    parser.add_argument("output", help="Hugging Face folder to write")
    parser.add_argument("--dtype", "--export_dtype", dest="dtype", default="float32",
                        choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB")
    parser.add_argument("--model-name", "--model_name", dest="model_name", default="llama3",
                        help="family, when IN has no titanlike.json")
    parser.add_argument("--flavor", "--model_flavor", dest="flavor", help="flavor, when IN has no titanlike.json")
    parser.add_argument("--vocab-size", type=int, help="vocabulary size, when IN has no titanlike.json")
    parser.add_argument("--tokenizer", help="tokenizer file (tiktoken ranks) or tokenizer.json folder to include, "
                                            "instead of the one IN's titanlike.json records")
    parser.add_argument("--hf_assets_path", help="torchtitan's: a Hugging Face assets folder whose tokenizer files "
                                                 "are included (as --tokenizer FOLDER)")
    args = parser.parse_args(argv)
    if args.hf_assets_path and args.tokenizer:
        parser.error("--tokenizer and --hf_assets_path both name the tokenizer to include; pass one")

    import torch

    from titanlike.checkpoint.format import CheckpointError, model_description, resolve_checkpoint_folder
    from titanlike.checkpoint.hf import export_dcp_to_hf
    from titanlike.models.registry import get_model_spec

    name = (prog or "convert_dcp_to_hf").removesuffix(".py")
    tokenizer_path = args.tokenizer or args.hf_assets_path
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
                                     tokenizer_path=tokenizer_path)
    except (CheckpointError, ValueError, KeyError) as e:
        print(f"{name}: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} from {src}")
    if tokenizer.converted:
        print(f"tokenizer: {tokenizer.message}")
    else:
        hint = "" if tokenizer_path else " (--tokenizer names one)"
        print(f"{name}: warning: {tokenizer.message}{hint}", file=sys.stderr)
    return 0


def from_hf(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=FROM_HF_DOC.split("\n\n")[0],
                                     epilog=FROM_HF_DOC.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="Hugging Face model folder (config.json + *.safetensors)")
    parser.add_argument("output", help="DCP checkpoint folder to write")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="cast the weights (default: keep the stored dtype)")
    parser.add_argument("--model_name", "--model-name", dest="model_name", default=None,
                        help="torchtitan's: the family config.json must describe (checked)")
    parser.add_argument("--model_flavor", "--flavor", dest="flavor", default=None,
                        help="torchtitan's: not needed, the dimensions come from config.json")
    args = parser.parse_args(argv)

    import torch

    from titanlike.checkpoint import CheckpointError, import_hf_to_dcp
    from titanlike.checkpoint.format import read_sidecar

    name = (prog or "convert_hf_to_dcp").removesuffix(".py")
    try:
        import_hf_to_dcp(args.input, args.output, dtype=getattr(torch, args.dtype) if args.dtype else None)
        model = (read_sidecar(args.output) or {}).get("model", {})
        if args.model_name and model.get("name") != args.model_name:
            import shutil

            shutil.rmtree(args.output, ignore_errors=True)
            raise ValueError(f"--model_name {args.model_name}: {args.input}'s config.json describes a "
                             f"{model.get('name')} model, nothing written")
    except (CheckpointError, ValueError, KeyError) as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} from {args.input}")
    if args.flavor:
        print(f"note: --model_flavor {args.flavor} is not used: the dimensions came from {args.input}'s config.json")
    return 0


def from_megatron(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=FROM_MEGATRON_DOC.split("\n\n")[0],
                                     epilog=FROM_MEGATRON_DOC.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="Megatron-LM --save folder, or one iter_XXXXXXX folder of it")
    parser.add_argument("output", help="DCP checkpoint folder to write")
    parser.add_argument("--model.name", "--model-name", "--model_name", dest="model_name", required=True,
                        help="the model family, e.g. llama3 or gpt2")
    parser.add_argument("--model.flavor", "--flavor", "--model_flavor", dest="flavor", required=True,
                        help="the family's flavor whose dimensions the checkpoint has, e.g. 8B")
    parser.add_argument("--model.args", dest="model_args", default=None, metavar="KEY=VALUE,...",
                        help="change the flavor's sizes as train.py's --model.args does, by the family's field "
                             "names or Megatron's (num_layers=24,hidden_size=2048,num_query_groups=8,...)")
    parser.add_argument("--true-vocab-size", "--true_vocab_size", dest="true_vocab_size", type=int, default=None,
                        help="keep the first N rows of the embedding and output layer: the tokenizer's vocabulary "
                             "without Megatron's padding (as Megatron-LM's tools/checkpoint converter's option)")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                        help="cast the weights (default: keep the stored dtype)")
    args = parser.parse_args(argv)
    overrides = {}
    for item in filter(None, (part.strip() for part in (args.model_args or "").split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            parser.error(f"--model.args must be KEY=VALUE pairs separated by commas, got {args.model_args!r}")
        overrides[key.strip()] = value.strip()

    import torch

    from titanlike.checkpoint import CheckpointError
    from titanlike.checkpoint.megatron import import_megatron_to_dcp

    name = (prog or "convert_megatron_to_dcp").removesuffix(".py")
    try:
        folder = import_megatron_to_dcp(args.input, args.output, args.model_name, args.flavor, overrides=overrides,
                                        true_vocab_size=args.true_vocab_size,
                                        dtype=getattr(torch, args.dtype) if args.dtype else None)
    except (CheckpointError, ValueError, KeyError) as e:
        print(f"{name}: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return 1
    print(f"wrote {args.output} from {folder}")
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


COMMANDS = {"to-hf": to_hf, "from-hf": from_hf, "from-megatron": from_megatron,
            "to_hf": to_hf, "from_hf": from_hf, "from_megatron": from_megatron}


def main(argv: list[str] | None = None, prog: str = "titanlike-convert") -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(f"usage: {prog} {{to-hf,from-hf,from-megatron}} IN OUT [options]\n\n"
              "  to-hf          a titanlike DCP checkpoint -> a Hugging Face folder (--dtype, --max-shard-size, "
              "--tokenizer, ...)\n  from-hf        a Hugging Face folder -> a model-only titanlike DCP checkpoint "
              "(--dtype)\n  from-megatron  a Megatron-LM checkpoint -> a model-only titanlike DCP checkpoint "
              "(--model.name, --model.flavor, --dtype)\n\n"
              f"{prog} to-hf --help lists the options of one direction.",
              file=sys.stdout if argv[:1] in (["-h"], ["--help"]) else sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    command = argv[0].replace("_", "-")
    return COMMANDS[argv[0]](argv[1:], prog=f"{prog} {command}")


def console_main() -> None:
    sys.exit(main())
