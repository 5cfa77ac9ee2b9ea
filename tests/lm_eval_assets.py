"""Assets of the lm-evaluation-harness tests, generated on the spot: a tiny random Llama (2 layers,
context 64, the debug tokenizer.json's vocabulary) as a DCP checkpoint and its Hugging Face export,
three tasks as YAML over local JSONL files, and the helpers that run lm-eval offline and compare its
per-request responses. Used by tests/integration/test_lm_eval.py and, for the tensor-parallel check
(run in the 2-rank world that also checks generation), tests/layouts/test_generation_tp.py."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket

import torch

from family_checks import materialize
from sft_assets import TOKENIZER_ASSET

BOS, EOS = 1792, 1793  # the debug tokenizer.json's <|begin_of_text|>, <|end_of_text|>
CONTEXT = 64
TASKS = ["tl_mc", "tl_ppl", "tl_gen"]
TP_LIMIT = 1  # documents per task under TP: the first, a truncated context (several rolling windows for perplexity)

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


def build_assets(root, *, hf: bool = True) -> dict:
    """{"dcp", "hf", "tasks"} under the folder `root`: the checkpoint, its Hugging Face export (the
    tokenizer folder too; hf=False: only the tokenizer.json, no weights) and the tasks' include path."""
    from titanlike.checkpoint.format import model_description
    from titanlike.checkpoint.hf import export_dcp_to_hf, write_dcp_model
    from titanlike.models.registry import get_model_spec

    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors["debugmodel_tiny"], vocab_size=2048, n_layers=2, max_seq_len=CONTEXT)
    model = materialize(spec.model_cls, args, seed=0)
    write_dcp_model(model.state_dict(), str(root / "dcp"), {
        "contents": "model_only", "step": 0, "model": model_description("llama3", args),
        "tokenizer": {"bos_id": BOS, "eos_id": EOS}})
    if hf:
        export_dcp_to_hf(str(root / "dcp"), str(root / "hf"), tokenizer_path=str(TOKENIZER_ASSET))
    tasks = root / "tasks"
    tasks.mkdir()
    return {"dcp": str(root / "dcp"), "hf": str(root / "hf") if hf else str(TOKENIZER_ASSET),
            "tasks": _tasks(tasks)}


def offline(monkeypatch) -> None:
    """No hub: datasets offline, and any network connection fails the run."""
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


def evaluate(model, model_args: str, include: str, batch_size: int = 4, limit: int | None = None) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from titanlike.cli.eval import register

    register()
    return simple_evaluate(model=model, model_args=model_args, tasks=TASKS, batch_size=batch_size, device="cpu",
                           task_manager=TaskManager(include_path=include, include_defaults=False), log_samples=True,
                           random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0, limit=limit)


def responses(result: dict) -> dict:
    """Per task, per document, the model's raw responses (log-likelihoods, greedy flags, texts)."""
    out = {}
    for task, samples in result["samples"].items():
        out[task] = {s["doc_id"]: [r[0] for r in s["resps"]] for s in samples}
    return out


def close(got, want) -> bool:
    """Nested lists, dicts, numbers and strings equal, numbers within 1e-4."""
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(close(got[k], want[k]) for k in want)
    if isinstance(want, list):
        return len(got) == len(want) and all(close(g, w) for g, w in zip(got, want))
    if isinstance(want, float):
        return math.isclose(got, want, abs_tol=1e-4)
    return got == want


def prepare_tp_checks(assets: dict, want: dict, folder, monkeypatch) -> None:
    """Tell the spawned ranks (tp_checks) what to evaluate and what one process got: `want`, the
    responses of the first TP_LIMIT documents of each task."""
    first = {task: {doc: r for doc, r in docs.items() if doc < TP_LIMIT} for task, docs in want.items()}
    (folder / "want.json").write_text(json.dumps(first))
    monkeypatch.setenv("TL_LM_EVAL_WANT", str(folder / "want.json"))
    monkeypatch.setenv("TL_LM_EVAL_ARGS", f"checkpoint={assets['dcp']},tokenizer={assets['hf']}")
    monkeypatch.setenv("TL_LM_EVAL_TASKS", assets["tasks"])


def tp_checks(rank: int) -> None:
    """On each rank of a 2-rank gloo world: the titanlike lm-eval model shards the checkpoint over
    the ranks and gives the responses one process gave (prepare_tp_checks)."""
    import lm_eval.evaluator
    from torch.distributed.tensor import DTensor

    from titanlike.inference.harness import TitanlikeLM

    lm_eval.evaluator.add_env_info = lambda results: None  # as offline() does (a spawned process)
    want = json.loads(open(os.environ["TL_LM_EVAL_WANT"]).read())
    lm = TitanlikeLM.create_from_arg_string(os.environ["TL_LM_EVAL_ARGS"], {"batch_size": 4, "device": "cpu"})
    assert any(isinstance(p, DTensor) for p in lm.model.parameters()), "the ranks do not share the model"
    got = evaluate(lm, "", os.environ["TL_LM_EVAL_TASKS"], limit=TP_LIMIT)
    got = json.loads(json.dumps(responses(got)))
    assert close(got, want), f"rank {rank}: lm-eval under TP2 differs from one process"
