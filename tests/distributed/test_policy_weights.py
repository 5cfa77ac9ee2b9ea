"""The policy's weights for generation (train/companions.py PolicyWeights, what RL rollouts read): on
one process the trained module itself, no copy; under FSDP2 and TP2 a whole copy per rank, gathered
once per update (a second call at the same version gathers nothing), whose greedy tokens equal one
process's, and which follows an update."""

from __future__ import annotations

import torch
import torch.distributed as dist

from family_checks import plan_family, run_on_gloo_ranks

PROMPTS = [[5, 9, 17, 3, 44], [7, 31, 90]]


def _tokens(model) -> list[list[int]]:
    from titanlike.inference import Engine, SamplingParams

    completions, _ = Engine(model).generate(PROMPTS, SamplingParams(max_new_tokens=4))
    return [c.tokens for c in completions]


def _parts(plan):
    from titanlike.models.converters import build_model_converters
    from titanlike.train.model_parts import build_model_parts

    plan.dims.build_mesh("cpu", experts=False)
    parts = build_model_parts(plan, build_model_converters([], plan.cfg))
    for part in parts:
        part.to_empty(device="cpu")
        part.init_weights(seed=0)
    return parts


def _weights(plan, parts):
    from titanlike.models.converters import build_model_converters
    from titanlike.train.companions import PolicyWeights

    return PolicyWeights(plan, parts, torch.device("cpu"), lambda: build_model_converters([], plan.cfg))


def _check(rank: int) -> None:
    from torch.distributed.tensor import DTensor

    from family_checks import materialize

    one = plan_family("llama3", "debugmodel_tiny")
    reference = materialize(one.spec.model_cls, one.model_args, seed=0)
    want = _tokens(reference.eval())
    for layout in (["--parallelism.data_parallel_shard_degree", "2"], ["--parallelism.tensor_parallel_degree", "2"]):
        plan = plan_family("llama3", "debugmodel_tiny", *layout, world_size=2)
        parts = _parts(plan)
        weights = _weights(plan, parts)
        assert weights.sharded
        model = weights.module(version=0)
        assert model is not parts[0] and weights.gathers == 1
        full = sum(p.numel() * p.element_size() for p in model.parameters())
        assert 0 < weights.gathered_bytes < full  # each rank brought in what it did not hold
        assert weights.gathered_bytes == weights.gather_bytes and weights.copy_bytes == full  # what it logs
        assert _tokens(model) == want, layout
        assert weights.module(version=0) is model and weights.gathers == 1  # same version: no gather
        with torch.no_grad():  # an "update": the policy's output projection moves
            out = dict(parts[0].named_parameters())["output.weight"]
            (out.to_local() if isinstance(out, DTensor) else out).mul_(2)
        moved = weights.module(version=1)
        assert weights.gathers == 2
        torch.testing.assert_close(moved.output.weight, 2 * reference.output.weight)
        dist.barrier()


def test_one_process_generates_from_the_trained_module_itself():
    plan = plan_family("llama3", "debugmodel_tiny")
    parts = _parts(plan)
    weights = _weights(plan, parts)
    assert not weights.sharded
    assert weights.module(version=0) is parts[0] and weights.module(version=5) is parts[0]
    assert weights.gathers == 0 and weights.gathered_bytes == 0


def test_fsdp2_and_tp2_gather_once_per_update_and_generate_one_process_tokens():
    run_on_gloo_ranks(_check, world=2, timeout_s=300, what="the policy's weights under FSDP2 and TP2")
