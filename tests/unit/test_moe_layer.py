"""The mixture-of-experts layer on one process: routing variants, the grouped matmul against the
per-expert loop, capacity dropping, the balancing losses' values and gradients, and the counts the
bias update reads (not doubled by activation checkpointing, not touched by eval forwards)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from titanlike.models.common.init import LinearInit
from titanlike.models.common.moe import MoE, MoEArgs, Router, group_by_expert, pad_groups
from titanlike.train.expert_balance import ExpertBalance

DIM = 32


def build(**kw) -> MoE:
    args = MoEArgs(num_experts=8, top_k=2, hidden_dim=16, **kw)
    layer = MoE(DIM, args)
    layer.init_weights(LinearInit(0.1, 0.1), seed=0, prefix="layers.0.moe.")
    return layer


def tokens(batch=2, seq=12, seed=0):
    return torch.randn(batch, seq, DIM, generator=torch.Generator().manual_seed(seed))


def reference_moe(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the weighted sum of its chosen experts (no dropping)."""
    flat = x.reshape(-1, DIM)
    routing = layer.router(flat, layer.expert_bias if layer.args.bias_update_rate > 0 else None)
    w1, w2, w3 = layer.experts.w1, layer.experts.w2, layer.experts.w3
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(layer.args.top_k):
            e = routing.experts[t, j]
            h = F.silu(flat[t] @ w1[e].T) * (flat[t] @ w3[e].T)
            out[t] += routing.weights[t, j] * (h @ w2[e].T)
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(flat)
    return out.view_as(x)


@pytest.mark.parametrize("routing", [
    {},
    {"score_func": "sigmoid", "route_norm": True, "route_scale": 2.5},
    {"score_before_topk": False},
    {"n_groups": 4, "topk_groups": 2, "score_func": "sigmoid", "bias_update_rate": 1e-3},
    {"num_shared_experts": 2},
])
def test_layer_equals_token_by_token_reference(routing):
    layer = build(**routing)
    x = tokens()
    torch.testing.assert_close(layer(x), reference_moe(layer, x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [{}, {"capacity_factor": 0.75}, {"capacity_factor": 0.5, "drop_policy": "position",
                                                                 "pad_to_capacity": True}])
def test_grouped_mm_equals_the_loop_forward_and_backward(kw):
    results = []
    for impl in ("grouped_mm", "loop"):
        layer = build(experts_impl=impl, **kw)
        x = tokens().requires_grad_()
        y = layer(x)
        y.square().sum().backward()
        results.append([y, x.grad, layer.experts.w1.grad, layer.experts.w2.grad, layer.router.gate.weight.grad])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_softmax_after_topk_equals_renormalized_softmax():
    """Mixtral's two spellings: softmax over the chosen k, or softmax over all then renormalize."""
    x = tokens().reshape(-1, DIM)
    post = Router(DIM, MoEArgs(num_experts=8, top_k=2, hidden_dim=16, score_before_topk=False))
    pre = Router(DIM, MoEArgs(num_experts=8, top_k=2, hidden_dim=16, route_norm=True))
    pre.gate.weight = post.gate.weight
    a, b = post(x, None), pre(x, None)
    assert torch.equal(a.experts, b.experts)
    torch.testing.assert_close(a.weights, b.weights)


def test_group_limited_routing_picks_experts_from_the_best_groups_only():
    args = MoEArgs(num_experts=8, top_k=2, hidden_dim=16, n_groups=4, topk_groups=1, score_func="sigmoid")
    router = Router(DIM, args)
    routing = router(tokens().reshape(-1, DIM), None)
    groups = routing.experts // 2
    assert (groups[:, 0] == groups[:, 1]).all()  # one group of two experts per token


def test_expert_bias_moves_the_choice_not_the_gate_values():
    layer = build(bias_update_rate=1e-3, score_func="sigmoid")
    x = tokens().reshape(-1, DIM)
    layer.expert_bias.fill_(0.0)
    layer.expert_bias[3] = 10.0  # expert 3 always chosen
    routing = layer.router(x, layer.expert_bias)
    assert (routing.experts == 3).any(-1).all()
    scores = torch.sigmoid(F.linear(x, layer.router.gate.weight))
    torch.testing.assert_close(routing.weights, scores.gather(-1, routing.experts))


def test_capacity_drops_over_capacity_routes_by_probability_and_by_position():
    seq, k, e = 12, 2, 8
    for policy in ("probs", "position"):
        layer = build(capacity_factor=0.5, drop_policy=policy)
        x = tokens(seq=seq)
        routing = layer.router(x.reshape(-1, DIM), None)
        keep, capacity = layer._within_capacity(routing, 2, seq)
        assert capacity == math.ceil(0.5 * seq * k / e)
        for b in range(2):
            experts = routing.experts.view(2, seq, k)[b]
            kept = keep.view(2, seq, k)[b]
            weights = routing.weights.view(2, seq, k)[b]
            for expert in range(e):
                routed = experts == expert
                assert int((routed & kept).sum()) == min(capacity, int(routed.sum()))
                if policy == "probs" and (routed & ~kept).any():
                    assert weights[routed & kept].min() >= weights[routed & ~kept].max()
                if policy == "position" and (routed & ~kept).any():
                    positions = torch.arange(seq).unsqueeze(1).expand(seq, k)
                    assert positions[routed & kept].max() <= positions[routed & ~kept].min()


def test_dropped_routes_contribute_nothing():
    layer = build(capacity_factor=0.25)
    x = tokens()
    flat = x.reshape(-1, DIM)
    routing = layer.router(flat, None)
    keep, _ = layer._within_capacity(routing, 2, 12)
    assert (~keep).any()
    expected = reference_moe(layer, x).reshape(-1, DIM)
    # Subtract the dropped routes' contributions from the dropless reference.
    w1, w2, w3 = layer.experts.w1, layer.experts.w2, layer.experts.w3
    for t, j in (~keep).nonzero().tolist():
        e = routing.experts[t, j]
        expected[t] -= routing.weights[t, j] * ((F.silu(flat[t] @ w1[e].T) * (flat[t] @ w3[e].T)) @ w2[e].T)
    torch.testing.assert_close(layer(x).reshape(-1, DIM), expected, rtol=1e-5, atol=1e-6)


def test_padding_to_capacity_does_not_change_the_output():
    a, b = build(capacity_factor=1.0), build(capacity_factor=1.0, pad_to_capacity=True)
    x = tokens()
    torch.testing.assert_close(a(x), b(x))


def test_group_by_expert_and_pad_groups():
    experts = torch.tensor([[2, 0], [0, 1], [2, 2]])
    ids, counts = group_by_expert(experts, None, 3)
    assert counts.tolist() == [2, 1, 3]
    assert experts.reshape(-1)[ids].tolist() == [0, 0, 1, 2, 2, 2]
    keep = torch.tensor([[True, False], [True, True], [False, True]])
    ids, counts = group_by_expert(experts, keep, 3)
    assert counts.tolist() == [1, 1, 2] and ids.tolist() == [2, 3, 0, 5]
    rows = torch.arange(4.0).unsqueeze(1)
    padded, where = pad_groups(rows, counts, 3)
    assert padded.squeeze(1).tolist() == [0, 0, 0, 1, 0, 0, 2, 3, 0]
    assert torch.equal(padded[where], rows)


def test_balancing_loss_values_and_gradient_reach_the_router():
    """The aux losses are in summed units (mean form x tokens) and get gradient 1 through the output."""
    coeff = 0.01
    layer = build(aux_loss_coeff=coeff, seq_aux_loss_coeff=coeff, z_loss_coeff=1e-3)
    x = tokens()
    batch, seq = x.shape[:2]
    out = layer(x)
    routing = layer.router(x.reshape(-1, DIM), None)
    chosen = torch.zeros(batch * seq, 8).scatter_(-1, routing.experts, 1.0)
    t = batch * seq
    switch = coeff * 8 / (2 * t * t) * (chosen.sum(0) * routing.probs.sum(0)).sum()
    per_seq = [coeff * 8 / (2 * seq * seq) * (chosen.view(batch, seq, 8)[b].sum(0)
                                              * routing.probs.view(batch, seq, 8)[b].sum(0)).sum() for b in range(batch)]
    z = 1e-3 * (torch.logsumexp(routing.logits, -1) ** 2).mean()
    stats = dict(zip(("routes", "dropped", "aux", "seq", "z"), layer.step_stats.tolist()))
    assert stats["aux"] == pytest.approx(switch.item() * t, rel=1e-5)
    assert stats["seq"] == pytest.approx((sum(per_seq) / batch).item() * t, rel=1e-5)
    assert stats["z"] == pytest.approx(z.item() * t, rel=1e-5)
    # Gradient: d(out.sum() + aux_total)/d(gate) equals what the layer's backward gives.
    layer.zero_grad()
    out = layer(x)
    out.sum().backward()
    got = layer.router.gate.weight.grad.clone()
    layer.zero_grad()
    layer.eval()  # no aux attached in eval: the plain output's gradient
    out = layer(x)
    aux_total = (switch + sum(per_seq) / batch + z) * t
    (out.sum() + aux_total).backward()
    # switch/per_seq/z were built from a separate router call on the same weights: same graph values.
    torch.testing.assert_close(got, layer.router.gate.weight.grad, rtol=1e-5, atol=1e-7)


def test_counts_ignore_eval_forwards_and_checkpoint_recomputation():
    layer = build()
    x = tokens()
    layer.eval()
    layer(x)
    assert layer.tokens_per_expert.sum() == 0
    layer.train()
    plain = build(aux_loss_coeff=0.01)
    plain(x).sum().backward()
    checkpointed = build(aux_loss_coeff=0.01)
    checkpoint(checkpointed, x.requires_grad_(), use_reentrant=False).sum().backward()
    assert checkpointed.tokens_per_expert.sum() == x.shape[0] * x.shape[1] * 2
    torch.testing.assert_close(checkpointed.step_stats, plain.step_stats)
    torch.testing.assert_close(checkpointed.router.gate.weight.grad, plain.router.gate.weight.grad)


def test_bias_update_pushes_towards_the_mean_load():
    layer = build(bias_update_rate=0.01, score_func="sigmoid")
    layer.tokens_per_expert.copy_(torch.tensor([10.0, 0, 0, 0, 0, 0, 0, 6]))
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleDict({"0": torch.nn.Module()})
    model.layers["0"].moe = layer
    balance = ExpertBalance([model], layer.args, num_layers=1, device=torch.device("cpu"), group=None)
    table = balance.step_done(applied=torch.tensor(True))
    assert table[0, :8].tolist() == [10.0, 0, 0, 0, 0, 0, 0, 6]
    bias = layer.expert_bias
    assert bias[0] < 0 and bias[7] < 0 and (bias[1:7] > 0).all()
    assert abs(float(bias.sum())) < 1e-6
    assert layer.tokens_per_expert.sum() == 0  # reset for the next step


@pytest.mark.parametrize("bad, message", [
    ({"top_k": 9}, "larger than the 8 experts"),
    ({"capacity_factor": 0.0}, "capacity_factor must be > 0"),
    ({"n_groups": 3}, "must divide"),
    ({"pad_to_capacity": True}, "needs moe.capacity_factor"),
    ({"score_func": "relu"}, "score_func"),
])
def test_bad_settings_are_one_sentence(bad, message):
    with pytest.raises(ValueError, match=message):
        MoEArgs(**{"num_experts": 8, "top_k": 2, "hidden_dim": 16, **bad})


def test_float8_leaves_the_router_in_high_precision():
    from titanlike.models.converters import LinearSelection, linear_filter

    layer = MoE(64, MoEArgs(num_experts=16, top_k=2, hidden_dim=64, num_shared_experts=1))
    selection = LinearSelection()
    keep = linear_filter([], selection)
    assert not keep(layer.router.gate, "layers.1.moe.router.gate")  # 64 x 16: float8-able, but the router
    assert keep(layer.shared_experts.w1, "layers.1.moe.shared_experts.w1")
    assert selection.model_kept == ["layers.1.moe.router.gate"]
    assert "(kept in high precision by the model)" in selection.describe()
