"""Generating from a model trained in float32 under bf16 autocast (inference/engine.py LowPrecisionCopy): the
engine holds its linear layers' weights in bf16 (every other parameter is the model's own) and runs its steps
under the same autocast, so it computes what the training step computes; the copy follows every change of the
model's weights in place, a weight tied to the embedding is copied for the output layer only, and the model's
own modules (a block compiled for training included) are never called."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from family_checks import materialize
from titanlike.inference import Engine, SamplingParams
from titanlike.models.outputs import logits_of
from titanlike.models.registry import get_model_spec

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, logprobs=True)
PROMPTS = [[1, 5, 9, 2], [3, 3, 7]]


def _model(**changes):
    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors["debugmodel_tiny"], vocab_size=96, n_layers=2, max_seq_len=32, **changes)
    return materialize(spec.model_cls, args, seed=0).eval()


def _run(engine):
    completions, _ = engine.generate(PROMPTS, GREEDY)
    return [c.tokens for c in completions], [c.logprobs for c in completions]


def _gap_to_autocast_forward(model, tokens, logprobs) -> float:
    """The largest difference between the engine's log-probabilities and the model's own forward under bf16
    autocast (the training step's) over the whole sequence."""
    worst = 0.0
    for prompt, new, got in zip(PROMPTS, tokens, logprobs):
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            logits = logits_of(model(torch.tensor([prompt + new]))).float()
        want = torch.log_softmax(logits, -1)[0, len(prompt) - 1:-1].gather(1, torch.tensor(new)[:, None])[:, 0]
        worst = max(worst, (want - torch.tensor(got)).abs().max().item())
    return worst


def test_generates_what_the_training_step_computes():
    source = _model()
    tokens, logprobs = _run(Engine(source, dtype=torch.bfloat16))
    in_bf16 = _gap_to_autocast_forward(source, tokens, logprobs)
    in_fp32 = _gap_to_autocast_forward(source, *_run(Engine(source)))
    assert in_bf16 < 2e-3 and in_bf16 < in_fp32 / 10, (in_bf16, in_fp32)  # measured: 1.8e-4 against 1.1e-2


def test_only_the_linear_layers_are_copied():
    source = _model()
    engine = Engine(source, dtype=torch.bfloat16)
    assert engine.source is source and engine.model is not source and engine.dtype == torch.bfloat16
    mine = dict(engine.model.named_parameters())
    for name, theirs in source.named_parameters():
        module = engine.model.get_submodule(name.rpartition(".")[0])
        if isinstance(module, nn.Linear):
            assert mine[name] is not theirs and mine[name].dtype == torch.bfloat16 and not mine[name].requires_grad
        else:  # norms, the embedding: the model's own tensors, nothing copied
            assert mine[name] is theirs
    assert {p.dtype for p in source.parameters()} == {torch.float32}
    # float32 asked of a float32 model, or no dtype: the model itself, no copy
    assert Engine(source, dtype=torch.float32).model is source and Engine(source).weights is None


def test_the_copy_follows_the_model_in_place():
    source = _model()
    engine = Engine(source, dtype=torch.bfloat16)
    before = _run(engine)
    addresses = [p.data_ptr() for p in engine.model.parameters()]
    with torch.no_grad():
        for p in source.parameters():  # an optimizer step: in place, as fused AdamW updates
            p.add_(torch.randn_like(p) * 0.5)
    after = _run(engine)
    assert after != before
    assert after == _run(Engine(source, dtype=torch.bfloat16))
    assert [p.data_ptr() for p in engine.model.parameters()] == addresses  # a recorded CUDA graph stays valid


def test_a_weight_tied_to_the_embedding_is_copied_for_the_output_only():
    source = _model(tie_word_embeddings=True)
    assert source.output.weight is source.tok_embeddings.weight
    engine = Engine(source, dtype=torch.bfloat16)
    assert engine.model.tok_embeddings.weight is source.tok_embeddings.weight  # looked up in float32, as trained
    assert engine.model.output.weight.dtype == torch.bfloat16
    tokens, logprobs = _run(engine)
    assert _gap_to_autocast_forward(source, tokens, logprobs) < 2e-3
    with torch.no_grad():
        source.tok_embeddings.weight.mul_(-1)
    assert _run(engine) == _run(Engine(source, dtype=torch.bfloat16))  # the output's copy follows too


def test_the_models_compiled_blocks_are_never_called():
    source = _model()

    def refuse(*args, **kwargs):
        raise AssertionError("the engine called the model's block")

    for block in source.layers.values():  # what nn.Module.compile leaves on a block
        block._compiled_call_impl = refuse
    tokens, _ = _run(Engine(source, dtype=torch.bfloat16))
    assert all(tokens)


@pytest.mark.slow  # compiles the decode step on CPU (inductor's C++ backend: compiler processes), ~15 s
def test_the_compiled_step_runs_under_the_same_autocast():
    source = _model()
    eager = _run(Engine(source, dtype=torch.bfloat16))
    compiled = Engine(source, dtype=torch.bfloat16, compile=True)
    tokens, logprobs = _run(compiled)
    assert tokens == eager[0]
    assert _gap_to_autocast_forward(source, tokens, logprobs) < 2e-3
