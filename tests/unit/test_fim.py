"""Fill-in-the-Middle (titanlike/data/fim.py, [fim] of objectives/causal_lm.py): agreement with Megatron-LM's
GPTFIMDataset (tests/assets/fim_reference.json, written by scripts/fim_reference.py), the formats, the
per-sample random streams, the refusals, and a two-step run on Megatron data with FIM on."""

import json

import numpy as np
import pytest

from conftest import REPO, TINY_JOB, read_metrics, train_here, train_in_process

from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
from titanlike.data.errors import DataError
from titanlike.data.fim import FimSamples, FimTransform, fim_token_ids, megatron_stream, sample_rng
from titanlike.data.gpt_dataset import GPTDataset
from titanlike.data.indexed import write_indexed_dataset

REFERENCE = json.loads((REPO / "tests/assets/fim_reference.json").read_text())
RESERVED = {"prefix": "<|reserved_special_token_2|>", "middle": "<|reserved_special_token_3|>",
            "suffix": "<|reserved_special_token_4|>", "pad": "<|reserved_special_token_5|>"}
FIM_ARGS = ["--fim.prefix_token", RESERVED["prefix"], "--fim.middle_token", RESERVED["middle"],
            "--fim.suffix_token", RESERVED["suffix"], "--fim.pad_token", RESERVED["pad"]]
TEXT = "In the beginning God created the heaven and the earth. And the earth was without form, and void."


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(DEFAULT_TOKENIZER_PATH)


def transform(tokenizer, split: str = "", **options) -> FimTransform:
    ids = fim_token_ids(tokenizer, **RESERVED, split=split)
    return FimTransform(tokenizer, ids, **{"rate": 1.0, "spm_rate": 0.0, **options})


def parts(out: list[int], ids) -> tuple[list[int], list[int], list[int]]:
    """(prefix, middle, suffix) ids of one rearranged piece; SPM's prefix and middle follow each other
    with no sentinel between, so they come back as one middle."""
    s, m = out.index(ids.suffix), out.index(ids.middle)
    return out[1:s], out[m + 1:], out[s + 1:m]


# -- Megatron-LM's samples -------------------------------------------------------------------------

@pytest.mark.parametrize("tokenizer_path", ["tests/assets/tokenizer", "debug"])
def test_samples_agree_with_megatron_gptfimdataset(tmp_path, tokenizer_path):
    tok = build_tokenizer(DEFAULT_TOKENIZER_PATH if tokenizer_path == "debug" else REPO / tokenizer_path)
    prefix = str(tmp_path / "docs")
    write_indexed_dataset(prefix, REFERENCE["documents"], np.uint16)
    ds = GPTDataset(prefix, seq_len=REFERENCE["seq_len"], seed=REFERENCE["seed"], split=REFERENCE["split"])
    tokens = REFERENCE["tokens"]
    for name, case in REFERENCE["cases"].items():
        ids = fim_token_ids(tok, **{k: tokens[k] for k in ("prefix", "middle", "suffix", "pad", "eod")},
                            split=case.get("split_sample", ""))
        fim = FimTransform(tok, ids, rate=case["rate"], spm_rate=case["spm_rate"],
                           fragment_rate=case.get("fragment_rate"), no_prefix=case.get("no_prefix", ""))
        expected = REFERENCE["samples"][name]
        got = [s.tolist() for s in megatron_stream(ds, fim, REFERENCE["seed"], len(expected))]
        assert got == expected, name
        # Sample 0's own stream is Megatron's first one: the per-sample samples start where Megatron's do.
        assert FimSamples(ds, fim, REFERENCE["seed"])[0].tolist() == expected[0], name
        if case["rate"] == 1.0 and "no_prefix" not in case:  # the reference does rearrange every sample
            assert all(s != ds[i].tolist() for i, s in enumerate(expected)), name


# -- formats ---------------------------------------------------------------------------------------

def test_psm_and_spm_keep_the_text_in_their_order(tokenizer):
    sample = np.array(tokenizer.encode(TEXT, bos=False, eos=False))
    for spm in (0.0, 1.0):
        fim = transform(tokenizer, spm_rate=spm)
        ids = fim.tokens
        checked = 0
        for seed in range(30):
            out = fim(sample, sample_rng(seed, 0)).tolist()
            assert len(out) == len(sample) and out[0] == ids.prefix
            assert (out[1] == ids.suffix) == (spm == 1.0)
            if ids.middle not in out:  # a middle shorter than what the sentinels add is cut whole, <MID> too
                continue
            checked += 1
            assert out.index(ids.suffix) < out.index(ids.middle)
            prefix, middle, suffix = (tokenizer.decode(p) for p in parts(out, ids))
            # three sentinels and the re-encoding make it longer: the end of the last part (the middle) is cut
            assert TEXT.startswith(prefix + middle) and TEXT.endswith(suffix)
        assert checked >= 20


def test_each_document_is_rearranged_alone(tokenizer):
    eos = tokenizer.eos_id
    a, b = (tokenizer.encode(t, bos=False, eos=False) for t in ("And God said, Let there be light", "and there was light."))
    # the last document long enough that the growth of the first two is cut from its end
    sample = np.array(a + [eos] + b + [eos] + tokenizer.encode(TEXT, bos=False, eos=False))
    fim = transform(tokenizer)
    out = fim(sample, sample_rng(0, 3)).tolist()
    assert len(out) == len(sample)
    pieces = [p for p in " ".join(map(str, out)).split(f" {eos} ")]
    assert len(pieces) == 3 and all(p.split()[0] == str(fim.tokens.prefix) for p in pieces)


def test_fragments_between_split_tokens(tokenizer):
    comma = tokenizer.encode(",", bos=False, eos=False)[0]
    sample = np.array(tokenizer.encode(TEXT + " " + TEXT, bos=False, eos=False))
    fim = transform(tokenizer, split=",", fragment_rate=1.0)
    out = fim(sample, sample_rng(0, 0)).tolist()
    assert out[0] == fim.tokens.prefix
    after = [out[i + 1] for i, t in enumerate(out[:-1]) if t == comma]
    assert after and all(t == fim.tokens.prefix for t in after)
    # rate 0: a sample with split tokens is left whole; fragment_rate 0: its fragments are
    out0 = transform(tokenizer, split=",", rate=0.0, fragment_rate=1.0)(sample, sample_rng(0, 0))
    out1 = transform(tokenizer, split=",", fragment_rate=0.0)(sample, sample_rng(0, 0))
    assert np.array_equal(out0, sample) and np.array_equal(out1, sample)


def test_no_prefix_leaves_matching_pieces_alone(tokenizer):
    sample = np.array(tokenizer.encode(TEXT, bos=False, eos=False))
    assert np.array_equal(transform(tokenizer, no_prefix="In the")(sample, sample_rng(0, 0)), sample)
    assert not np.array_equal(transform(tokenizer, no_prefix="And")(sample, sample_rng(0, 0)), sample)


def test_length_is_kept_cut_or_padded(tokenizer):
    eos = tokenizer.eos_id
    text = tokenizer.encode(TEXT, bos=False, eos=False)
    # As Megatron: an empty segment is dropped with its end of document, and the sample padded back.
    sample = np.array([eos, eos] + text)
    fim = transform(tokenizer, rate=0.0)
    out = fim(sample, sample_rng(0, 0)).tolist()
    assert out == text + [fim.tokens.pad] * 2
    assert transform(tokenizer, rate=1.0)(sample, sample_rng(0, 0)).shape == sample.shape


def test_each_sample_has_its_own_stream(tokenizer):
    windows = [np.array(tokenizer.encode(TEXT[i:], bos=False, eos=False)[:16]) for i in range(8)]
    fim = transform(tokenizer, rate=0.5, spm_rate=0.5)
    a, b = FimSamples(windows, fim, seed=7), FimSamples(windows, fim, seed=7)
    forward = [a[i].tolist() for i in range(8)]
    backward = [b[i].tolist() for i in reversed(range(8))][::-1]
    assert forward == backward  # whatever was read before: any rank, any resume
    assert forward != [s.tolist() for s in FimSamples(windows, fim, seed=8)]
    assert len(a) == 8 and a[-1].tolist() == forward[-1]


# -- tokens and options ----------------------------------------------------------------------------

def test_missing_token_is_one_sentence(tokenizer):
    with pytest.raises(DataError, match=r"fim.prefix_token '<fim_prefix>' is not a token of the tokenizer .*"
                                        r"reserved_special_token_2"):
        fim_token_ids(tokenizer, prefix="<fim_prefix>", middle="<fim_middle>", suffix="<fim_suffix>", pad="<fim_pad>")
    hf = build_tokenizer(REPO / "tests/assets/tokenizer")
    assert fim_token_ids(hf, **RESERVED) == fim_token_ids(tokenizer, **RESERVED)
    assert fim_token_ids(tokenizer, **RESERVED).eod == tokenizer.eos_id


@pytest.mark.parametrize("extra, message", [
    (["--fim.rate", "1.5"], "fim.rate must be between 0 and 1, got 1.5"),
    (["--fim.rate", "0.5", "--fim.spm_rate", "-0.1"], "fim.spm_rate must be between 0 and 1, got -0.1"),
    (["--fim.split_sample", ","], "fim.split_sample needs fim.fragment_rate"),
    (["--fim.rate", "0.5"], "fim.prefix_token '<fim_prefix>' is not a token of the tokenizer"),
    (["--fim.rate", "0.5", *FIM_ARGS, "--training.dataset", "c4"],
     "training.dataset c4 is a stream; FIM draws each sample's cuts from its index"),
    (["--fim.rate", "0.5", *FIM_ARGS, "--training.objective", "sft"],
     "fim.rate is set, but it configures training.objective causal_lm and this job's objective is sft"),
])
def test_refusals_before_any_process_group(extra, message):
    proc = train_here([*TINY_JOB, *extra])
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr[-500:]


def test_two_steps_on_megatron_data_with_fim(tmp_path, tokenizer):
    """The job's loader yields the FIM samples of the Megatron dataset, and the debug model trains on them."""
    from titanlike.data import build_dataloader
    from titanlike.objectives.causal_lm import CausalLM, FimOptions

    docs = [tokenizer.encode(f"{TEXT[i:]} {TEXT[:i]}", bos=False, eos=True) for i in range(0, 60, 2)]
    prefix = str(tmp_path / "docs")
    write_indexed_dataset(prefix, docs, np.uint16)
    train_in_process([*TINY_JOB, "--training.steps", "2", "--training.local_batch_size", "2",
                      "--training.dataset", "megatron", "--training.dataset_path", prefix,
                      "--fim.rate", "0.9", *FIM_ARGS, "--job.dump_folder", str(tmp_path / "run")])
    losses = [r["loss"] for r in read_metrics(tmp_path / "run")]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)

    options = FimOptions(rate=0.9, **{f"{k}_token": v for k, v in RESERVED.items()})
    args = dict(dataset="megatron", dataset_path=prefix, tokenizer=tokenizer, seq_len=64, global_batch_size=4,
                seed=0, num_samples=8, split="1", objective=CausalLM(fim=options))
    whole = next(iter(build_dataloader(local_batch_size=4, dp_rank=0, dp_degree=1, **args)))
    halves = [next(iter(build_dataloader(local_batch_size=2, dp_rank=r, dp_degree=2, **args))) for r in (0, 1)]
    assert np.array_equal(whole["inputs"].numpy(), np.concatenate([h["inputs"].numpy() for h in halves]))
    assert (whole["inputs"] == tokenizer.special_tokens[RESERVED["prefix"]]).any()
    # the loader's position is a sample number, as without FIM: a resumed loader reads on alike
    loader = build_dataloader(local_batch_size=2, dp_rank=1, dp_degree=2, **args)
    it = iter(loader)
    next(it)
    state, expected = loader.state_dict(), next(it)
    resumed = build_dataloader(local_batch_size=2, dp_rank=1, dp_degree=2, **args)
    resumed.load_state_dict(state)
    got = next(iter(resumed))
    assert all(np.array_equal(got[k].numpy(), expected[k].numpy()) for k in ("inputs", "labels"))
