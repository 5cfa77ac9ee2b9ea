#!/usr/bin/env python
"""Tokenize JSONL into Megatron's MMIDIDX `.bin`/`.idx` (drop-in for Megatron's
tools/preprocess_data.py).

    python scripts/preprocess_data.py --input corpus.jsonl[.gz] --output-prefix data/corpus \\
        --json-keys text --append-eod --workers 8 [--tokenizer-model path]
    python scripts/preprocess_data.py --input corpus.jsonl --output-prefix data/corpus --append-eod \\
        --tokenizer-type GPT2BPETokenizer --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt

The program is titanlike/cli/preprocess_data.py (`titanlike-preprocess-data` after pip install); its
docstring and --help say what it writes, Megatron's tokenizer types and flags, and how train.py then
reads the data.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.pardir)))

from titanlike.cli.preprocess_data import *  # noqa: E402,F401,F403
from titanlike.cli.preprocess_data import _UNIMPLEMENTED, main, preprocess  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main(prog="preprocess_data.py"))
