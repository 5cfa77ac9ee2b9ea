"""BERT family: sizes and FLOPs against the module, tied weights, bidirectional attention and the
document mask, post- and pre-norm blocks, the binary head's weighted loss (attached and reported),
the pipeline split and the config rules. Tiny models on the CPU, seconds in all."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from family_checks import held_params, materialize
from titanlike.config import load_job_config
from titanlike.models.bert import BINARY_LOSS, Bert, BertArgs, bert_flavors
from titanlike.models.common.attention import DocumentMask
from titanlike.models.outputs import LossReports
from titanlike.models.registry import get_model_spec, model_names, spec_for_hf_model_type
from titanlike.objectives import MaskedLM
from titanlike.objectives.registry import family_objective

SPEC = get_model_spec("bert")


def tiny_args(**overrides) -> BertArgs:
    return dataclasses.replace(bert_flavors["debugmodel_tiny"], **{"vocab_size": 96, "max_seq_len": 32, **overrides})


def build(args, seed=0) -> Bert:
    return materialize(Bert, args, seed)


def batch(args, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab_size, (3, seq), generator=g)
    token_types = (torch.arange(seq) >= seq // 2).long().expand(3, seq).clone()
    return tokens, token_types


# ---------------------------------------------------------------- registry, sizes, FLOPs


def test_registered_by_its_folder_alone():
    assert "bert" in model_names()
    assert SPEC.model_cls is Bert and SPEC.hf.model_types == ("bert",) and spec_for_hf_model_type("bert") is SPEC
    assert {"debugmodel", "debugmodel_tiny", "base", "large", "3.9B"} <= set(SPEC.flavors)
    debug = bert_flavors["debugmodel"]
    assert (debug.dim, debug.n_layers, debug.n_heads, debug.vocab_size, debug.max_seq_len) == (256, 4, 8, 2048, 512)
    big = bert_flavors["3.9B"]
    assert (big.n_layers, big.dim, big.n_heads, big.pre_norm) == (48, 2560, 40, True)
    assert debug.norm_eps == 1e-12 and not debug.pre_norm and debug.binary_head
    # Its objective: masked LM, on sentence pairs exactly when the flavor has the binary head.
    cfg = load_job_config([])
    objective = family_objective(cfg, SPEC, debug)
    assert isinstance(objective, MaskedLM) and objective.sentence_pairs and objective.token_fields == ("token_types",)
    assert family_objective(cfg, SPEC, tiny_args(binary_head=False)).sentence_pairs is False
    assert debug.attention_shape().causal is False
    assert debug.reported_losses() == (BINARY_LOSS,) and tiny_args(binary_head=False).reported_losses() == ()
    assert all(callable(style) for style in {**SPEC.shard.top, **SPEC.shard.block}.values())


@pytest.mark.parametrize("flavor", sorted(bert_flavors))
def test_num_params_counts_the_meta_model(flavor):
    args = bert_flavors[flavor]
    with torch.device("meta"):
        model = Bert(args)
    assert model.output.weight is model.tok_embeddings.weight and model.output.bias is not None
    assert args.num_params() == held_params(model)
    lookups = model.pos_embeddings.weight.numel() + model.type_embeddings.weight.numel()
    assert args.num_params(exclude_embedding=True) == held_params(model) - lookups
    assert (model.norm is not None) == args.pre_norm
    assert bert_flavors["base"].num_params() == pytest.approx(110e6, rel=0.01)  # BERT-base's published size
    assert bert_flavors["large"].num_params() == pytest.approx(340e6, rel=0.02)


@pytest.mark.parametrize("overrides", [{}, {"pre_norm": True}, {"binary_head": False}])
def test_variants_count_and_flops(overrides):
    args = tiny_args(**overrides)
    model = build(args)
    assert args.num_params() == held_params(model)
    # FLOPs: 6 x the per-token matmul parameters (no lookup tables, no once-per-sequence pooler and
    # binary head; the tied table and the MLM transform counted) + 12 L H Q T.
    per_sequence = {"pos_embeddings", "type_embeddings", "binary_head"}
    counted = {name: p.numel() for name, p in model.named_parameters() if name.split(".")[0] not in per_sequence}
    assert {"tok_embeddings.weight", "lm_head.dense.weight", "output.bias"} <= set(counted)
    n = sum(counted.values())
    T = 24
    assert args.flops_per_token(T) == 6 * n + 12 * args.n_layers * args.n_heads * args.head_dim * T


# ---------------------------------------------------------------- forward


def test_shapes_tied_weights_and_init_survive_to_empty():
    args = tiny_args()
    model = build(args, seed=4)
    assert model.output.weight is model.tok_embeddings.weight
    assert torch.count_nonzero(model.output.bias) == 0 and torch.all(model.embedding_norm.weight == 1)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(args.init_std, rel=0.05)
    again = build(args, seed=4)
    for (name, p), q in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(p, q), name
    tokens, token_types = batch(args)
    logits = model(tokens, token_types=token_types)
    assert logits.shape == (3, 16, args.vocab_size)
    assert model.encode(tokens).shape == (3, 16, args.dim)
    assert model.binary_logits(model.encode(tokens)).shape == (3, 2)
    # Token types and positions matter; None means all-zero types and 0..seq-1.
    assert not torch.allclose(logits, model(tokens))
    torch.testing.assert_close(model(tokens, positions=torch.arange(16), token_types=torch.zeros_like(tokens)),
                               model(tokens), rtol=0, atol=0)


def test_attention_is_bidirectional_and_the_document_mask_hides_padding():
    args = tiny_args()
    model = build(args).eval()
    tokens, token_types = batch(args)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % args.vocab_size
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert (a[:, 0] - b[:, 0]).abs().max() > 1e-4  # position 0 sees the last token
    # Padding (document id 1, at the end) is not seen by real tokens: their logits equal the unpadded run's.
    document_ids = (torch.arange(16) >= 10).long().expand(3, 16)
    mask = DocumentMask.from_document_ids(document_ids, "sdpa", causal=False)
    with torch.no_grad():
        padded = model(tokens, mask=mask, token_types=token_types)
        short = model(tokens[:, :10], token_types=token_types[:, :10])
    torch.testing.assert_close(padded[:, :10], short, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pre_norm", [False, True])
def test_block_order(pre_norm):
    args = tiny_args(pre_norm=pre_norm)
    model = build(args)
    block = model.layers["0"]
    x = torch.randn(2, 8, args.dim)
    with torch.no_grad():
        for norm in (block.attention_norm, block.ffn_norm):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.normal_()
        if pre_norm:
            h = x + block.attention(block.attention_norm(x), None)
            want = h + block.feed_forward(block.ffn_norm(h))
        else:
            h = block.attention_norm(x + block.attention(x, None))
            want = block.ffn_norm(h + block.feed_forward(h))
        torch.testing.assert_close(block(x, None), want, rtol=0, atol=0)
    assert block.feed_forward.approximate == "none"  # BERT's erf GELU
    # Pre-norm ends with a final LayerNorm (Megatron's); post-norm blocks end normalized.
    assert (model.norm is not None) == pre_norm


# ---------------------------------------------------------------- binary head


def test_binary_loss_is_weighted_attached_and_reported():
    args = tiny_args()
    model = build(args, seed=1).train()
    tokens, token_types = batch(args)
    labels, weights = torch.tensor([0, 1, 1]), torch.tensor([3.0, 1.0, 5.0])

    # The reference: the same forward with the binary loss computed by hand.
    ref = build(args, seed=1).train()
    h = ref.encode(tokens, token_types=token_types)
    manual = (F.cross_entropy(ref.binary_logits(h), labels, reduction="none") * weights).sum()
    g = torch.Generator().manual_seed(2)
    grad_logits = torch.randn(3, 16, args.vocab_size, generator=g)
    (manual + (ref.output(ref.lm_head(h)) * grad_logits).sum()).backward()

    logits = model(tokens, token_types=token_types, binary_labels=labels, binary_weights=weights)
    (logits * grad_logits).sum().backward()
    sums = LossReports([model], args.reported_losses(), torch.device("cpu")).collect()
    assert sums.item() == pytest.approx(manual.item(), rel=1e-6)
    assert model.binary_head.reported_loss_sum.item() == 0  # read and zeroed
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-5, atol=1e-6, msg=name)
    assert all(p.grad.abs().sum() > 0 for p in model.binary_head.parameters())

    # Without weights each sample counts once; eval forwards and no-grad forwards report nothing.
    model.zero_grad()
    model(tokens, token_types=token_types, binary_labels=labels).sum().backward()
    unweighted = F.cross_entropy(ref.binary_logits(h), labels, reduction="sum")
    assert model.binary_head.reported_loss_sum.item() == pytest.approx(unweighted.item(), rel=1e-6)
    model.binary_head.reported_loss_sum.zero_()
    with torch.no_grad():
        model(tokens, binary_labels=labels)
    model.eval()(tokens, binary_labels=labels)
    assert model.binary_head.reported_loss_sum.item() == 0


def test_binary_loss_only_where_position_0_is_local():
    """A context-parallel slice without position 0 adds nothing, but still gives the pooler and the
    binary head a (zero) gradient, so every rank reduces the same gradients."""
    args = tiny_args()
    model = build(args).train()
    tokens, token_types = batch(args, seq=8)
    labels = torch.tensor([0, 1, 1])
    out = model(tokens, positions=torch.arange(8, 16), token_types=token_types, binary_labels=labels)
    (out * 0).sum().backward()
    assert model.binary_head.reported_loss_sum.item() == 0
    for p in model.binary_head.parameters():
        assert p.grad is not None and torch.count_nonzero(p.grad) == 0
    model.zero_grad()
    out = model(tokens, positions=torch.arange(8), token_types=token_types, binary_labels=labels)
    (out * 0).sum().backward()
    assert model.binary_head.reported_loss_sum.item() > 0
    assert torch.count_nonzero(model.binary_head.classifier.weight.grad) > 0


def test_without_binary_head():
    args = tiny_args(binary_head=False)
    model = build(args)
    assert model.binary_head is None
    tokens, token_types = batch(args)
    assert model(tokens, token_types=token_types).shape == (3, 16, args.vocab_size)


# ---------------------------------------------------------------- pipeline split


# ---------------------------------------------------------------- config rules


def test_validate_and_sizes_from_the_job():
    @dataclasses.dataclass
    class Dims:
        tp: int = 1
        cp: int = 1
        pp: int = 1
        ep: int = 1

    debug = bert_flavors["debugmodel"]
    debug.validate(Dims(tp=8), seq_len=512)
    with pytest.raises(ValueError, match="tensor_parallel_degree"):
        debug.validate(Dims(tp=3), seq_len=128)
    with pytest.raises(ValueError, match="training.seq_len 513"):
        debug.validate(Dims(), seq_len=513)
    sized = debug.update_from_config(vocab_size=1000, seq_len=128)
    assert (sized.vocab_size, sized.max_seq_len) == (1000, 512)  # the position table stays
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        tiny_args(tie_word_embeddings=False)
    assert BertArgs.from_dict(tiny_args(pre_norm=True).to_dict()) == tiny_args(pre_norm=True)
