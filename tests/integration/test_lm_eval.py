"""lm-evaluation-harness on a titanlike checkpoint (`--model titanlike`, titanlike/inference/harness.py)
against lm-eval's own `hf` model on the Hugging Face export of the same weights.

A tiny random Llama (2 layers, context 64, the debug tokenizer.json's vocabulary) is written as a
DCP checkpoint and exported with titanlike's converter. Three tasks are defined here as YAML over
local JSONL files (no hub: HF_DATASETS_OFFLINE and every socket connection refused while they run):
a multiple-choice task (loglikelihood), a perplexity task (loglikelihood_rolling: several windows of
64 tokens) and a generate_until task with stop strings; some contexts are longer than the context
(left truncation). The titanlike model's per-request log-likelihoods equal the hf model's within
1e-4, its accuracies and generated texts exactly; batch size 1 equals batch size 4 (1e-5);
titanlike-eval runs lm-eval's command line; a BERT checkpoint, an unknown model_arg and pipeline
parallelism are refused in one sentence. A 2-rank tensor-parallel run equals one process:
tests/layouts/test_generation_tp.py (its world checks generation and evaluation, one spawn for both);
the assets are tests/lm_eval_assets.py."""

from __future__ import annotations

import json
import math
import os

import pytest

from lm_eval_assets import CONTEXT, build_assets, evaluate, responses

lm_eval = pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return build_assets(tmp_path_factory.mktemp("lm_eval"))


@pytest.fixture(scope="module")
def offline():
    """No hub: datasets offline, and any network connection fails the run."""
    from lm_eval_assets import offline as go_offline

    with pytest.MonkeyPatch.context() as monkeypatch:
        go_offline(monkeypatch)
        yield


def _metrics(result: dict) -> dict:
    return {task: {k: v for k, v in m.items() if "stderr" not in k and isinstance(v, float)}
            for task, m in result["results"].items()}


def _assert_same(ours: dict, theirs: dict, atol: float) -> None:
    a, b = responses(ours), responses(theirs)
    assert a.keys() == b.keys() and all(a[t].keys() == b[t].keys() for t in a)
    for task in a:
        for doc in a[task]:
            for x, y in zip(a[task][doc], b[task][doc], strict=True):
                if isinstance(x, str) or task == "tl_gen":
                    assert x == y, f"{task} doc {doc}: {x!r} != {y!r}"
                elif isinstance(x, (list, tuple)):  # (loglikelihood, is_greedy)
                    assert math.isclose(x[0], y[0], abs_tol=atol) and x[1] == y[1], f"{task} doc {doc}: {x} != {y}"
                else:
                    assert math.isclose(x, y, abs_tol=atol), f"{task} doc {doc}: {x} != {y}"
    ma, mb = _metrics(ours), _metrics(theirs)
    for task in ma:
        for key, value in ma[task].items():
            if key.startswith(("acc", "exact_match")):
                assert value == mb[task][key], f"{task} {key}: {value} != {mb[task][key]}"
            else:
                assert math.isclose(value, mb[task][key], rel_tol=1e-4), f"{task} {key}: {value} != {mb[task][key]}"


@pytest.fixture(scope="module")
def ours(assets, offline) -> dict:
    """The titanlike model's results at batch size 4."""
    return evaluate("titanlike", f"checkpoint={assets['dcp']},tokenizer={assets['hf']}", assets["tasks"])


def test_scores_equal_lm_eval_hf_on_the_export(assets, offline, ours):
    # The export's config says 65536 positions (Llama 3.1's RoPE scaling); the checkpoint's context
    # is 64: lm-eval's hf model is told, so both truncate the same long contexts on the left.
    theirs = evaluate("hf", f"pretrained={assets['hf']},dtype=float32,max_length={CONTEXT}", assets["tasks"])
    # The tasks exercise what they name: truncated contexts and several rolling windows (the first
    # document of each is longer than the context).
    from titanlike.data import build_tokenizer

    tok = build_tokenizer(assets["hf"])
    for name, field in (("mc", "question"), ("ppl", "text"), ("gen", "question")):
        first = json.loads(open(os.path.join(assets["tasks"], f"{name}.jsonl")).readline())[field]
        assert len(tok.encode(first, bos=True, eos=False)) > CONTEXT + 8, name
    per_doc = responses(ours)
    assert len(per_doc["tl_mc"]) == 8 and len(per_doc["tl_ppl"]) == 5 and len(per_doc["tl_gen"]) == 6
    _assert_same(ours, theirs, atol=1e-4)

    one = evaluate("titanlike", f"checkpoint={assets['dcp']},tokenizer={assets['hf']}", assets["tasks"],
                   batch_size=1)
    _assert_same(one, ours, atol=1e-5)


def test_command_line_and_refusals(assets, offline, tmp_path, capsys, monkeypatch):
    import lm_eval.tasks

    from titanlike.cli.eval import main

    class LocalTasks(lm_eval.tasks.TaskManager):
        """lm-eval's command line indexes its thousands of built-in tasks first (~30 s here): the
        test's tasks only."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", LocalTasks)

    out = tmp_path / "out"
    assert main(["--model", "titanlike", "--model_args", f"checkpoint={assets['hf']}", "--tasks", "tl_mc",
                 "--include_path", assets["tasks"], "--device", "cpu", "--batch_size", "8", "--limit", "4",
                 "--output_path", str(out)]) == 0
    (results,) = out.rglob("results_*.json")
    assert 0 <= json.loads(results.read_text())["results"]["tl_mc"]["acc,none"] <= 1

    assert main(["--model", "titanlike", "--model_args", f"checkpoint={assets['dcp']},temperature=1", "--tasks",
                 "tl_mc", "--include_path", assets["tasks"]]) == 1
    assert "takes no model_args temperature" in capsys.readouterr().err
    assert main(["--model", "titanlike", "--model_args", f"checkpoint={assets['dcp']},pipeline_parallel_degree=2",
                 "--tasks", "tl_mc", "--include_path", assets["tasks"]]) == 1
    assert "not split over pipeline stages" in capsys.readouterr().err

    from transformers import BertConfig, BertForMaskedLM

    BertForMaskedLM(BertConfig(vocab_size=2048, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=64)).save_pretrained(tmp_path / "bert")
    capsys.readouterr()
    assert main(["--model", "titanlike", "--model_args", f"checkpoint={tmp_path / 'bert'}", "--tasks", "tl_mc",
                 "--include_path", assets["tasks"], "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: Bert cannot be evaluated") and "decoder-only" in err, err
