"""Generate text from a titanlike checkpoint (DCP, full or model-only) or a Hugging Face model folder.

    python scripts/generate.py outputs/checkpoint --prompt "In the beginning" --max-new-tokens 60
    python scripts/generate.py path/to/Llama-3.2-1B --tokenizer path/to/tokenizer.model --temperature 0
    python scripts/generate.py outputs/sft/checkpoint --chat --prompts-file questions.jsonl --batch-size 8

With the model's KV cache (titanlike/inference): the prompts are prefilled in one pass, then one
token per step, prompts of different lengths in one batch. Sampling: repetition penalty,
temperature, top-k, top-p (temperature 0 is greedy); stops at a stop token (the tokenizer's EOS, the
chat template's end of turn, --stop-token), a stop string (--stop), --max-new-tokens, or the
model's context. One prompt at a time is streamed; tokens/s and the time to first token go to stderr.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The program is titanlike/cli/generate.py (`titanlike-generate` after pip install).
from titanlike.cli.generate import generate, main, training_objective, vocab_size  # noqa: E402

__all__ = ["generate", "main", "training_objective", "vocab_size"]

if __name__ == "__main__":
    sys.exit(main(prog="generate.py"))
