"""Serve a titanlike checkpoint (DCP or Hugging Face folder) over an OpenAI-compatible HTTP API.

    python scripts/serve.py outputs/checkpoint --port 8000
    python scripts/serve.py outputs/sft/checkpoint --max-batch-size 16 --max-model-len 2048

/v1/completions, /v1/chat/completions (streaming by server-sent events), /v1/models, /health;
concurrent requests share each decode step (continuous batching). Any OpenAI client works:
    OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none").completions.create(model="checkpoint", ...)
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The program is titanlike/cli/serve.py (`titanlike-serve` after pip install).
from titanlike.cli.serve import build_server, main  # noqa: E402

__all__ = ["build_server", "main"]

if __name__ == "__main__":
    sys.exit(main(prog="serve.py"))
