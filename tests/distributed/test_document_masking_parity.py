"""Document masking through train.py: each parallel layout reproduces the single-process curve
with the same masks (tolerances: test_fsdp_parity.py), and the masks change the curve.

The data are short documents (4-40 words, so every 64-token sample holds several), written
to a JSONL file and read with `training.dataset text`: samples then cross many document
boundaries, which the embedded corpus (chapters of ~1,000 tokens) would rarely do.
"""

import gzip
import json
import random
from pathlib import Path

import pytest

from conftest import REPO, train_metrics
from test_fsdp_parity import assert_same_curve

pytestmark = pytest.mark.distributed

DOC_MASKING = ("--training.document_masking", "--training.eod_mask_loss")


def write_short_documents(folder: Path) -> str:
    """Short documents of the embedded corpus as JSONL in folder (written once; the same file every time)."""
    path = folder / "short_docs.jsonl"
    if path.exists():
        return str(path)
    with gzip.open(REPO / "titanlike" / "data" / "assets" / "kjv_chapters.jsonl.gz", "rt") as f:
        words = " ".join(json.loads(line)["text"] for _, line in zip(range(60), f)).split()
    rng = random.Random(0)
    with open(path, "w") as f:
        i = 0
        while i < len(words):
            n = rng.randint(4, 40)
            f.write(json.dumps({"text": " ".join(words[i:i + n])}) + "\n")
            i += n
    return str(path)


SHORT_DOCUMENTS = ("--training.dataset", "text", "--training.dataset_path", write_short_documents)


@pytest.fixture(scope="module")
def short_documents(tmp_path_factory) -> str:
    return write_short_documents(tmp_path_factory.mktemp("docs"))


def _run(tmp_path, name, docs, *extra, nproc=1):
    return train_metrics(tmp_path, name, "--training.dataset", "text", "--training.dataset_path", docs,
                         *extra, nproc=nproc)


@pytest.fixture(scope="module")
def masked_reference(tmp_path_factory, short_documents):
    return _run(tmp_path_factory.mktemp("ref"), "masked", short_documents, *DOC_MASKING,
                "--training.local_batch_size", "8")


def test_masking_changes_the_curve(tmp_path, short_documents, masked_reference):
    plain = _run(tmp_path, "plain", short_documents, "--training.local_batch_size", "8")
    gaps = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(masked_reference, plain)]
    assert max(gaps) > 1e-3, f"document masking left the loss curve unchanged (max relative gap {max(gaps):.1e})"


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.train_run(
    *SHORT_DOCUMENTS, *DOC_MASKING, *layout, nproc=2)) for name, layout in [
    ("fsdp2", ("--training.local_batch_size", "2", "--training.global_batch_size", "8")),
    ("tp2", ("--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8")),
    ("cp2_ring", ("--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_rotate_method",
                  "alltoall", "--training.local_batch_size", "8")),
    # Two stages per rank, four microbatches: each stage gets the mask of the microbatch it runs.
    ("pp2_interleaved", ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                         "Interleaved1F1B", "--parallelism.pipeline_parallel_microbatch_size", "2",
                         "--training.local_batch_size", "8")),
]])
def test_layout_matches_one_process(train_run, masked_reference, layout):
    assert_same_curve(train_run.metrics, masked_reference)
