"""The pipeline split: which layers and parameters every stage holds, where stages are placed,
and that the stages of a split model compute (and are initialized as) the full model."""

import dataclasses

import pytest
import torch

from family_checks import check_stages_initialized_as_full, init_pipeline_stages, run_stages
from titanlike.models.llama3 import llama3_flavors
from titanlike.models.registry import get_model_spec
from titanlike.parallel.pipeline import build_stage_modules, plan_layout

SPEC = get_model_spec("llama3")


def meta_model(flavor="debugmodel", **changes):
    args = dataclasses.replace(llama3_flavors[flavor], **changes)
    with torch.device("meta"):
        return SPEC.model_cls(args)


def block_fqns(layer):
    return {f"layers.{layer}.{name}" for name, _ in meta_model().layers["0"].named_parameters()}


@pytest.mark.parametrize(
    "n_layers, pp, schedule, per_stage, expected",
    [
        (8, 2, "1F1B", None, (4, 4)),
        (8, 2, "Interleaved1F1B", None, (2, 2, 2, 2)),
        # Spare layers go to the middle stages: the ends also hold the embedding and output.
        (8, 3, "GPipe", None, (3, 3, 2)),
        (6, 2, "LoopedBFS", None, (1, 2, 2, 1)),
        (10, 2, "ZBVZeroBubble", None, (2, 3, 3, 2)),
        (8, 2, "Interleaved1F1B", 1, (1,) * 8),
        # The shortfall of layers_per_stage comes off the last, then the first stage.
        (7, 2, "Interleaved1F1B", 2, (2, 2, 2, 1)),
        (10, 2, "ZBVZeroBubble", 3, (2, 3, 3, 2)),
        (9, 2, "1F1B", 5, (5, 4)),
    ],
)
def test_layers_per_stage(n_layers, pp, schedule, per_stage, expected):
    layout = plan_layout(n_layers, pp, schedule, per_stage)
    assert layout.layers == expected
    assert sum(layout.layers) == n_layers


def test_looped_and_v_placement():
    looped = plan_layout(8, 4, "Interleaved1F1B", 1)
    assert [looped.stages_of_rank(r) for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    v = plan_layout(8, 4, "ZBVZeroBubble", None)
    assert [v.stages_of_rank(r) for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert plan_layout(8, 2, "DualPipeV", None).stages_of_rank(0) == [0, 3]
    single = plan_layout(8, 2, "GPipe", None)
    assert [single.stages_of_rank(r) for r in range(2)] == [[0], [1]]


def test_stage_fqns_keep_full_model_names():
    model = meta_model()
    layout = plan_layout(8, 2, "1F1B", None)
    first, = build_stage_modules(model, SPEC, layout, 0)
    last, = build_stage_modules(model, SPEC, layout, 1)
    assert set(dict(first.named_parameters())) == {"tok_embeddings.weight"} | set().union(
        *(block_fqns(i) for i in range(4)))
    assert set(dict(last.named_parameters())) == {"norm.weight", "output.weight"} | set().union(
        *(block_fqns(i) for i in range(4, 8)))
    assert list(first.layers.keys()) == ["0", "1", "2", "3"]
    assert first.norm is None and first.output is None and last.tok_embeddings is None
    # The meta model itself is left whole.
    assert len(model.layers) == 8 and model.output is not None


def test_v_placement_gives_rank_0_both_ends():
    model = meta_model()
    layout = plan_layout(8, 2, "ZBVZeroBubble", None)
    stage0, stage3 = build_stage_modules(model, SPEC, layout, 0)
    stage1, stage2 = build_stage_modules(model, SPEC, layout, 1)
    assert (list(stage0.layers), list(stage3.layers)) == (["0", "1"], ["6", "7"])
    assert (list(stage1.layers), list(stage2.layers)) == (["2", "3"], ["4", "5"])
    assert stage0.tok_embeddings is not None and stage0.output is None
    assert stage3.tok_embeddings is None and stage3.output is not None
    names = [set(dict(s.named_parameters())) for s in (stage0, stage1, stage2, stage3)]
    assert set().union(*names) == set(dict(model.named_parameters()))
    assert sum(len(n) for n in names) == len(dict(model.named_parameters()))  # disjoint


def test_stages_are_initialized_and_compute_as_the_full_model():
    torch.manual_seed(0)
    full = meta_model("debugmodel_tiny", vocab_size=128, max_seq_len=16)
    layout = plan_layout(8, 2, "Interleaved1F1B", None)
    parts = init_pipeline_stages(full, SPEC, layout, seed=3)
    check_stages_initialized_as_full(parts, full, seed=3)
    tokens = torch.randint(0, 128, (2, 16))
    torch.testing.assert_close(run_stages(parts, tokens), full(tokens), rtol=0, atol=0)


def test_tied_embeddings_split_into_equal_copies_on_the_end_stages():
    # The first stage keeps the table, the last the output projection: two Parameters that start
    # equal (seeded under the owner's name) and compose to the tied full model.
    model = meta_model("debugmodel_tiny", tie_word_embeddings=True, vocab_size=128, max_seq_len=16)
    layout = plan_layout(8, 2, "1F1B", None)
    first, = build_stage_modules(model, SPEC, layout, 0)
    last, = build_stage_modules(model, SPEC, layout, 1)
    assert first.output is None and last.tok_embeddings is None
    assert first.tied_weights == last.tied_weights == {"output.weight": "tok_embeddings.weight"}
    full = meta_model("debugmodel_tiny", tie_word_embeddings=True, vocab_size=128, max_seq_len=16)
    for module in (first, last, full):
        module.to_empty(device="cpu")
        module.init_weights(seed=3)
    assert torch.equal(first.tok_embeddings.weight, last.output.weight)
    assert full.output.weight is full.tok_embeddings.weight
    tokens = torch.randint(0, 128, (2, 16))
    torch.testing.assert_close(last(first(tokens)), full(tokens), rtol=0, atol=0)


@pytest.mark.parametrize("schedule, pp", [("1F1B", 2), ("ZBVZeroBubble", 2)])
def test_layers_after_the_trunk_go_with_the_output_end(schedule, pp):
    """Entries of `layers` past the trunk the layout cuts (multi-token-prediction modules) belong to
    the last stage, wherever the schedule places it."""
    model = meta_model()
    model.layers["8"] = meta_model().layers["0"]  # a ninth entry after the 8-layer trunk
    layout = plan_layout(8, pp, schedule, None)
    last_stage = layout.num_stages - 1
    for rank in range(pp):
        for stage, part in zip(layout.stages_of_rank(rank), build_stage_modules(model, SPEC, layout, rank)):
            assert ("8" in part.layers) == (stage == last_stage), (rank, stage)
            assert (part.output is not None) == (stage == last_stage)
