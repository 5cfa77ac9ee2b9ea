"""Muon with QK-clip through train.py (optimizer.qk_clip_threshold): the trainer records every
attention's max logit, logs it per layer, and clips on the device; tensor parallelism (each rank its
heads) gives one process's losses and maxima step by step. The arithmetic: tests/unit/test_qk_clip.py."""

from __future__ import annotations

import pytest

# At lr 0.02 the debug model's largest logits rise from 0.6 to 0.9 in 4 steps: 0.7 clips from step 3.
MUONCLIP = ("--optimizer.name", "Muon", "--optimizer.lr", "0.02", "--optimizer.qk_clip_threshold", "0.7")


@pytest.mark.distributed
@pytest.mark.train_run(*MUONCLIP, name="one")
@pytest.mark.train_run(*MUONCLIP, "--parallelism.tensor_parallel_degree", "2", name="tp", nproc=2)
def test_muonclip_logs_per_layer_maxima_and_tp_matches_one_process(train_runs):
    one, tp = (train_runs[name].metrics for name in ("one", "tp"))
    layers = [f"attention/layer{i}/max_logit" for i in range(8)]
    assert all(set(layers) <= set(r) for r in one)
    assert max(r["attention/max_logit"] for r in one) > 0.7  # the clip acted
    assert [r["loss"] for r in tp] == pytest.approx([r["loss"] for r in one], rel=1e-4)
    # Newton-Schulz runs in bfloat16: the layouts' float32 rounding differences in the gradients flip
    # some bfloat16 roundings of the update, which a maximum picks up (2e-4 after two steps, 4e-3
    # after a clip measured); a head clipped on the wrong rows, or a maximum of other heads, is off by far more.
    for key in ("attention/max_logit", *layers):
        assert [r[key] for r in tp] == pytest.approx([r[key] for r in one], rel=1e-2), key
