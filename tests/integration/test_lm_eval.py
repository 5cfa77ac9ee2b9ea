"""lm-evaluation-harness on a titanlike checkpoint (`--model titanlike`, titanlike/inference/harness.py)
against lm-eval's own `hf` model on the Hugging Face export of the same weights.

A tiny random Llama (2 layers, context 64, the debug tokenizer.json's vocabulary) is written as a
DCP checkpoint and exported with titanlike's converter. Three tasks are defined here as YAML over
local JSONL files (no hub: HF_DATASETS_OFFLINE and every socket connection refused while they run):
a multiple-choice task (loglikelihood), a perplexity task (loglikelihood_rolling: several windows of
64 tokens) and a generate_until task with stop strings; some contexts are longer than the context
(left truncation). The titanlike model's per-request log-likelihoods equal the hf model's within
1e-4, its accuracies and generated texts exactly; batch size 1 equals batch size 4 (1e-5); a 2-rank
tensor-parallel run (spawned gloo ranks, the first document of each task) equals one process;
titanlike-eval runs lm-eval's command line; a BERT checkpoint and an unknown model_arg are refused in
one sentence."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket

import pytest
import torch

from family_checks import materialize, run_on_gloo_ranks
from sft_assets import TOKENIZER_ASSET

lm_eval = pytest.importorskip("lm_eval")

BOS, EOS = 1792, 1793  # the debug tokenizer.json's <|begin_of_text|>, <|end_of_text|>
CONTEXT = 64

WORDS = ("the cat sat on a mat and the dog ran to the old red barn where seven birds sang of rain while "
         "farmers walked home through fields of wheat under a grey sky").split()


def _sentence(seed: int, n: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (n,), generator=g).tolist())


def _tasks(folder) -> str:
    """Three task YAMLs over local JSONL files in `folder`; returns the include path."""
    mc = [{"question": _sentence(i, 6 if i % 4 else 80), "choices": [_sentence(100 + i, 2), _sentence(200 + i, 3),
           _sentence(300 + i, 1)], "answer": i % 3} for i in range(8)]
    ppl = [{"text": _sentence(400 + i, 150 if i == 0 else 12 + 3 * i)} for i in range(5)]
    gen = [{"question": _sentence(500 + i, 90 if i == 0 else 5 + i), "answer": "the"} for i in range(6)]
    for name, rows in (("mc", mc), ("ppl", ppl), ("gen", gen)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def task(name: str, body: str) -> None:
        (folder / f"{name}.yaml").write_text(
            f"task: tl_{name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {folder / name}.jsonl\n"
            f"test_split: test\n{body}")

    task("mc", "output_type: multiple_choice\ndoc_to_text: '{{question}}'\ndoc_to_choice: '{{choices}}'\n"
               "doc_to_target: '{{answer}}'\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    task("ppl", "output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{text}}'\nmetric_list:\n"
                "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    task("gen", "output_type: generate_until\ndoc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
                "generation_kwargs:\n  until: [' sky', ' rain']\n  max_gen_toks: 8\n  do_sample: false\n"
                "metric_list:\n  - metric: exact_match\n")
    return str(folder)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from titanlike.checkpoint.format import model_description
    from titanlike.checkpoint.hf import export_dcp_to_hf, write_dcp_model
    from titanlike.models.registry import get_model_spec

    root = tmp_path_factory.mktemp("lm_eval")
    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors["debugmodel_tiny"], vocab_size=2048, n_layers=2, max_seq_len=CONTEXT)
    model = materialize(spec.model_cls, args, seed=0)
    write_dcp_model(model.state_dict(), str(root / "dcp"), {
        "contents": "model_only", "step": 0, "model": model_description("llama3", args),
        "tokenizer": {"bos_id": BOS, "eos_id": EOS}})
    export_dcp_to_hf(str(root / "dcp"), str(root / "hf"), tokenizer_path=str(TOKENIZER_ASSET))
    tasks = root / "tasks"
    tasks.mkdir()
    return {"dcp": str(root / "dcp"), "hf": str(root / "hf"), "tasks": _tasks(tasks)}


@pytest.fixture(scope="module")
def offline():
    """No hub: datasets offline, and any network connection fails the run."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        _offline(monkeypatch)
        yield


def _offline(monkeypatch) -> None:
    import datasets.config

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)

    def refuse(self, address, *a, **k):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise OSError(f"the test is offline: a connection to {address} was attempted")
        return real(self, address, *a, **k)

    real = socket.socket.connect
    monkeypatch.setattr(socket.socket, "connect", refuse)
    # The results' environment report runs torch's collect_env (a dozen subprocesses, ~2 s a run).
    monkeypatch.setattr("lm_eval.evaluator.add_env_info", lambda results: None)


TASKS = ["tl_mc", "tl_ppl", "tl_gen"]


def _evaluate(model, model_args: str, include: str, batch_size: int = 4, limit: int | None = None) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from titanlike.cli.eval import register

    register()
    return simple_evaluate(model=model, model_args=model_args, tasks=TASKS, batch_size=batch_size, device="cpu",
                           task_manager=TaskManager(include_path=include, include_defaults=False), log_samples=True,
                           random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0, limit=limit)


def _responses(result: dict) -> dict:
    """Per task, per document, the model's raw responses (log-likelihoods, greedy flags, texts)."""
    out = {}
    for task, samples in result["samples"].items():
        out[task] = {s["doc_id"]: [r[0] for r in s["resps"]] for s in samples}
    return out


def _metrics(result: dict) -> dict:
    return {task: {k: v for k, v in m.items() if "stderr" not in k and isinstance(v, float)}
            for task, m in result["results"].items()}


def _assert_same(ours: dict, theirs: dict, atol: float) -> None:
    a, b = _responses(ours), _responses(theirs)
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
    return _evaluate("titanlike", f"checkpoint={assets['dcp']},tokenizer={assets['hf']}", assets["tasks"])


def test_scores_equal_lm_eval_hf_on_the_export(assets, offline, ours):
    # The export's config says 65536 positions (Llama 3.1's RoPE scaling); the checkpoint's context
    # is 64: lm-eval's hf model is told, so both truncate the same long contexts on the left.
    theirs = _evaluate("hf", f"pretrained={assets['hf']},dtype=float32,max_length={CONTEXT}", assets["tasks"])
    # The tasks exercise what they name: truncated contexts and several rolling windows (the first
    # document of each is longer than the context).
    from titanlike.data import build_tokenizer

    tok = build_tokenizer(assets["hf"])
    for name, field in (("mc", "question"), ("ppl", "text"), ("gen", "question")):
        first = json.loads(open(os.path.join(assets["tasks"], f"{name}.jsonl")).readline())[field]
        assert len(tok.encode(first, bos=True, eos=False)) > CONTEXT + 8, name
    responses = _responses(ours)
    assert len(responses["tl_mc"]) == 8 and len(responses["tl_ppl"]) == 5 and len(responses["tl_gen"]) == 6
    _assert_same(ours, theirs, atol=1e-4)

    one = _evaluate("titanlike", f"checkpoint={assets['dcp']},tokenizer={assets['hf']}", assets["tasks"],
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

    from transformers import BertConfig, BertForMaskedLM

    BertForMaskedLM(BertConfig(vocab_size=2048, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64, max_position_embeddings=64)).save_pretrained(tmp_path / "bert")
    capsys.readouterr()
    assert main(["--model", "titanlike", "--model_args", f"checkpoint={tmp_path / 'bert'}", "--tasks", "tl_mc",
                 "--include_path", assets["tasks"], "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: Bert cannot be evaluated") and "decoder-only" in err, err


def _tp_checks(rank: int) -> None:
    import lm_eval.evaluator

    lm_eval.evaluator.add_env_info = lambda results: None  # as the offline fixture does (a spawned process)
    from torch.distributed.tensor import DTensor

    from titanlike.inference.harness import TitanlikeLM

    want = json.loads(open(os.environ["TL_LM_EVAL_WANT"]).read())
    lm = TitanlikeLM.create_from_arg_string(os.environ["TL_LM_EVAL_ARGS"], {"batch_size": 4, "device": "cpu"})
    assert any(isinstance(p, DTensor) for p in lm.model.parameters()), "the ranks do not share the model"
    got = _evaluate(lm, "", os.environ["TL_LM_EVAL_TASKS"], limit=TP_LIMIT)
    assert _close(json.loads(json.dumps(_responses(got))), want), f"rank {rank}: TP2 differs from one process"


def _close(got, want) -> bool:
    """Nested lists, dicts, numbers and strings equal, numbers within 1e-4."""
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(_close(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return len(got) == len(want) and all(_close(g, w) for g, w in zip(got, want))
    if isinstance(want, float):
        return math.isclose(got, want, abs_tol=1e-4)
    return got == want


TP_LIMIT = 1  # documents per task: the first, a truncated context (several rolling windows for perplexity)


@pytest.mark.distributed
def test_tensor_parallel_equals_one_process(assets, offline, ours, tmp_path, monkeypatch):
    model_args = f"checkpoint={assets['dcp']},tokenizer={assets['hf']}"
    want = tmp_path / "want.json"
    first = {task: {doc: r for doc, r in docs.items() if doc < TP_LIMIT} for task, docs in _responses(ours).items()}
    want.write_text(json.dumps(first))
    monkeypatch.setenv("TL_LM_EVAL_WANT", str(want))
    monkeypatch.setenv("TL_LM_EVAL_ARGS", model_args)
    monkeypatch.setenv("TL_LM_EVAL_TASKS", assets["tasks"])
    run_on_gloo_ranks(_tp_checks, world=2, timeout_s=240, what="lm-eval under TP2")
