#!/usr/bin/env python
"""Download a model's files from the Hugging Face Hub, with torchtitan's flags.

    python scripts/download_hf_assets.py --repo_id meta-llama/Llama-3.1-8B --assets tokenizer --hf_token ...
    python scripts/download_hf_assets.py --repo_id Qwen/Qwen3-0.6B --all --local_dir assets/hf/
    python scripts/download_hf_assets.py --repo_id org/model --assets config index --additional_patterns README.md

The program is titanlike/cli/download_hf_assets.py (`titanlike-download-hf-assets` after pip install).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from titanlike.cli.download_hf_assets import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(prog="download_hf_assets.py"))
