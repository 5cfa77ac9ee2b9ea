"""train.py on Megatron-format data written by scripts/preprocess_data.py, single prefix and a blend; the jobs
and their refusals run in the test process (conftest.train_in_process, train_here)."""

import gzip
import json
import subprocess
import sys

import pytest

from conftest import REPO, TINY_JOB, read_metrics, train_here, train_in_process


@pytest.fixture(scope="module")
def prefixes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("megatron")
    with gzip.open(REPO / "titanlike/data/assets/kjv_chapters.jsonl.gz", "rt") as f:
        docs = [json.loads(line) for line in f][:300]
    out = []
    for name, part in (("a", docs[:150]), ("b", docs[150:])):
        src = tmp / f"{name}.jsonl"
        src.write_text("".join(json.dumps(d) + "\n" for d in part))
        subprocess.run([sys.executable, str(REPO / "scripts/preprocess_data.py"), "--input", str(src),
                        "--output-prefix", str(tmp / name), "--append-eod", "--workers", "1"],
                       check=True, capture_output=True, timeout=120)
        out.append(str(tmp / f"{name}_text_document"))
    return out


@pytest.mark.parametrize("blend", [False, True])
def test_train_on_megatron_data(tmp_path, prefixes, blend):
    path = f"0.7 {prefixes[0]} 0.3 {prefixes[1]}" if blend else prefixes[0]
    train_in_process([*TINY_JOB, "--training.steps", "3", "--training.local_batch_size", "2",
                      "--training.dataset", "megatron", "--training.dataset_path", path,
                      "--job.dump_folder", str(tmp_path)])
    losses = [r["loss"] for r in read_metrics(tmp_path)]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses)


def test_missing_prefix_is_a_config_error(tmp_path):
    proc = train_here(["--training.dataset", "megatron", "--training.dataset_path", str(tmp_path / "nope")])
    assert proc.returncode == 2
    assert "nope.bin does not exist" in proc.stderr


def test_validation_on_the_held_out_split(tmp_path, prefixes):
    from titanlike.data.blend import build_megatron_dataset

    train_in_process([*TINY_JOB, "--training.steps", "2", "--training.local_batch_size", "4",
                      "--training.dataset", "megatron", "--training.dataset_path", prefixes[0],
                      "--validation.enable", "--validation.freq", "2", "--job.dump_folder", str(tmp_path)])
    valid = [r for r in read_metrics(tmp_path) if "validation_loss" in r]
    # validation.steps -1: every whole batch of 4 of the 'valid' part of split 969,30,1, once.
    held_out = build_megatron_dataset(prefixes[0], seq_len=64, num_samples=None, seed=0, split="969,30,1",
                                      split_name="valid", cache_dir=str(tmp_path / "cache"))
    assert len(held_out) >= 4
    assert [r["step"] for r in valid] == [2]
    assert valid[0]["validation_tokens"] == len(held_out) // 4 * 4 * 64
    assert 0 < valid[0]["validation_loss"] < 20


def test_training_reads_the_train_part_of_training_split(tmp_path, prefixes):
    # Training and validation must cut the same split, or the 'valid' part overlaps training data.
    from titanlike.config import load_job_config
    from titanlike.train.plan import plan_job
    from titanlike.train.trainer import Trainer

    cfg = load_job_config([*TINY_JOB, "--model.flavor", "debugmodel_tiny", "--training.steps", "1",
                           "--training.dataset", "megatron", "--training.dataset_path", prefixes[0],
                           "--training.split", "50,50,0", "--job.dump_folder", str(tmp_path)])
    trainer = Trainer(plan_job(cfg, 1))
    try:
        source = trainer.dataloader.dataset.samples.source
        assert (source.split, source.split_name) == ("50,50,0", "train")
    finally:
        trainer.close()


@pytest.fixture(scope="module")
def sentence_prefix(tmp_path_factory):
    """200 chapters preprocessed with --split-sentences: one Megatron sequence per sentence."""
    tmp = tmp_path_factory.mktemp("megatron_sentences")
    with gzip.open(REPO / "titanlike/data/assets/kjv_chapters.jsonl.gz", "rt") as f:
        docs = [json.loads(line) for line in f][:200]
    src = tmp / "chapters.jsonl"
    src.write_text("".join(json.dumps(d) + "\n" for d in docs))
    subprocess.run([sys.executable, str(REPO / "scripts/preprocess_data.py"), "--input", str(src),
                    "--output-prefix", str(tmp / "chapters"), "--split-sentences", "--workers", "1"],
                   check=True, capture_output=True, timeout=120)
    return str(tmp / "chapters_text_sentence")


@pytest.mark.parametrize("family", [("bert", ()), ("t5", ("--span_corruption.decoder_seq_len", "16"))],
                         ids=["bert", "t5"])
def test_encoder_families_train_on_sentence_split_data(tmp_path, sentence_prefix, family):
    name, extra = family
    train_in_process([*TINY_JOB, "--model.name", name, "--model.flavor", "debugmodel", *extra, "--training.steps",
                      "3", "--training.local_batch_size", "4", "--training.dataset", "megatron",
                      "--training.dataset_path", sentence_prefix, "--validation.enable", "--validation.freq", "3",
                      "--validation.steps", "2", "--job.dump_folder", str(tmp_path)])
    records = read_metrics(tmp_path)
    losses = [r["loss"] for r in records if "loss" in r]
    valid = [r for r in records if "validation_loss" in r]
    assert len(losses) == 3 and all(0 < x < 20 for x in losses)
    # Masked tokens (BERT) or decoder targets (T5) of 2 held-out batches of 4 samples: far fewer than
    # the 2 x 4 x 64 positions a causal model scores.
    assert [r["step"] for r in valid] == [3] and 0 < valid[0]["validation_tokens"] < 2 * 4 * 64
    assert 0 <= valid[0]["validation_accuracy"] <= 1


def test_encoder_samples_need_sentence_split_sources(tmp_path):
    proc = train_here([*TINY_JOB, "--model.name", "bert", "--model.flavor", "debugmodel", "--training.dataset",
                       "text", "--training.dataset_path", str(REPO / "README.md"), "--job.dump_folder", str(tmp_path)])
    assert proc.returncode == 2
    assert "cannot give masked_lm samples" in proc.stderr and "--split-sentences" in proc.stderr
