"""float16 loss scaling (titanlike/train/loss_scaling.py): Megatron's DynamicGradScaler rules, its
config and checkpoint state, and the objective weight that scales every term of the loss alike
(models/outputs.py). Through train.py (2 ranks): tests/distributed/test_precision_memory.py."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from titanlike.config import ConfigError, load_job_config
from titanlike.models import protocol
from titanlike.models.outputs import attach_loss, weighted_objective
from titanlike.train.loss_scaling import LossScaler, build_loss_scaler
from titanlike.train.plan import plan_job

REPO = Path(__file__).resolve().parents[2]


def _run(scaler: LossScaler, overflows: str) -> list[float]:
    """The scale after each step of a pattern like 'oo...' ('o' overflow, '.' a clean step)."""
    scales = []
    for flag in overflows:
        scaler.update(overflow=flag == "o")
        scales.append(scaler.scale)
    return scales


def test_hysteresis_delays_the_first_backoff_then_every_overflow_halves_until_growth():
    scaler = LossScaler(initial_scale=1024, min_scale=1, window=3, hysteresis=2)
    # The first overflow is tolerated, the second halves; with hysteresis spent each further
    # overflow halves again (a clean step does not restore it) until the scale grows.
    assert _run(scaler, "o.o.o") == [1024, 1024, 512, 512, 256]
    assert scaler.skipped_steps == 3
    # window clean steps in a row double the scale and restore the hysteresis.
    assert _run(scaler, "...") == [256, 256, 512]
    assert _run(scaler, "oo") == [512, 256]


def test_growth_needs_window_clean_steps_in_a_row():
    scaler = LossScaler(initial_scale=8, window=3, hysteresis=5)
    assert _run(scaler, "..o...") == [8, 8, 8, 8, 8, 16]  # the overflow restarts the count
    assert _run(scaler, "......") == [16, 16, 32, 32, 32, 64]


def test_backoff_stops_at_min_scale():
    scaler = LossScaler(initial_scale=4, min_scale=1, window=100, hysteresis=1)
    assert _run(scaler, "oooo") == [2, 1, 1, 1]


def test_static_scale_never_moves_but_overflowing_steps_are_counted():
    scaler = LossScaler(initial_scale=128, dynamic=False, window=1)
    assert _run(scaler, "o..o.") == [128] * 5
    assert scaler.skipped_steps == 2


def test_state_round_trips_through_json():
    scaler = LossScaler(initial_scale=1024, window=4, hysteresis=3)
    _run(scaler, "o..o..")
    state = json.loads(json.dumps(scaler.state_dict()))
    resumed = LossScaler(initial_scale=1024, window=4, hysteresis=3)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == scaler.state_dict()
    assert _run(resumed, "..o.ooo") == _run(scaler, "..o.ooo")


@pytest.mark.parametrize("dtype, mode, expected", [
    ("float16", "auto", "dynamic"), ("bfloat16", "auto", None), ("float32", "auto", None),
    ("float32", "dynamic", "dynamic"), ("float16", "static", "static"), ("float16", "none", None),
])
def test_the_mode_picks_the_scaler(dtype, mode, expected):
    cfg = load_job_config(["--training.mixed_precision_param", dtype, "--loss_scaling.mode", mode,
                           "--loss_scaling.initial_scale", "512"])
    scaler = build_loss_scaler(cfg.loss_scaling, plan_job(cfg, 1).precision.loss_scaling)
    if expected is None:
        assert scaler is None
    else:
        assert scaler.dynamic == (expected == "dynamic") and scaler.scale == 512


def test_megatron_defaults():
    cfg = load_job_config(["--training.mixed_precision_param", "float16"])
    scaler = build_loss_scaler(cfg.loss_scaling, plan_job(cfg, 1).precision.loss_scaling)
    assert (scaler.scale, scaler.min_scale, scaler.window, scaler.hysteresis) == (2.0**16, 1.0, 1000, 2)


@pytest.mark.parametrize("args, fragment", [
    (["--loss_scaling.initial_scale", "0"], "loss_scaling.initial_scale must be positive"),
    (["--loss_scaling.min_scale", "4096", "--loss_scaling.initial_scale", "1024"],
     "loss_scaling.min_scale must be positive and at most initial_scale 1024"),
    (["--loss_scaling.window", "0"], "loss_scaling.window must be at least 1"),
    (["--loss_scaling.hysteresis", "0"], "loss_scaling.hysteresis must be at least 1"),
    (["--loss_scaling.mode", "dynamc"], "did you mean 'dynamic'"),
])
def test_bad_loss_scaling_values_are_one_sentence(args, fragment):
    from titanlike.train.plan import plan_job

    with pytest.raises(ConfigError) as e:
        plan_job(load_job_config(args), world_size=1)
    assert fragment in str(e.value) and "\n" not in str(e.value)


# The objective's weight ------------------------------------------------------------------------


def test_objective_weight_scales_the_loss_and_every_attached_term_alike():
    """Under loss scaling backward differentiates weight x the objective; a term a model attaches
    deep inside (MoE balancing, multi-token prediction) must get the same weight, or unscaling
    would shrink it by the loss scale."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 4, generator=g), torch.randn(5, generator=g)

    def grads(weight):
        a_ = a.clone().requires_grad_()
        b_ = b.clone().requires_grad_()
        w = torch.tensor(weight)
        hidden = attach_loss(a_ * 2, (b_ ** 2).sum(), w)  # an auxiliary term on b, attached to a's path
        loss = hidden.sum()
        scaled = weighted_objective(loss, w)
        assert scaled.item() == loss.item()  # the reported value stays the unscaled loss
        scaled.backward()
        return a_.grad, b_.grad

    a1, b1 = grads(1.0)
    assert torch.equal(a1, torch.full_like(a, 2.0)) and torch.allclose(b1, 2 * b)
    a2, b2 = grads(1024.0)
    assert torch.equal(a2, 1024 * a1) and torch.allclose(b2, 1024 * b1)


def test_objective_weight_is_explicit_and_none_means_one():
    x = torch.ones(2, requires_grad=True)
    aux = torch.tensor(3.0, requires_grad=True)
    weight = torch.tensor(8.0)
    y = attach_loss(x, aux * aux, weight)
    y.sum().backward()
    assert aux.grad.item() == 8.0 * 2 * 3.0
    aux.grad = None
    attach_loss(x, aux * aux).sum().backward()  # no weight: 1
    assert aux.grad.item() == 2 * 3.0
    loss = torch.tensor(2.0, requires_grad=True)
    assert weighted_objective(loss, None) is loss  # nothing is wrapped


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_moe_balancing_loss_gradient_follows_the_objective_weight(checkpointing):
    """The real MoE layer (its Switch balancing loss joins through attach_loss); with full activation
    checkpointing the block's forward runs again in backward, outside the weight's block."""
    from titanlike.models.registry import get_model_spec
    from titanlike.parallel.activation_checkpoint import apply_activation_checkpointing

    spec = get_model_spec("qwen3")
    # Two layers: a dense one (first_k_dense 1), then an MoE layer with its balancing loss.
    args = dataclasses.replace(spec.flavors["debugmodel_moe"], n_layers=2).update_from_config(vocab_size=256,
                                                                                              seq_len=16)
    with torch.device("meta"):
        model = spec.model_cls(args)
    apply_activation_checkpointing(model, checkpointing, "2")
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))

    # The step hands every loss-attaching module its weight tensor once; it rewrites it in place.
    weight = torch.ones(())
    attaching = protocol.loss_attaching_modules(model)
    assert attaching
    for module in attaching:
        module.loss_weight = weight

    def grads(value):
        model.zero_grad(set_to_none=True)
        weight.fill_(value)
        out = model(tokens)
        logits = out.logits if hasattr(out, "logits") else out
        weighted_objective(logits.float().logsumexp(-1).sum(), weight).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    plain, scaled = grads(1.0), grads(256.0)
    router = [n for n in plain if "router" in n or "gate" in n]
    assert router, list(plain)
    for name, grad in plain.items():
        torch.testing.assert_close(scaled[name], 256 * grad, rtol=1e-5, atol=1e-6 * 256, msg=name)
    assert not math.isclose(plain[router[0]].abs().sum().item(), 0.0)
