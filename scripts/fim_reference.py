"""Write tests/assets/fim_reference.json: Megatron-LM's GPTFIMDataset samples on a small dataset, the
reference titanlike's FIM (titanlike/data/fim.py) is tested against (tests/unit/test_fim.py).

Needs a Megatron-LM checkout (for megatron/training/datasets/fim_dataset.py, which the megatron-core
package does not ship) and megatron-core with transformers installed:

    python scripts/fim_reference.py --megatron-lm /path/to/Megatron-LM

The documents are the starts of the embedded corpus's first chapters, tokenized with the test tokenizer
(tests/assets/tokenizer, the debug tokenizer's ids) and stored in the file, so the test rebuilds the
same .bin/.idx without Megatron. The FIM tokens are Llama 3 reserved special tokens of that tokenizer.
For each case the file holds Megatron's samples 0, 1, ... read in order from one fresh dataset (its
single random stream: titanlike.data.fim.megatron_stream).
"""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

TOKENIZER = os.path.join(REPO, "tests/assets/tokenizer")
OUT = os.path.join(REPO, "tests/assets/fim_reference.json")
SEQ_LEN = 32
SEED = 1234
SAMPLES = 10
DOCUMENTS = 24
DOCUMENT_CHARS = 90
TOKENS = {"prefix": "<|reserved_special_token_2|>", "middle": "<|reserved_special_token_3|>",
          "suffix": "<|reserved_special_token_4|>", "pad": "<|reserved_special_token_5|>",
          "eod": "<|end_of_text|>"}
# name -> Megatron's GPTFIMDatasetConfig fim_* options
CASES = {
    "psm": dict(rate=1.0, spm_rate=0.0),
    "spm": dict(rate=1.0, spm_rate=1.0),
    "mixed": dict(rate=0.5, spm_rate=0.5),
    "fragments": dict(rate=0.9, spm_rate=0.5, split_sample=",", fragment_rate=0.5),
    "no_prefix": dict(rate=1.0, spm_rate=0.5, no_prefix="And"),
}


def documents(tokenizer) -> list[list[int]]:
    from titanlike.data import DEFAULT_CORPUS_PATH

    with gzip.open(DEFAULT_CORPUS_PATH, "rt") as f:
        texts = [json.loads(line)["text"][:DOCUMENT_CHARS] for _, line in zip(range(DOCUMENTS), f)]
    return [tokenizer.encode(t, bos=False, eos=True) for t in texts]


def megatron_samples(megatron_lm: str, prefix: str, n_docs: int, case: dict) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron.core.datasets.utils import Split
    from megatron.core.tokenizers import MegatronTokenizer

    path = os.path.join(megatron_lm, "megatron/training/datasets/fim_dataset.py")
    spec = importlib.util.spec_from_file_location("megatron_fim_dataset", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tokenizer = MegatronTokenizer.from_pretrained(
        tokenizer_path=TOKENIZER, metadata_path={"library": "huggingface"},
        additional_special_tokens=[TOKENS[k] for k in ("prefix", "middle", "suffix", "pad")])
    config = module.GPTFIMDatasetConfig(
        random_seed=SEED, sequence_length=SEQ_LEN, split="1", tokenizer=tokenizer, path_to_cache=None,
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
        fim_extra_tokens=TOKENS, fim_rate=case["rate"], fim_spm_rate=case["spm_rate"],
        fim_split_sample=case.get("split_sample"), fim_fragment_rate=case.get("fragment_rate"),
        fim_no_prefix=case.get("no_prefix"))
    dataset = module.GPTFIMDataset(IndexedDataset(prefix), prefix, np.arange(n_docs, dtype=np.int32), SAMPLES,
                                   Split.train, config)
    # The FIM sample itself (seq_len + 1 ids), before megatron-core's __getitem__ cuts inputs and labels.
    return [dataset._query_document_sample_shuffle_indices(i)[0].tolist() for i in range(SAMPLES)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--megatron-lm", required=True, help="a Megatron-LM checkout")
    parser.add_argument("--out", default=OUT)
    a = parser.parse_args()
    from titanlike.data import build_tokenizer
    from titanlike.data.indexed import write_indexed_dataset

    docs = documents(build_tokenizer(TOKENIZER))
    with tempfile.TemporaryDirectory() as tmp:
        prefix = os.path.join(tmp, "docs")
        write_indexed_dataset(prefix, docs, np.uint16)
        samples = {name: megatron_samples(a.megatron_lm, prefix, len(docs), case) for name, case in CASES.items()}
    record = {"generated_by": "python scripts/fim_reference.py --megatron-lm PATH", "seq_len": SEQ_LEN,
              "seed": SEED, "split": "1", "tokens": TOKENS, "cases": CASES, "documents": docs, "samples": samples}
    with open(a.out, "w") as f:
        json.dump(record, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {a.out}: {len(CASES)} cases of {SAMPLES} samples")


if __name__ == "__main__":
    main()
