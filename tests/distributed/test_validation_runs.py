"""Validation runs through train.py: the held-out loss, perplexity and accuracy reach the console,
TensorBoard and the JSONL metrics; they leave training untouched; and every parallel layout
measures the same validation loss as one process (tolerance: test_fsdp_parity.py's RTOL).
Greedy samples of fixed prompts (validation.sample_prompts) reach TensorBoard as text and the JSONL,
equal what scripts/generate.py's engine gives the saved model, leave training untouched, and FSDP
gives the same as one process."""

import math

import pytest

from conftest import train_metrics
from test_fsdp_parity import RTOL, assert_same_curve

VALIDATE = ("--validation.enable", "--validation.freq", "2", "--validation.steps", "2")
SAMPLE_PROMPTS = ["In the beginning", "And God said"]
SAMPLES = ("--validation.sample_prompts", ",".join(SAMPLE_PROMPTS), "--validation.sample_max_tokens", "6")


def split_records(records):
    """(training records, validation records) of a metrics.jsonl."""
    train = [r for r in records if "loss" in r]
    valid = [r for r in records if "validation_loss" in r]
    return train, valid


def samples_of(records):
    """{step: [(prompt, text), ...]} of the sample records of a metrics.jsonl."""
    return {r["step"]: [(s["prompt"], s["text"]) for s in r["samples"]] for r in records if "samples" in r}


def assert_same_validation(valid, ref_valid):
    """Validation runs of a layout measure what one process measured: the same target count, loss
    (RTOL) and accuracy (the same predictions; vocabulary-parallel logits are gathered under TP, and a
    near-tie may flip one)."""
    assert [r["step"] for r in valid] == [r["step"] for r in ref_valid]
    for g, r in zip(valid, ref_valid):
        assert g["validation_tokens"] == r["validation_tokens"], (g, r)
        assert g["validation_loss"] == pytest.approx(r["validation_loss"], rel=RTOL), (g, r)
        assert g["validation_accuracy"] == pytest.approx(r["validation_accuracy"], abs=1.5 / r["validation_tokens"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    dump = tmp_path_factory.mktemp("val_ref")
    records = train_metrics(dump, "single", *VALIDATE, *SAMPLES, "--training.local_batch_size", "8",
                            "--metrics.enable_tensorboard", "--checkpoint.enable", "--checkpoint.interval", "4",
                            "--checkpoint.last_save_model_only")
    return dump / "single", records


def test_validation_is_reported_and_leaves_training_alone(reference, single_process_reference):
    dump, records = reference
    train, valid = split_records(records)
    assert_same_curve(train, single_process_reference)
    assert [r["step"] for r in valid] == [2, 4]
    for r in valid:
        assert r["validation_perplexity"] == pytest.approx(math.exp(r["validation_loss"]), rel=1e-9)
        assert r["validation_tokens"] == 2 * 8 * 64  # 2 batches of 8 samples of 64 targets
        # Next-token accuracy: a fraction of the targets, well above chance (1/2048) once trained.
        assert 0 <= r["validation_accuracy"] <= 1
    assert valid[1]["validation_accuracy"] > 10 / 2048
    assert valid[1]["validation_loss"] < valid[0]["validation_loss"]

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # torchtitan's layout: one timestamped folder per launch (beside it the folder's released lock)
    (run,) = [p for p in (dump / "tb").iterdir() if p.is_dir()]
    events = EventAccumulator(str(run))
    events.Reload()
    assert [e.step for e in events.Scalars("validation/loss")] == [2, 4]
    assert events.Scalars("validation/loss")[1].value == pytest.approx(valid[1]["validation_loss"], rel=1e-6)
    assert "validation/perplexity" in events.Tags()["scalars"]

    # Samples at every validation (sample_freq 0: validation.freq): the engine's greedy tokens on the
    # saved model, in TensorBoard as Markdown text.
    from tensorboard.util import tensor_util

    from titanlike.checkpoint import load_model
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
    from titanlike.inference import Engine, SamplingParams
    from titanlike.observe.metrics import sample_markdown

    samples = samples_of(records)
    assert list(samples) == [2, 4] and [p for p, _ in samples[4]] == SAMPLE_PROMPTS
    tokenizer = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    stops = frozenset({tokenizer.eos_id})
    want, _ = Engine(load_model(dump / "checkpoint")).generate(
        [tokenizer.encode(p, bos=True, eos=False) for p in SAMPLE_PROMPTS],
        SamplingParams(max_new_tokens=6, stop_token_ids=stops),
        # The samples' text leaves out special tokens, as transformers' skip_special_tokens=True (issue 47).
        detokenize=lambda t: tokenizer.decode([x for x in t if x not in stops and x not in tokenizer.special_ids]))
    assert [t for _, t in samples[4]] == [c.text for c in want] and all(c.text for c in want)
    for i, (prompt, text) in enumerate(samples[4]):
        written = events.Tensors(f"samples/{i}/text_summary")
        assert [e.step for e in written] == [2, 4]
        assert tensor_util.make_ndarray(written[1].tensor_proto).item().decode() == sample_markdown(prompt, text)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.train_run(*VALIDATE, *layout, nproc=2))
                                    for name, layout in [
    ("fsdp2", ("--training.local_batch_size", "4", *SAMPLES)),
    ("tp2", ("--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "8")),
    ("pp2", ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size",
             "2", "--training.local_batch_size", "8")),
]])
def test_layouts_measure_the_same_validation_loss(train_run, reference, layout):
    _, ref = reference
    train, valid = split_records(train_run.metrics)
    ref_train, ref_valid = split_records(ref)
    assert_same_curve(train, ref_train)
    assert_same_validation(valid, ref_valid)
    if layout == "fsdp2":  # every rank runs the samples (FSDP gathers each layer's weights); rank 0 reports them
        assert samples_of(train_run.metrics) == samples_of(ref)
