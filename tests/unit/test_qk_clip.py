"""QK-clip (optimizer.qk_clip_threshold; titanlike/train/qk_clip.py) in one process: the maxima the
attention records equal the logits computed by hand, for every mask the kernels take; after a step
whose logits exploded (a huge learning rate) the heads over the threshold are rescaled exactly as the
rule says, and the step's batch then stays under it; a threshold never reached changes nothing;
the same for DeepSeek-V3's multi-head latent attention (MLA), with and without its low-rank query;
the plan-time refusals. FSDP2: tests/distributed/test_muon_parity.py."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from test_deepseek_v3_model import build as build_deepseek_v3, tiny as tiny_deepseek_v3
from titanlike.config import ConfigError, load_job_config
from titanlike.models.common.attention import DocumentMask, core_attention, max_logit
from titanlike.models.llama3 import Transformer, llama3_flavors
from titanlike.train.optimizer import build_optimizer
from titanlike.train.plan import plan_job
from titanlike.train.qk_clip import QKClip

SEQ = 16
ARGS = dataclasses.replace(llama3_flavors["debugmodel_tiny"], n_layers=2, vocab_size=320, max_seq_len=SEQ)
TAU = 60.0  # step 1's maxima at lr 2 lie between 56 and 94: some heads over, some under


def _dense_max(q, k, allowed) -> torch.Tensor:
    """Per query head, the largest q.k / sqrt(d) where `allowed` (broadcast to the scores)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("case", ["causal", "window", "documents", "bidirectional"])
def test_max_logit_equals_the_dense_scores(case):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 6, 24, 8, generator=g), torch.randn(2, 3, 24, 8, generator=g)
    causal = torch.ones(24, 24, dtype=torch.bool).tril()
    ids = torch.tensor([[0] * 10 + [1] * 14, [0] * 3 + [1] * 21])
    mask = kwargs = None
    if case == "causal":
        allowed, kwargs = causal, {}
    elif case == "window":
        band = torch.arange(24)[:, None] - torch.arange(24)[None] < 5
        allowed, kwargs = causal & band, {"window": 5}
    elif case == "documents":
        mask = DocumentMask.from_document_ids(ids, "sdpa")
        allowed, kwargs = mask.dense, {}
    else:
        mask = DocumentMask.from_document_ids(ids, "sdpa", causal=False)
        allowed, kwargs = mask.dense, {"causal": False}
    # Blocks of 3 query rows: the chunked loop and its last, shorter block.
    got = max_logit(q, k, mask, chunk_bytes=4 * 2 * 6 * 24 * 3, **kwargs)
    torch.testing.assert_close(got, _dense_max(q, k, allowed), rtol=1e-6, atol=1e-6)


def _model() -> Transformer:
    with torch.device("meta"):
        model = Transformer(ARGS)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    return model


def _capture(model) -> list:
    """The (q, k) each attention hands its kernel, appended on every forward."""
    seen = []
    for block in model.layers.values():
        def hooked(q, k, v, mask=None, _seen=seen, **kw):
            _seen.append((q.detach(), k.detach()))
            return core_attention(q, k, v, mask, **kw)
        block.attention.core_attention = hooked
    return seen


def _step(model, optimizer, tokens) -> None:
    F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _clip_and_replay(clip, model, optimizer, tokens, seen: list) -> list[tuple[tuple, torch.Tensor]]:
    """One step of `model` (its learning rate set to 0 by the caller) recording each clipped attention's
    inputs and maxima, then QK-clip, then every attention run again on its recorded inputs: the
    ((q, k) it attends with after the clip, its max logits before) of each layer."""
    inputs = []
    hooks = [m.register_forward_pre_hook(lambda module, a, kw: inputs.append((module, a, kw)), with_kwargs=True)
             for _, m in clip.layers]
    _step(model, optimizer, tokens)
    for hook in hooks:
        hook.remove()
    before = [m.logit_max.clone() for _, m in clip.layers]
    clip.apply(torch.tensor(True))
    seen.clear()
    with torch.no_grad():
        for module, a, kw in inputs:
            module(*a, **kw)
    return list(zip(seen, before, strict=True))


def test_exploding_logits_are_clipped_as_the_rule_computes():
    cfg = load_job_config(["--optimizer.name", "Muon", "--optimizer.lr", "2", "--optimizer.implementation",
                           "for-loop"]).optimizer
    clipped, plain = _model(), _model()
    optimizers = [build_optimizer([m], cfg) for m in (clipped, plain)]
    clip = QKClip([clipped], TAU)
    seen = _capture(clipped)
    tokens = torch.randint(0, ARGS.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    for step in range(2):
        seen.clear()
        for model, optimizer in zip((clipped, plain), optimizers):
            _step(model, optimizer, tokens)
        recorded = [m.logit_max.clone() for _, m in clip.layers]
        for (q, k), got in zip(seen, recorded):  # the maxima of the step's forward
            torch.testing.assert_close(got, _dense_max(q, k, causal), rtol=1e-5, atol=1e-6)
        expected = copy.deepcopy(plain.state_dict())
        for (i, m), maxes in zip(clip.layers, recorded):
            gamma = torch.where(maxes > TAU, TAU / maxes, torch.ones_like(maxes))
            # GQA: the key head follows the largest logit of the query heads that share it.
            group = gamma.view(ARGS.n_kv_heads, -1).amin(1)
            for name, factor in (("wq", gamma.sqrt()), ("wk", group.sqrt())):
                key = f"layers.{i}.attention.{name}.weight"
                expected[key] = expected[key] * factor.repeat_interleave(m.head_dim)[:, None]
        maxima = clip.apply(torch.tensor(True))
        torch.testing.assert_close(maxima, torch.stack([x.max() for x in recorded]))
        if step == 0:
            assert maxima.max() < TAU  # the initial weights' logits: nothing to clip
        else:
            assert maxima.min() > TAU and min(x.min() for x in recorded) < TAU  # some heads over, some under
        for name, value in clipped.state_dict().items():
            torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=0, msg=name)
        plain.load_state_dict(clipped.state_dict())  # the next step starts from the clipped weights

    # A step at learning rate 0: only the clip changes the weights, so each attention, given its
    # inputs of the step again, has every head at or under the threshold (the largest of each key
    # group at it). Layers after the first see other inputs once the first is clipped.
    optimizers[0].param_groups[0]["lr"] = optimizers[0].param_groups[1]["lr"] = 0.0
    replayed = _clip_and_replay(clip, clipped, optimizers[0], tokens, seen)
    assert all(was.max() > TAU for _, was in replayed)
    for (q, k), was in replayed:
        after = _dense_max(q, k, causal)
        assert (after <= TAU * (1 + 1e-5)).all(), after
        group = ARGS.n_heads // ARGS.n_kv_heads
        top = was.view(ARGS.n_kv_heads, -1).argmax(1) + torch.arange(ARGS.n_kv_heads) * group
        over = was[top] > TAU
        torch.testing.assert_close(after[top][over], torch.full_like(after[top][over], TAU), rtol=1e-5, atol=0)


def test_a_threshold_never_reached_changes_nothing():
    """Recording the maxima leaves the forward and the step as they were, and a skipped step scales nothing."""
    cfg = load_job_config(["--optimizer.name", "Muon", "--optimizer.lr", "2", "--optimizer.implementation",
                           "for-loop"]).optimizer
    clipped, plain = _model(), _model()
    optimizers = [build_optimizer([m], cfg) for m in (clipped, plain)]
    clip = QKClip([clipped], 1e9)
    tokens = torch.randint(0, ARGS.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(1))
    for step in range(3):
        for model, optimizer in zip((clipped, plain), optimizers):
            _step(model, optimizer, tokens)
        clip.apply(torch.tensor(True))
        for name, value in clipped.state_dict().items():
            assert torch.equal(value, plain.state_dict()[name]), (step, name)
    skipped = QKClip([clipped], 1e-3)  # every head over it, but the step was not applied
    before = copy.deepcopy(clipped.state_dict())
    _step(clipped, optimizers[0], tokens)
    after_step = copy.deepcopy(clipped.state_dict())
    skipped.apply(torch.tensor(False))
    assert all(torch.equal(v, after_step[n]) for n, v in clipped.state_dict().items())
    assert not all(torch.equal(v, before[n]) for n, v in clipped.state_dict().items())
    assert clipped.layers["0"].attention.logit_max.eq(float("-inf")).all()  # the next step starts afresh


def _plan(*overrides: str, world: int = 1):
    cfg = load_job_config(["--optimizer.name", "Muon", "--optimizer.qk_clip_threshold", "100",
                           "--training.seq_len", "64", *overrides])
    return plan_job(cfg, world, vocab_size=320)


@pytest.mark.parametrize("overrides, message", [
    # Gated attention and linear attention: neither protocol's forward.
    (["--model.name", "qwen3_next", "--model.flavor", "debugmodel_tiny"], "and this model has neither"),
    (["--model.name", "qwen3", "--model.flavor", "debugmodel"], "its QK-norm normalises q and k"),
    (["--model.flavor", "debugmodel_tiny", "--parallelism.context_parallel_degree", "2"],
     "does not run with context parallelism"),
])
def test_plan_refuses_what_it_cannot_clip(overrides, message):
    world = 2 if "--parallelism.context_parallel_degree" in overrides else 1
    with pytest.raises((ConfigError, ValueError), match=message):
        _plan(*overrides, world=world)


def test_plan_takes_the_shared_attention_and_mla_and_refuses_a_negative_threshold():
    _plan("--model.flavor", "debugmodel_tiny")
    _plan("--model.name", "deepseek_v3", "--model.flavor", "debugmodel")
    with pytest.raises((ConfigError, ValueError), match="does not run with context parallelism"):
        _plan("--model.name", "deepseek_v3", "--model.flavor", "debugmodel_nolora",
              "--parallelism.context_parallel_degree", "2", world=2)
    with pytest.raises(ConfigError, match="qk_clip_threshold must be positive"):
        plan_job(load_job_config(["--optimizer.qk_clip_threshold", "-1"]), world_size=1, vocab_size=320)


MLA_TAU = 60.0  # step 1's maxima at lr 2 lie between 57 and 86 (without the low-rank query)


@pytest.mark.parametrize("q_lora_rank", [0, 48])
def test_mla_exploding_logits_are_clipped_by_the_kimi_k2_rule(q_lora_rank):
    """MLA (models/deepseek_v3/attention.py): the recorded maxima are those of the q and k its kernel
    gets; after the step, head h's q_nope rows (wq or wq_b) and k_nope rows (wkv_b) are scaled by
    sqrt(gamma_h), its q_rope rows by gamma_h, and nothing else (wk_pe, v rows, the latents) changes;
    the step's inputs then give every head at most tau, a head that was over exactly tau."""
    args = tiny_deepseek_v3(n_layers=2, q_lora_rank=q_lora_rank)
    cfg = load_job_config(["--optimizer.name", "Muon", "--optimizer.lr", "2", "--optimizer.implementation",
                           "for-loop"]).optimizer
    clipped, plain = build_deepseek_v3(args), build_deepseek_v3(args)
    optimizers = [build_optimizer([m], cfg) for m in (clipped, plain)]
    clip = QKClip([clipped], MLA_TAU)
    assert len(clip.layers) == args.n_layers
    seen = _capture(clipped)
    tokens = torch.randint(0, args.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    nope, rope, v = args.qk_nope_head_dim, args.qk_rope_head_dim, args.v_head_dim
    query = "wq" if q_lora_rank == 0 else "wq_b"
    for step in range(2):  # step 0's forward sees the initial weights, step 1's those of the huge step
        seen.clear()
        for model, optimizer in zip((clipped, plain), optimizers):
            _step(model, optimizer, tokens)
        recorded = [m.logit_max.clone() for _, m in clip.layers]
        for (q, k), got in zip(seen, recorded):
            torch.testing.assert_close(got, _dense_max(q, k, causal), rtol=1e-5, atol=1e-6)
        over = torch.cat(recorded) > MLA_TAU
        if step == 1:
            assert over.any() and not over.all(), torch.cat(recorded)  # some heads over, some under
        expected = copy.deepcopy(plain.state_dict())
        for (i, _), maxes in zip(clip.layers, recorded):
            gamma = torch.where(maxes > MLA_TAU, MLA_TAU / maxes, torch.ones_like(maxes))
            root = gamma.sqrt()[:, None, None]
            w = expected[f"layers.{i}.attention.{query}.weight"].clone().view(args.n_heads, nope + rope, -1)
            w[:, :nope] *= root
            w[:, nope:] *= gamma[:, None, None]
            expected[f"layers.{i}.attention.{query}.weight"] = w.flatten(0, 1)
            w = expected[f"layers.{i}.attention.wkv_b.weight"].clone().view(args.n_heads, nope + v, -1)
            w[:, :nope] *= root
            expected[f"layers.{i}.attention.wkv_b.weight"] = w.flatten(0, 1)
        clip.apply(torch.tensor(True))
        for name, value in clipped.state_dict().items():
            torch.testing.assert_close(value, expected[name], rtol=1e-6, atol=0, msg=name)
        plain.load_state_dict(clipped.state_dict())

    # A step at learning rate 0: the attentions given the step's inputs again end at or under tau.
    for group in optimizers[0].param_groups:
        group["lr"] = 0.0
    replayed = _clip_and_replay(clip, clipped, optimizers[0], tokens, seen)
    assert any(was.max() > MLA_TAU for _, was in replayed)
    for (q, k), was in replayed:
        after = _dense_max(q, k, causal)
        torch.testing.assert_close(after, torch.minimum(was, torch.tensor(MLA_TAU)), rtol=1e-5, atol=1e-5)
