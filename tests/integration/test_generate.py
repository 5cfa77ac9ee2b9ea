"""scripts/generate.py on a checkpoint written by train.py: greedy decoding is the argmax of the
loaded model's logits token by token, sampling is reproducible from the seed, and a tokenizer
that does not fit the model is refused. The job and the script run in the test process
(conftest.train_in_process, script_here: the script's main, its exit code and what it printed)."""

import sys

import pytest
import torch

from conftest import REPO, TINY_JOB, script_here, train_in_process


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    dump = tmp_path_factory.mktemp("gen")
    train_in_process([*TINY_JOB, "--model.flavor", "debugmodel_tiny", "--training.steps", "2", "--checkpoint.enable",
                      "--checkpoint.interval", "2", "--job.dump_folder", str(dump)])
    return dump / "checkpoint"


def _generate(*args):
    return script_here("generate.py", *args)


def test_greedy_is_the_argmax_continuation(checkpoint):
    sys.path.insert(0, str(REPO / "scripts"))
    from generate import generate

    from titanlike.checkpoint import load_model
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer

    tok = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    model = load_model(checkpoint)
    prompt = tok.encode("And God said", bos=True, eos=False)
    new = generate(model, prompt, max_new_tokens=6, temperature=0, top_k=None, eos_id=None)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert new == ids[len(prompt):]

    proc = _generate(checkpoint, "--prompt", "And God said", "--max-new-tokens", "6", "--temperature", "0")
    assert proc.returncode == 0, proc.stderr
    # The text leaves out special tokens, as transformers' decode(skip_special_tokens=True) (issue 47).
    assert proc.stdout.strip() == "And God said" + tok.decode([t for t in new if t not in tok.special_ids])


def test_sampling_is_reproducible_and_bad_tokenizer_is_refused(checkpoint, tmp_path):
    runs = [_generate(checkpoint, "--prompt", "In the beginning", "--max-new-tokens", "8", "--seed", seed)
            for seed in (1, 1)]
    assert runs[0].returncode == 0, runs[0].stderr
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.startswith("In the beginning")

    # A tokenizer file with fewer ranks gives a smaller vocabulary than the model's.
    lines = (REPO / "titanlike/data/assets/debug_tokenizer.tiktoken").read_text().splitlines()[:1000]
    small = tmp_path / "small.tiktoken"
    small.write_text("\n".join(lines) + "\n")
    proc = _generate(checkpoint, "--tokenizer", small)
    assert proc.returncode == 1 and "pass the tokenizer it was trained with" in proc.stderr
