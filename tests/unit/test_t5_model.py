"""T5 family: registry, sizes, FLOPs, relative buckets, masks, causality and its layout rules.

The family is new files only (titanlike/models/t5/); these tests reach it through the registry. TP and
FSDP on two gloo ranks: tests/distributed/test_t5_model_ranks.py.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from family_checks import held_params
from t5_checks import build, tiny_args
from titanlike.config import load_job_config
from titanlike.models.common import sharding
from titanlike.models.common.attention import DocumentMask
from titanlike.models.registry import get_model_spec, model_names
from titanlike.models.t5 import T5, t5_flavors
from titanlike.models.t5.model import relative_position_bucket
from titanlike.objectives import SpanCorruption
from titanlike.objectives.registry import family_objective

SPEC = get_model_spec("t5")
REPO = Path(__file__).resolve().parents[2]


def batch(args, seq=24, dec=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, args.vocab_size, (2, seq), generator=g),
            torch.randint(0, args.vocab_size, (2, dec), generator=g))


# ---------------------------------------------------------------- registry, sizes, FLOPs


def test_registered_by_its_folder_alone():
    assert "t5" in model_names()
    assert SPEC.model_cls is T5 and SPEC.hf.model_types == ("t5",) and SPEC.pipeline_ends is None
    assert {"debugmodel", "small", "base", "large", "3B", "11B"} <= set(SPEC.flavors)
    assert SPEC.shard.top["encoder_relative_bias"] is sharding.split_heads
    assert SPEC.shard.block["cross_attention.wo"] is sharding.rowwise
    assert isinstance(family_objective(load_job_config([]), SPEC, t5_flavors["debugmodel"]), SpanCorruption)
    d = t5_flavors["debugmodel"]
    assert (d.dim, d.n_encoder_layers, d.n_decoder_layers, d.n_heads, d.head_dim, d.ffn_hidden_dim, d.vocab_size) == (
        256, 2, 2, 8, 32, 512, 2048)


@pytest.mark.parametrize("flavor", sorted(t5_flavors))
def test_num_params_counts_the_meta_model(flavor):
    args = t5_flavors[flavor]
    with torch.device("meta"):
        model = T5(args)
    assert args.num_params() == held_params(model)
    lookups = model.encoder_relative_bias.weight.numel() * 2 + model.tok_embeddings.weight.numel()
    assert args.num_params(exclude_embedding=True) == held_params(model) - lookups
    assert len(model.layers) == args.num_layers
    assert model.layers["0"].cross_attention is None and model.layers[str(args.n_encoder_layers)].cross_attention


def test_tied_relu_variant_counts_one_table():
    args = tiny_args(feed_forward="relu", tie_word_embeddings=True, scale_decoder_outputs=True)
    model = build(args)
    assert model.output.weight is model.tok_embeddings.weight and model.tied_weights
    assert model.layers["0"].feed_forward.w3 is None
    assert args.num_params() == held_params(model)
    tables = 2 * model.encoder_relative_bias.weight.numel()
    assert args.num_params(exclude_embedding=True) == held_params(model) - tables


def _matmul_flops(model: T5, tokens, decoder_inputs) -> int:
    """Forward FLOPs of every matrix multiply, counted by torch (linears and attention scores). SDPA
    runs as its math decomposition (bmm), which the counter sees on CPU; the fused CPU kernel it
    does not count."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, sdpa_kernel(SDPBackend.MATH):
        model(tokens, decoder_inputs=decoder_inputs)
    return counter.get_total_flops()


@pytest.mark.parametrize("tied", [False, True])
def test_flops_per_token_matches_the_module(tied):
    # torch counts 2 FLOPs per multiply-add in the forward; training is 3x that. Norm weights are
    # parameters in our formula but elementwise work for torch: the difference is tiny and known.
    args = tiny_args(tie_word_embeddings=tied, scale_decoder_outputs=tied,
                     feed_forward="relu" if tied else "gated-gelu")
    model = build(args)
    seq = 32
    tokens, dec = batch(args, seq=seq, dec=args.decoder_len(seq))
    counted = 3 * _matmul_flops(model, tokens, dec) / tokens.shape[0] / seq
    norms = 6 * (args.n_encoder_layers * 2 + 1 + (args.n_decoder_layers * 3 + 1) * args.decoder_len_ratio) * args.dim
    assert args.flops_per_token(seq) == pytest.approx(counted + norms, rel=1e-3)


# ---------------------------------------------------------------- relative buckets


@pytest.mark.parametrize("bidirectional", [True, False])
def test_buckets_match_transformers(bidirectional):
    from transformers.models.t5.modeling_t5 import T5Attention

    offsets = torch.arange(-300, 301)[None, :]
    for buckets, distance in ((32, 128), (8, 20)):
        want = T5Attention._relative_position_bucket(offsets, bidirectional=bidirectional, num_buckets=buckets,
                                                     max_distance=distance)
        got = relative_position_bucket(offsets, bidirectional=bidirectional, num_buckets=buckets, max_distance=distance)
        assert torch.equal(got, want)
    # A few by hand (32 buckets, 128): exact up to 7 (bidirectional) or 15, log-spaced, then capped.
    got = relative_position_bucket(torch.tensor([0, -1, 1, -7, 7, -127, -500, 500]), bidirectional=True,
                                   num_buckets=32, max_distance=128)
    assert got.tolist() == [0, 1, 17, 7, 23, 15, 15, 31]


def test_bias_table_is_shared_by_each_stack():
    args = tiny_args()
    model = build(args)
    tokens, dec = batch(args)
    with torch.no_grad():
        before = model(tokens, decoder_inputs=dec)
        model.encoder_relative_bias.weight.add_(0.5 * torch.randn_like(model.encoder_relative_bias.weight))
        enc_changed = model(tokens, decoder_inputs=dec)
        model.decoder_relative_bias.weight.add_(0.5 * torch.randn_like(model.decoder_relative_bias.weight))
        dec_changed = model(tokens, decoder_inputs=dec)
    assert (before - enc_changed).abs().max() > 1e-4 and (enc_changed - dec_changed).abs().max() > 1e-4


# ---------------------------------------------------------------- masks and causality


def test_shapes_and_decoder_inputs_are_required():
    args = tiny_args()
    model = build(args)
    tokens, dec = batch(args, seq=24, dec=10)
    assert model(tokens, decoder_inputs=dec).shape == (2, 10, args.vocab_size)
    with pytest.raises(ValueError, match="decoder_inputs"):
        model(tokens)


def test_padding_changes_no_real_output():
    args = tiny_args()
    model = build(args)
    tokens, dec = batch(args, seq=24)
    doc = torch.zeros(2, 24, dtype=torch.long)
    doc[0, 17:] = 1  # sample 0: 7 tokens of padding at the end
    mask = DocumentMask.from_document_ids(doc, "sdpa", causal=False)
    other = tokens.clone()
    other[0, 17:] = (other[0, 17:] + 5) % args.vocab_size
    with torch.no_grad():
        logits = model(tokens, mask=mask, decoder_inputs=dec)
        torch.testing.assert_close(model(other, mask=mask, decoder_inputs=dec), logits, rtol=0, atol=1e-5)
        # Without the mask the padding is attended to: the test can fail.
        assert (model(other, decoder_inputs=dec)[0] - model(tokens, decoder_inputs=dec)[0]).abs().max() > 1e-3
        # The mask kernel does not matter: the model reads document_ids.
        ids_only = DocumentMask.from_document_ids(doc, None, causal=False)
        torch.testing.assert_close(model(tokens, mask=ids_only, decoder_inputs=dec), logits, rtol=0, atol=1e-6)


def test_decoder_is_causal():
    args = tiny_args()
    model = build(args)
    tokens, dec = batch(args, dec=12)
    later = dec.clone()
    later[:, 7] = (later[:, 7] + 3) % args.vocab_size
    with torch.no_grad():
        a, b = model(tokens, decoder_inputs=dec), model(tokens, decoder_inputs=later)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-5)
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-3


def test_init_depends_on_seed_and_name_only():
    args = tiny_args()
    a, b = build(args, seed=3), build(args, seed=3)
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    assert not torch.equal(build(args, seed=4).tok_embeddings.weight, a.tok_embeddings.weight)
    wq = a.layers["0"].attention.wq.weight
    assert wq.std().item() == pytest.approx((args.dim * args.head_dim) ** -0.5, rel=0.1)


# ---------------------------------------------------------------- layout rules


def dims(tp=1, pp=1, cp=1):
    return SimpleNamespace(tp=tp, pp=pp, cp=cp, ep=1)


def test_layout_rules_are_one_sentence():
    args = t5_flavors["debugmodel"]
    args.validate(dims(tp=8), seq_len=4096)  # relative positions: any length
    for layout, option in ((dims(pp=2), "pipeline_parallel_degree"), (dims(cp=2), "context_parallel_degree")):
        with pytest.raises(ValueError, match=option) as err:
            args.validate(layout, seq_len=128)
        message = str(err.value)
        assert message.count(". ") == 0 and message.count(";") == 1, message
    with pytest.raises(ValueError, match="tensor_parallel_degree"):
        t5_flavors["small"].validate(dims(tp=4), seq_len=128)
    with pytest.raises(ValueError, match="feed_forward"):
        tiny_args(feed_forward="swiglu")



def test_preset_parses_and_layouts_are_checked_before_any_process_group():
    from titanlike.train.plan import plan_job

    preset = ["--job.config_file", str(REPO / "train_configs" / "t5_debug.toml")]
    cfg = load_job_config(preset)
    assert (cfg.model.name, cfg.model.flavor, cfg.training.seq_len, cfg.span_corruption.decoder_seq_len) == (
        "t5", "debugmodel", 128, 32)
    plan_job(cfg, world_size=1)
    plan_job(load_job_config([*preset, "--parallelism.tensor_parallel_degree", "2"]), world_size=2)
    for option in ("pipeline_parallel_degree", "context_parallel_degree"):
        with pytest.raises(ValueError, match=f"T5 does not support {option}"):
            plan_job(load_job_config([*preset, f"--parallelism.{option}", "2"]), world_size=2)
    # Generic rules of encoder samples: sequence parallelism cuts the decoder too; packed-document
    # options do not apply; only sentence-split sources give these samples.
    with pytest.raises(ValueError, match="decoder_seq_len 30 must be divisible by tensor_parallel_degree 4"):
        plan_job(load_job_config([*preset, "--span_corruption.decoder_seq_len", "30",
                                         "--parallelism.tensor_parallel_degree", "4"]), world_size=4).dims
    for flag in ("--training.document_masking", "--training.eod_mask_loss"):
        with pytest.raises(ValueError, match=f"training.{flag[11:]} applies to next-token models"):
            plan_job(load_job_config([*preset, flag]), world_size=1)
    with pytest.raises(ValueError, match="cannot give span_corruption samples"):
        plan_job(load_job_config([*preset, "--training.dataset", "c4_test"]), world_size=1)
