"""Preference pairs (data/preferences.py) and the dpo objective's batch and rules: rendering with the
prompt masked, packing that keeps pairs whole, the packed loss equal to the unpacked one on our own
model, truncation and dropping counted, and bad input refused in one sentence."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sft_assets import TAGGED, tokenizer_folder, write_jsonl
from titanlike.data import DataError, build_tokenizer
from titanlike.data.chat_template import load_chat_template, tokenize_conversation
from titanlike.data.preferences import PreferenceSamples, tokenize_pairs
from titanlike.objectives.base import BatchContext
from titanlike.objectives.preference import DPO, DPOOptions

ROWS = [
    {"prompt": "What is two and two?", "chosen": "Four.", "rejected": "Five, probably."},
    {"prompt": "Name a colour", "chosen": "Blue", "rejected": "A dog"},
    # The conversation so far as the prompt (an earlier assistant turn is not trained on), and
    # message lists as the answers.
    {"prompt": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hello"},
                {"role": "assistant", "content": "Hi! How can I help?"}, {"role": "user", "content": "A number?"}],
     "chosen": [{"role": "assistant", "content": "Seven."}],
     "rejected": [{"role": "assistant", "content": "I cannot say which number you would like best."}]},
    {"prompt": "Say yes", "chosen": "yes", "rejected": "no"},
    {"prompt": "Say no", "chosen": "no", "rejected": "yes, certainly, and at length"},
]


@pytest.fixture(scope="module")
def chatml(tmp_path_factory):
    tok = build_tokenizer(str(tokenizer_folder(tmp_path_factory.mktemp("tok"), TAGGED["chatml"])))
    return tok, load_chat_template("auto", tok)


def _pairs(chatml, rows=ROWS, seq_len=256, **kw):
    tok, template = chatml
    return tokenize_pairs([(f"pairs.jsonl line {i + 1}", r) for i, r in enumerate(rows)], template, tok,
                          seq_len=seq_len, **kw)


def test_answers_alone_are_trained(chatml):
    tok, template = chatml
    pairs = _pairs(chatml)
    b = pairs.bounds
    for k, row in enumerate(ROWS):
        for side, doc in (("chosen", 2 * k), ("rejected", 2 * k + 1)):
            labels = pairs.labels[b[doc]: b[doc + 1]]
            trained = labels[labels != -100]
            answer = row[side] if isinstance(row[side], str) else row[side][0]["content"]
            # What is trained is the answer and the template's end of turn, nothing of the prompt.
            text = tok.decode(trained.tolist())
            assert text.startswith(answer) and text.rstrip().endswith("<|im_end|>"), text
            assert (labels[: np.flatnonzero(labels != -100)[0]] == -100).all()
    # The earlier assistant turn of the third prompt is the assistant's, but not trained on.
    third = pairs.labels[b[4]: b[5]]
    assert "How can I help" not in tok.decode(third[third != -100].tolist())


def test_packing_keeps_pairs_whole_and_counts_them(chatml):
    pairs = _pairs(chatml)
    samples = PreferenceSamples(pairs, seq_len=256, packing=True, pad_id=0)
    assert len(samples) < len(ROWS)
    objective = DPO()
    seen = []
    for i in range(len(samples)):
        s = samples[i]
        ids = s["document_ids"]
        assert (np.diff(ids) >= 0).all()
        mb = objective.prepare({k: torch.from_numpy(v)[None] for k, v in s.items()},
                               BatchContext(torch.device("cpu"), mask_kernel="sdpa"))
        docs = mb.targets["document_ids"][0]
        n_pairs = int(mb.units)
        # Documents 0..2n-1 are n whole pairs (each side with answer tokens), then the padding.
        assert set(docs.tolist()) <= set(range(2 * n_pairs + 1))
        for d in range(2 * n_pairs):
            assert ((docs == d) & (mb.targets["labels"][0] != -100)).any()
        assert mb.targets["pair_start"][0].nonzero().flatten().tolist() == [
            int((docs == 2 * k).nonzero()[0]) for k in range(n_pairs)]
        for k in range(n_pairs):
            seen.append(tuple(tuple(s["labels"][ids == d].tolist()) for d in (2 * k, 2 * k + 1)))
    want = [tuple(tuple(pairs.labels[pairs.bounds[d]: pairs.bounds[d + 1]].tolist()) for d in (2 * k, 2 * k + 1))
            for k in range(len(ROWS))]
    assert sorted(seen) == sorted(want)


def _tiny_llama(vocab_size: int):
    from titanlike.models.llama3 import llama3_flavors
    from titanlike.models.registry import get_model_spec

    args = dataclasses.replace(llama3_flavors["debugmodel_tiny"], n_layers=2, vocab_size=vocab_size, max_seq_len=256)
    with torch.device("meta"):
        model = get_model_spec("llama3").model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo", "ipo"])
def test_packed_loss_equals_unpacked(chatml, loss_type):
    """The same pairs, several to a sample or one per sample, give the same summed loss and gradients
    (document masks and per-document positions keep the packed pairs apart)."""
    tok, _ = chatml
    pairs = _pairs(chatml)
    model = _tiny_llama(tok.vocab_size)
    objective = DPO(DPOOptions(loss_type=loss_type))
    results = []
    for packing in (True, False):
        samples = PreferenceSamples(pairs, seq_len=256, packing=packing, pad_id=0)
        batch = {k: torch.from_numpy(np.stack([samples[i][k] for i in range(len(samples))])) for k in samples.fields}
        ctx = BatchContext(torch.device("cpu"), mask_kernel="sdpa")
        mb = objective.prepare(batch, ctx)
        # A made-up reference, the same per pair token either way: a function of the target ids.
        labels = mb.targets["labels"]
        mb.targets["ref_logps"] = torch.where(labels >= 0, -0.01 * (labels % 7), 0.0)
        model.zero_grad()
        loss = objective.loss(model(mb.inputs, **mb.forward_kwargs()), mb.targets, ctx).value
        loss.backward()
        results.append((len(samples), int(mb.units), loss.item(),
                        [p.grad.clone() for p in model.parameters()]))
    (n_packed, units_packed, packed, g_packed), (n_padded, units_padded, padded, g_padded) = results
    assert n_packed < n_padded == len(ROWS) == units_packed == units_padded
    assert packed == pytest.approx(padded, abs=1e-5) and packed > 0
    for a, b in zip(g_packed, g_padded):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_overlong_pairs_are_truncated_or_dropped_and_counted(chatml, caplog):
    tok, template = chatml
    long = {"prompt": "Count", "chosen": " ".join(["one"] * 40), "rejected": " ".join(["two"] * 30)}
    rows = [ROWS[0], long]
    prompt_len = len(tokenize_conversation(template, tok, [{"role": "user", "content": "Count"}])[0])
    with caplog.at_level("INFO", logger="titanlike"):
        kept = _pairs(chatml, rows, seq_len=100)
        assert "1 pairs longer than training.seq_len = 100 positions truncated (answers shortened), 0 dropped" in caplog.text
        assert kept.lengths().tolist()[1] <= 100 and len(kept) == 2
        b = kept.bounds
        for doc in (2, 3):  # both sides keep the prompt whole and some of their answer
            labels = kept.labels[b[doc]: b[doc + 1]]
            assert (labels[: prompt_len - 1] == -100).all() and (labels != -100).sum() > 3
        dropped = _pairs(chatml, rows, seq_len=100, overlong="drop", section="reward")
        assert len(dropped) == 1 and "1 dropped (reward.overlong drop)" in caplog.text  # the objective's section
    with pytest.raises(DataError, match="no preference pair is left"):
        _pairs(chatml, [long], seq_len=100, overlong="drop")


def _one_sentence(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text and "Traceback" not in text
    return text


@pytest.mark.parametrize("row, seq_len, words", [
    ({"prompt": "hi", "chosen": "a"}, 256, "pairs.jsonl line 1 has no 'rejected'"),
    ({"prompt": "hi", "rejected": "a", "chosen": None}, 128, "has no 'chosen'"),
    ({"chosen": "a", "rejected": "b"}, 128, "has no 'prompt'"),
    ({"prompt": "hi", "chosen": "same", "rejected": "same"}, 128, "'chosen' equals 'rejected'"),
    ({"prompt": "hi", "chosen": 3, "rejected": "b"}, 128, "'chosen' is int"),
    ({"prompt": " ".join(["word"] * 80), "chosen": "a", "rejected": "b"}, 128, "the prompt fills training.seq_len 128"),
])
def test_bad_pairs_are_refused_in_one_sentence(chatml, row, seq_len, words):
    with pytest.raises(DataError) as e:
        _pairs(chatml, [row], seq_len=seq_len)
    assert words in _one_sentence(e.value) and "pairs.jsonl line 1" in str(e.value)


def test_precomputed_reference_values_are_laid_out_along_the_labels(chatml):
    """Per-token values land on the answer's trained positions (the first ones of a cut pair), a
    summed value on its first answer token; the samples carry them as reference_logps."""
    plain = _pairs(chatml, ROWS[:2])
    b, trained = plain.bounds, plain.labels != -100
    counts = [int(trained[b[d]: b[d + 1]].sum()) for d in range(4)]
    rows = [dict(ROWS[0], ref_chosen_logps=[-1.0] * counts[0], ref_rejected_logps=[-2.0] * counts[1]),
            dict(ROWS[1], ref_chosen_logps=-3.5, ref_rejected_logps=[-0.5] * counts[3])]
    pairs = _pairs(chatml, rows, reference=True)
    assert (pairs.reference[~trained] == 0).all()
    sums = [float(pairs.reference[b[d]: b[d + 1]].sum()) for d in range(4)]
    assert sums == [-1.0 * counts[0], -2.0 * counts[1], -3.5, -0.5 * counts[3]]
    samples = PreferenceSamples(pairs, seq_len=256, packing=True, pad_id=0)
    sample = samples[0]
    assert sample["reference_logps"].dtype == np.float32 and sample["reference_logps"].sum() == pytest.approx(sum(sums))
    assert ((sample["reference_logps"] != 0) <= (sample["labels"] != -100)).all()


@pytest.mark.parametrize("refs, words", [
    ({}, "has no 'ref_chosen_logps', which dpo.reference precomputed reads"),
    ({"ref_chosen_logps": [-1.0], "ref_rejected_logps": -2.0}, "ref_chosen_logps holds 1 log-probabilities but the "
     "chosen answer renders to"),
    ({"ref_chosen_logps": "x", "ref_rejected_logps": -2.0}, "ref_chosen_logps is neither a number nor a list"),
    ({"ref_chosen_logps": -1.0, "ref_rejected_logps": float("nan")}, "its ref_rejected_logps is not a finite number"),
    ({"ref_chosen_logps": 1e30, "ref_rejected_logps": -2.0}, "its ref_chosen_logps is 1e+30, but a log-probability is "
     "at most 0"),
    ({"ref_chosen_logps": [0.5] * 4, "ref_rejected_logps": -2.0}, "ref_chosen_logps holds 0.5, but a log-probability "
     "is at most 0"),
    ({"ref_chosen_logps": -1.0, "ref_rejected_logps": -2.0, "ref_fingerprint": "0123456789abcdef"},
     "its reference log-probabilities were computed with another model or tokenizer (ref_fingerprint '0123"),
])
def test_bad_precomputed_reference_is_refused_in_one_sentence(chatml, refs, words):
    with pytest.raises(DataError) as e:
        _pairs(chatml, [dict(ROWS[0], **refs)], reference=True)
    assert words in _one_sentence(e.value) and "pairs.jsonl line 1" in str(e.value)


def test_a_summed_reference_of_a_cut_pair_is_refused(chatml):
    long = {"prompt": "Count", "chosen": " ".join(["one"] * 40), "rejected": " ".join(["two"] * 30),
            "ref_chosen_logps": -50.0, "ref_rejected_logps": -40.0}
    with pytest.raises(DataError, match="the pair is cut to fit training.seq_len, so the summed ref_chosen_logps"):
        _pairs(chatml, [long], seq_len=100, reference=True)


@pytest.mark.parametrize("argv, fragment", [
    (["--dpo.beta", "0"], "dpo.beta must be positive"),
    (["--dpo.loss_type", "ipo", "--dpo.label_smoothing", "0.1"], "dpo.label_smoothing applies to the sigmoid"),
    (["--dpo.label_smoothing", "0.5"], "dpo.label_smoothing must lie in [0, 0.5)"),
    (["--dpo.reference", "adapters"], "dpo.reference adapters is the policy without its LoRA adapters, so it needs "
     "model.converters lora"),
    (["--training.dataset", "default"], "training.dataset 'default' cannot give dpo samples"),
    (["--model.name", "bert", "--model.flavor", "debugmodel"], "dpo trains models that predict the next token"),
    (["--model.name", "mixtral", "--model.flavor", "debugmodel"], "does not train mixture-of-experts models yet"),
    (["--training.objective", "sft"], "dpo.beta is set, but it configures training.objective dpo"),
])
def test_job_rules_refuse_in_one_sentence(tmp_path, argv, fragment):
    from titanlike.config import load_job_config
    from titanlike.config.loader import ConfigError
    from titanlike.train.plan import plan_job

    data = write_jsonl(tmp_path / "p.jsonl", ROWS)
    base = ["--training.objective", "dpo", "--training.dataset", "text", "--training.dataset_path", str(data),
            "--training.seq_len", "128", "--dpo.beta", "0.2"]
    with pytest.raises(ConfigError) as err:
        plan_job(load_job_config([*base, *argv, "--job.dump_folder", str(tmp_path / "out")]), world_size=1)
    assert fragment in _one_sentence(err.value)


def test_a_reference_needs_a_schedule_with_a_forward_only_pass(tmp_path):
    from titanlike.config import load_job_config
    from titanlike.config.loader import ConfigError
    from titanlike.train.plan import plan_job

    data = write_jsonl(tmp_path / "p.jsonl", ROWS)
    argv = ["--training.objective", "dpo", "--training.dataset", "text", "--training.dataset_path", str(data),
            "--training.seq_len", "128", "--parallelism.pipeline_parallel_degree", "2",
            "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble", "--job.dump_folder", str(tmp_path / "out")]
    with pytest.raises(ConfigError) as err:
        plan_job(load_job_config(argv), world_size=2)
    assert "dpo.reference model needs a forward-only pass, which the ZBVZeroBubble" in _one_sentence(err.value)
    plan_job(load_job_config([*argv, "--dpo.loss_type", "simpo"]), world_size=2)  # no reference, no rule
