"""The command-line options that name a model for inference (generate, serve), without torch: a
tool's --help builds its parser from them before anything heavy is imported. loading.py loads what
they name (load_model_arguments)."""

from __future__ import annotations

import argparse

# The dtypes weights may be cast to for inference (the names of train.py's checkpoint.export_dtype).
DTYPE_NAMES = ("float32", "bfloat16", "float16")


def add_model_arguments(parser: argparse.ArgumentParser, *, compile_shapes: str) -> None:
    """The options that name the model and how it runs: the checkpoint, --tokenizer, --device,
    --dtype, --compile (`compile_shapes`: what fixes the compiled step's shapes in this tool).
    load_model_arguments loads what they name."""
    group = parser.add_argument_group("model")
    group.add_argument("checkpoint", help="DCP step folder, checkpoint folder (latest step), or HF folder")
    group.add_argument("--tokenizer", default=None, help="tiktoken file or Hugging Face tokenizer folder; default: "
                       "the checkpoint folder's tokenizer.json if it has one, else the debug tokenizer")
    group.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda when this machine has "
                       "a GPU, else cpu)")
    group.add_argument("--dtype", choices=DTYPE_NAMES, default=None, help="the weights' dtype (default: as stored)")
    group.add_argument("--compile", action="store_true", help=f"torch.compile the decode step (its shapes are fixed: "
                       f"{compile_shapes}; the compile costs seconds to minutes at the first step). On a GPU it "
                       "replays the step as a CUDA graph; on a CPU the eager step, whose linear layers run through "
                       "oneDNN with prepacked weights, is usually the faster (docs/performance.md)")


__all__ = ["DTYPE_NAMES", "add_model_arguments"]
