"""Generate text from a titanlike checkpoint (DCP, full or model-only) or a Hugging Face model folder.

    python scripts/generate.py outputs/checkpoint --prompt "In the beginning" --max-new-tokens 60
    python scripts/generate.py path/to/Llama-3.2-1B --tokenizer path/to/tokenizer.model --temperature 0

A sanity check of a trained model, not an inference server: one prompt at a time and no
KV cache (every new token reruns the whole sequence, as torchtitan's generation test does),
which is fine for the debug and small models and slow for large ones. Sampling is
temperature + top-k; temperature 0 is greedy. Stops at max-new-tokens, at the tokenizer's
EOS, or at the model's context length.
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
