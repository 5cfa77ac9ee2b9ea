"""optimizer.name Muon and optimizer.state_dtype bfloat16 in one process (train/muon.py): the same
steps as torch.optim.Muon beside torch.optim.AdamW, which parameters each steps, bfloat16 states'
rounding, and the plan-time refusals. Distributed Muon: tests/distributed/test_muon_parity.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from titanlike.config import ConfigError, load_job_config
from titanlike.models.llama3 import Transformer, llama3_flavors
from titanlike.train import muon
from titanlike.train.muon import newton_schulz, rounding_bits, stochastic_round
from titanlike.train.optimizer import build_optimizer, muon_parameters
from titanlike.train.plan import plan_job

SEQ = 16
ARGS = dataclasses.replace(llama3_flavors["debugmodel_tiny"], n_layers=2, vocab_size=320, max_seq_len=SEQ)


def _config(*overrides: str):
    return load_job_config(["--model.flavor", "debugmodel_tiny", "--optimizer.name", "Muon", *overrides])


def _model(seed: int = 0) -> Transformer:
    with torch.device("meta"):
        model = Transformer(ARGS)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def _loss(model, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, ARGS.vocab_size, (2, SEQ + 1), generator=g)
    return F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())


def test_default_rule_blocks_matrices_muon_the_rest_adamw():
    cfg = _config().optimizer
    names = {n for n, _ in muon_parameters(_model(), cfg)}
    assert names and all(n.startswith("layers.") for n in names)
    assert "layers.0.attention.wq.weight" in names and "layers.1.feed_forward.w2.weight" in names
    assert not any("norm" in n for n in names)  # 1-D
    assert "tok_embeddings.weight" not in names and "output.weight" not in names
    cfg = _config("--optimizer.muon_exclude", "*.wq.weight", "--optimizer.muon_include", "output.weight").optimizer
    chosen = {n for n, _ in muon_parameters(_model(), cfg)}
    assert chosen == (names - {"layers.0.attention.wq.weight", "layers.1.attention.wq.weight"}) | {"output.weight"}


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
@pytest.mark.parametrize("implementation", ["fused", "for-loop"])
def test_every_step_equals_torch_muon_beside_adamw(adjust, implementation):
    cfg = _config("--optimizer.adjust_lr_fn", adjust, "--optimizer.implementation", implementation,
                  "--optimizer.lr", "0.01", "--optimizer.nesterov", "false" if adjust == "original" else "true").optimizer
    ours, theirs = _model(), _model()
    optimizer = build_optimizer([ours], cfg)
    chosen = {n for n, _ in muon_parameters(theirs, cfg)}
    muon = torch.optim.Muon([p for n, p in theirs.named_parameters() if n in chosen], lr=cfg.lr,
                            weight_decay=cfg.weight_decay, momentum=cfg.momentum, nesterov=cfg.nesterov,
                            ns_coefficients=tuple(cfg.ns_coefficients), eps=cfg.muon_eps, ns_steps=cfg.ns_steps,
                            adjust_lr_fn=adjust)
    adamw = torch.optim.AdamW([p for n, p in theirs.named_parameters() if n not in chosen], lr=cfg.lr,
                              betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
                              fused=implementation == "fused")
    for step in range(4):
        for model in (ours, theirs):
            _loss(model, step).backward()
        optimizer.step()
        muon.step()
        adamw.step()
        for opt in (optimizer, muon, adamw):
            opt.zero_grad(set_to_none=True)
        for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"step {step}: {name}")


def test_device_verdict_skips_the_step_and_unscales_the_gradients():
    """Under fused kernels the step hands the optimizer grad_scale and found_inf (train/step.py)."""
    cfg = _config("--optimizer.state_dtype", "bfloat16").optimizer
    a, b = _model(), _model()
    oa, ob = build_optimizer([a], cfg), build_optimizer([b], cfg)
    _loss(a, 0).backward()
    _loss(b, 0).backward()
    for p in b.parameters():
        p.grad.mul_(4.0)
    oa.found_inf, oa.grad_scale = torch.zeros(()), torch.ones(())
    ob.found_inf, ob.grad_scale = torch.zeros(()), torch.full((), 4.0)
    oa.step()
    ob.step()
    for x, y in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(x, y)
    before = {n: p.detach().clone() for n, p in a.named_parameters()}
    states = {n: {k: v.clone() for k, v in oa.state[p].items()} for n, p in a.named_parameters()}
    _loss(a, 1).backward()
    oa.found_inf = torch.ones(())
    oa.step()
    for n, p in a.named_parameters():
        assert torch.equal(p, before[n]), n
        for k, v in oa.state[p].items():
            if k != "step":
                assert torch.equal(v, states[n][k]), (n, k)


def test_experts_are_orthogonalised_one_by_one():
    stack = torch.randn(3, 8, 5)
    out = newton_schulz(stack, coefficients=(3.4445, -4.775, 2.0315), steps=5, eps=1e-7)
    for e in range(3):
        assert torch.equal(out[e], newton_schulz(stack[e], coefficients=(3.4445, -4.775, 2.0315), steps=5,
                                                 eps=1e-7))


def test_stochastic_rounding_is_unbiased_and_lands_on_neighbours():
    x = torch.full((200_000,), 1.0 + 2**-10)  # a quarter of the way from 1 to the next bfloat16
    for sign, bits in ((1, rounding_bits(x.shape, 12345) & 0xFFFF), (-1, (rounding_bits(x.shape, 777) >> 16) & 0xFFFF)):
        r = stochastic_round(sign * x, bits).float()
        assert set(r.unique().tolist()) == {sign * 1.0, sign * (1.0 + 2**-7)}
        assert abs(r.mean().item() - sign * x[0].item()) < 2e-5
    exact = torch.tensor([0.5, -3.0, 3.3895e38])  # bfloat16 values (the last its largest finite) stay
    assert torch.equal(stochastic_round(exact, torch.full((3,), 65535)), exact.bfloat16())


def test_rounding_bits_follow_the_element_not_the_layout(monkeypatch):
    """The bits are a hash of (key, index in the whole parameter): a shard's block draws the same elements'
    bits, and an update done eagerly in chunks of rows equals one done at once."""
    whole = rounding_bits([37, 11], key=99)
    assert torch.equal(rounding_bits([9, 5], 99, [10, 4], [37, 11]), whole[10:19, 4:9])
    assert 0.45 < (rounding_bits([37, 11], key=100) != whole).float().mean()
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(37, 11, generator=g) for _ in range(2)] + [torch.zeros(37, 11, dtype=torch.bfloat16)] * 2
    results = []
    for chunk in (muon._EAGER_CHUNK, 20):  # at once, then two rows at a time
        monkeypatch.setattr(muon, "_EAGER_CHUNK", chunk)
        p, grad, m, v = (t.clone() for t in tensors)
        muon.adamw_low_precision_update(p, grad, m, v, torch.zeros(()), None, None, lr=1e-2, beta1=0.9, beta2=0.95,
                                        eps=1e-8, weight_decay=0.1, key=5, offset=[0, 0], whole_shape=[37, 11])
        results.append((p, m, v))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_rounding_bits_are_the_hash_of_the_whole_index_past_two_to_the_31():
    """Eager int32 arithmetic (wrapping) gives the exact integers' hash mod 2**32, for an index past 2**31."""
    rows, cols = 2**31 // 1000 + 10, 1000
    got = rounding_bits([2, 3], 7, [rows - 5, 0], [rows, cols]).long() & muon._MASK32
    index = (torch.arange(2)[:, None] + rows - 5) * cols + torch.arange(3)[None]
    assert index.max() > 2**31
    assert torch.equal(got, muon._mix32((index * 0x9E3779B1 + 7) & muon._MASK32))


def test_rounding_decisions_are_uncorrelated_across_keys_halves_and_neighbours():
    x = torch.full((400_000,), 1.0 + 2**-8)  # halfway: up or down with probability 1/2
    bits = [rounding_bits(x.shape, key=k) for k in (1, 2)]
    up = [(stochastic_round(x, b).float() > 1.0).float() * 2 - 1 for b in (bits[0] & 0xFFFF, bits[1] & 0xFFFF,
                                                                            (bits[0] >> 16) & 0xFFFF)]
    assert all(abs(u.mean()) < 0.01 for u in up)
    assert abs((up[0] * up[1]).mean()) < 0.01  # two keys
    assert abs((up[0] * up[2]).mean()) < 0.01  # the two moments of one element
    assert abs((up[0][1:] * up[0][:-1]).mean()) < 0.01  # neighbouring elements


@pytest.mark.slow  # compiles on CPU (inductor's C++ backend: compiler processes), ~10 s
def test_compiled_low_precision_update_steps_as_the_eager_one():
    """On CUDA with fused kernels the bfloat16-state AdamW update is compiled (one kernel a parameter);
    here both forms run on CPU on the same tensors, through unscaling and a skipped step, and agree."""
    g = torch.Generator().manual_seed(0)
    param, grad = torch.randn(300, 40, generator=g), torch.randn(300, 40, generator=g)
    moments = (torch.randn(300, 40, generator=g).bfloat16() * 1e-2, torch.rand(300, 40, generator=g).bfloat16())
    bits = torch.compile(muon.rounding_bits, dynamic=True, fullgraph=True)([9, 5], 123456789, [10, 4], [37, 11])
    assert torch.equal(bits.long() & muon._MASK32, rounding_bits([9, 5], 123456789, [10, 4], [37, 11]).long()
                       & muon._MASK32)  # int64 when compiled, int32 in eager: the same bits
    compiled = torch.compile(muon.adamw_low_precision_update, dynamic=True, fullgraph=True)
    results = []
    for update in (muon.adamw_low_precision_update, compiled):
        p, m, v, step = param.clone(), moments[0].clone(), moments[1].clone(), torch.zeros(())
        for i, skip in enumerate((False, True, False)):
            update(p, grad * 2, m, v, step, torch.full((), 2.0), torch.tensor(skip), lr=1e-2 * (i + 1), beta1=0.9,
                   beta2=0.95, eps=1e-8, weight_decay=0.1, key=11 + i, offset=[7, 0], whole_shape=[400, 40])
        results.append((p, m, v, step))
    (p, m, v, step), (pc, mc, vc, stepc) = results
    assert step.item() == stepc.item() == 2  # the skipped update did not count
    assert (pc - p).abs().max() < 1e-3 * (p - param).abs().max()
    for a, b in ((m, mc), (v, vc)):  # float32 sums in another order may cross a rounding boundary now and then
        assert b.dtype == torch.bfloat16 and (a != b).sum() <= a.numel() // 100


def test_bfloat16_states_are_bfloat16_and_track_float32():
    losses = {}
    for dtype in ("float32", "bfloat16"):
        for name in ("AdamW", "Muon"):
            cfg = load_job_config(["--optimizer.name", name, "--optimizer.state_dtype", dtype,
                                   "--optimizer.lr", "0.003"]).optimizer
            model = _model()
            optimizer = build_optimizer([model], cfg)
            for step in range(20):
                loss = _loss(model, step % 4)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            losses[dtype, name] = loss.item()
            kept = {v.dtype for s in optimizer.state.values() for k, v in s.items() if k != "step"}
            assert kept == {getattr(torch, dtype)}
    for name in ("AdamW", "Muon"):
        assert abs(losses["bfloat16", name] / losses["float32", name] - 1) < 0.02, (name, losses)


@pytest.mark.parametrize("overrides, sentence", [
    (["--optimizer.ns_steps", "0"], "optimizer.ns_steps must be 1 to 99"),
    (["--optimizer.muon_exclude", "layers.*.nothing"], "pattern 'layers.*.nothing' matches no parameter"),
    (["--optimizer.muon_include", "norm.weight"], "which is not a matrix"),
    (["--optimizer.muon_exclude", "layers.*"], "finds no matrix to step"),
    (["--optimizer.ns_coefficients", "1,2"], "three numbers"),
])
def test_plan_refuses_in_one_sentence(overrides, sentence):
    with pytest.raises(ConfigError, match=sentence) as e:
        plan_job(_config(*overrides), world_size=1, vocab_size=ARGS.vocab_size)
    assert str(e.value).count(". ") == 0


def test_patterns_need_muon():
    with pytest.raises(ConfigError, match="only apply with optimizer.name Muon"):
        plan_job(load_job_config(["--optimizer.muon_exclude", "x"]), world_size=1, vocab_size=320)


def test_estimator_counts_muon_momentum_bfloat16_states_and_the_gathered_matrices():
    """The estimator steps the real optimizer on fake tensors (estimation/probe.py): Muon keeps one
    momentum buffer per matrix, AdamW two moments; bfloat16 halves them; the optimizer step's window
    holds the matrices an owner gathers whole (over FSDP's and TP's ranks at once under FSDP x TP)."""
    from estimation.probe import probe

    def measured(*overrides: str, world: int = 2):
        cfg = load_job_config(["--model.flavor", "debugmodel_tiny", "--parallelism.data_parallel_shard_degree", "2",
                               "--training.seq_len", "64", "--training.local_batch_size", "1", *overrides])
        plan = plan_job(cfg, world, vocab_size=ARGS.vocab_size)
        pr = probe(plan)
        return sum(s.optimizer for s in pr.static.values()), pr.update.over

    adamw, adamw_update = measured()
    muon, muon_update = measured("--optimizer.name", "Muon")
    muon_bf16, _ = measured("--optimizer.name", "Muon", "--optimizer.state_dtype", "bfloat16")
    assert 0.4 * adamw < muon < 0.9 * adamw
    assert abs(muon_bf16 / muon - 0.5) < 0.02
    assert muon_update > adamw_update
    # FSDP x TP: each matrix gathered once over both dimensions to its owner, there too.
    tp = ("--parallelism.tensor_parallel_degree", "2")
    assert measured("--optimizer.name", "Muon", *tp, world=4)[1] > measured(*tp, world=4)[1]
