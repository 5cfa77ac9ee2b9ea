"""Bad data and impossible jobs through train.py: one sentence on stderr, exit 2, never a traceback.

The first tests fail at validation time (train.py prints "config error: ..."); a data problem only
the loader can see is a "data error" from the Trainer's construction; a job bigger than this
machine is refused by the memory rule (the analytic estimate against this machine's memory).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import TINY_JOB, train_here

REPO = Path(__file__).resolve().parents[2]
HEADER = 34  # MMIDIDX: magic 9 + version 8 + dtype code 1 + two counts 8 + 8


def one_error(proc, prefix: str) -> str:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, proc.stderr[-3000:]
    return lines[0]


def megatron_prefix(tmp_path: Path, field: str, i: int, value: int) -> str:
    """A 3-document Megatron pair (written by our writer) with one index entry overwritten."""
    from titanlike.data.indexed import write_indexed_dataset

    prefix = tmp_path / "corpus_text_document"
    rng = np.random.default_rng(0)
    write_indexed_dataset(str(prefix), [rng.integers(0, 2000, 300) for _ in range(3)], np.uint16)
    offset, dtype = {"size": (HEADER, "<i4"), "pointer": (HEADER + 4 * 3, "<i8")}[field]
    raw = bytearray(prefix.with_suffix(".idx").read_bytes())
    width = np.dtype(dtype).itemsize
    raw[offset + i * width: offset + (i + 1) * width] = np.array([value], dtype).tobytes()
    prefix.with_suffix(".idx").write_bytes(bytes(raw))
    return str(prefix)


def run(tmp_path, *argv):
    """train.py argv in the test process (conftest.train_here: its exit code and what it said), with the
    pre-flight checks train.py runs (the memory rule's among them)."""
    return train_here([*TINY_JOB, "--job.dump_folder", str(tmp_path / "dump"), *argv], checks=None)


def test_dataset_path_with_the_default_dataset(tmp_path):
    proc = run(tmp_path, "--training.dataset_path", "corpus.txt")
    assert proc.returncode == 2
    assert one_error(proc, "config error") == (
        "config error: training.dataset_path is only read by the text, huggingface and megatron datasets; "
        "the default dataset is the embedded corpus")


def test_empty_text_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = run(tmp_path, "--training.dataset", "text", "--training.dataset_path", str(tmp_path / "empty"))
    assert proc.returncode == 2
    assert "no .txt, .txt.gz, .jsonl, .jsonl.gz files under directory" in one_error(proc, "config error")


def test_text_file_without_a_usable_line(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text('{"content": "the wrong key"}\n{"content": "again"}\n')
    proc = run(tmp_path, "--training.dataset", "text", "--training.dataset_path", str(path))
    assert proc.returncode == 2
    assert one_error(proc, "config error") == (
        f"config error: training.dataset_path: {path} holds no usable document: 2 of its 2 lines are not JSON "
        f"objects with a string 'text' field (first: {path} line 1: missing key 'text')")


@pytest.mark.parametrize("field, i, value, fragment", [
    ("size", 1, -5, "damaged index: sequence 1 (document 1) has a negative size of -5 tokens"),
    ("pointer", 2, 10**6, "damaged index: sequence 2 (document 2) points at byte 1000000, past the end of "
                          "corpus_text_document.bin (1800 bytes), but the sizes before it place it at byte 1200"),
])
def test_damaged_megatron_index(tmp_path, field, i, value, fragment):
    prefix = megatron_prefix(tmp_path, field, i, value)
    proc = run(tmp_path, "--training.dataset", "megatron", "--training.dataset_path", prefix)
    assert proc.returncode == 2
    line = one_error(proc, "config error")
    assert line.startswith(f"config error: training.dataset_path: {prefix}.idx: ") and fragment in line, line


def test_seq_len_beyond_the_model_context(tmp_path):
    proc = run(tmp_path, "--training.seq_len", "4096")
    assert proc.returncode == 2
    assert one_error(proc, "config error") == (
        "config error: llama3 debugmodel: training.seq_len 4096 exceeds the model's context of 2048 positions; "
        "set training.seq_len to at most 2048")


def test_data_error_in_trainer_construction(tmp_path):
    # Usable text, but fewer tokens than one sample: only tokenizing the corpus (the loader) can tell.
    path = tmp_path / "short.txt"
    path.write_text("too short")
    proc = run(tmp_path, "--training.dataset", "text", "--training.dataset_path", str(path))
    assert proc.returncode == 2
    assert one_error(proc, "data error") == (
        f"data error: dataset '{path}' has only 6 tokens, fewer than one sample of seq_len + 1 = 65; "
        "use more text or a shorter seq_len")


def test_job_this_machine_cannot_hold(tmp_path):
    proc = run(tmp_path, "--model.flavor", "405B", "--training.seq_len", "4096")
    assert proc.returncode == 2
    assert one_error(proc, "config error").startswith("config error: the job needs about ")
