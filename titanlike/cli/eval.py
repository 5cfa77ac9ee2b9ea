"""Evaluate a titanlike checkpoint with lm-evaluation-harness: lm-eval's own command line, with the
`titanlike` model registered (lm-eval 0.4 discovers no model plugins: a model must be registered in
the process that evaluates).

    titanlike-eval --model titanlike --model_args checkpoint=outputs/checkpoint --tasks hellaswag
    torchrun --nproc-per-node 2 scripts/eval.py --model titanlike --model_args checkpoint=... --tasks ...

(scripts/eval.py in a checkout.) `--device` defaults to cuda where CUDA exists, else cpu (lm-eval's
own default, cuda:0, fails on a CPU machine). Every lm-eval option works (--tasks, --include_path,
--num_fewshot, --batch_size, --limit, --output_path, ...); model_args are described in
titanlike/inference/harness.py. Under torchrun the ranks are one tensor-parallel group.
"""

from __future__ import annotations

import logging
import sys

MODEL_NAME = "titanlike"


def register() -> None:
    """Make `--model titanlike` known to lm-eval in this process (lazily: the class is imported
    when a run asks for it)."""
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target="titanlike.inference.harness:TitanlikeLM")


# What `--help` says before lm-eval's own help: the model this command adds and its model_args.
MODEL_HELP = """\
titanlike-eval: lm-evaluation-harness's command line with the `titanlike` model registered.
  --model titanlike --model_args checkpoint=PATH[,tokenizer=PATH,dtype=float32|bfloat16|float16,
      max_length=N,max_gen_toks=N,add_bos_token=true|false]
  checkpoint: a DCP step folder, a checkpoint folder (its latest step) or a Hugging Face folder;
  tokenizer: default the folder's tokenizer.json, else the debug tokenizer; max_length: default the
  model's context; max_gen_toks: default 256; add_bos_token: default as the exported tokenizer starts
  a text (Llama BOS, GPT-2 nothing; titanlike/inference/harness.py). --device: default cuda
  where CUDA exists, else cpu.
lm-eval's own options follow.
"""


def with_default_device(argv: list[str]) -> list[str]:
    """argv with `--device cpu` added to a run that names no device on a machine without CUDA:
    lm-eval's default is cuda:0."""
    if "--model" not in argv or any(a == "--device" or a.startswith("--device=") for a in argv):
        return argv
    import torch  # only for a run: --help needs no torch

    return argv if torch.cuda.is_available() else [*argv, "--device", "cpu"]


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(MODEL_HELP)
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        print("error: evaluation needs lm-evaluation-harness (pip install 'lm_eval==0.4.13', or titanlike[dev])",
              file=sys.stderr)
        return 1
    register()
    saved = sys.argv
    # lm-eval's command line reads sys.argv (and inserts its `run` command there when none is given)
    # and gives its logger a handler on the sys.stderr of the moment: a caller in the same process
    # (a test) gets both back as they were.
    logger = logging.getLogger("lm_eval")
    handlers, level = list(logger.handlers), logger.level
    sys.argv = [prog or "titanlike-eval", *with_default_device(argv)]
    try:
        cli_evaluate()
    except SystemExit as e:  # argparse after --help (0) or a bad option (2)
        return e.code if isinstance(e.code, int) else 1
    except Exception as e:
        # Imported here, once a model was asked for: --help and a bad option import no torch.
        from titanlike.inference import GenerationError

        if not isinstance(e, GenerationError):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        sys.argv = saved
        logger.handlers[:] = handlers
        logger.setLevel(level)
    return 0


def console_main() -> None:
    """The `titanlike-eval` console script."""
    sys.exit(main(prog="titanlike-eval"))
