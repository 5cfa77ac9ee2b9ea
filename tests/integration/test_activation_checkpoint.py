"""Activation checkpointing recomputes the same ops, so the run equals the one without it."""

import pytest

from conftest import train_metrics


@pytest.mark.parametrize("mode, option", [("full", "2"), ("selective", "2"), ("selective", "op")])
def test_ac_matches_no_ac(tmp_path, single_process_reference, mode, option):
    got = train_metrics(tmp_path, f"ac_{mode}_{option}", "--training.local_batch_size", "8",
                        "--training.steps", "3", "--activation_checkpoint.mode", mode,
                        "--activation_checkpoint.selective_ac_option", option)
    for g, r in zip(got, single_process_reference):
        assert g["loss"] == pytest.approx(r["loss"], rel=1e-6), (g, r)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-5), (g, r)


def test_ac_wraps_the_blocks():
    import torch

    from titanlike.models.registry import get_model_spec
    from titanlike.parallel.activation_checkpoint import apply_activation_checkpointing

    spec = get_model_spec("llama3")
    for mode, option, wrapped in [("full", "2", 8), ("selective", "2", 4), ("selective", "op", 8), ("none", "2", 0)]:
        with torch.device("meta"):
            model = spec.model_cls(spec.flavors["debugmodel"])
        apply_activation_checkpointing(model, mode, option)
        names = [type(b).__name__ for b in model.layers.values()]
        assert names.count("CheckpointWrapper") == wrapped, (mode, option, names)
