"""Document masking: ids and restarted positions from EOS tokens, the dense and Flex masks, the
model on a packed sample equal to the model on each document alone, and the trainer's
microbatch preparation (EOD loss masking, positions).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import sharp_llama
from titanlike.models.common.attention import DocumentMask, core_attention, resolve_attention_backend

EOD = 1


def test_ids_and_positions_restart_after_each_eod():
    tokens = torch.tensor([[5, 6, EOD, 7, 8, 9, EOD, 4],
                           [EOD, 3, 3, 3, 3, 3, 3, EOD]])
    mask = DocumentMask.from_tokens(tokens, EOD, kernel=None)
    # The EOD belongs to the document it closes; the next token starts a new one.
    assert mask.document_ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert mask.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 0], [0, 0, 1, 2, 3, 4, 5, 6]]
    assert mask.dense is None and mask.block_mask is None


def test_dense_mask_is_causal_within_documents():
    tokens = torch.tensor([[5, EOD, 7, 8]])
    dense = DocumentMask.from_tokens(tokens, EOD, kernel="sdpa").dense
    assert dense.shape == (1, 1, 4, 4)
    assert dense[0, 0].int().tolist() == [[1, 0, 0, 0],
                                         [1, 1, 0, 0],
                                         [0, 0, 1, 0],
                                         [0, 0, 1, 1]]


def test_flex_block_mask_matches_dense_sdpa():
    # FlexAttention runs forward-only in eager on CPU (no backward there): enough to check that
    # the block mask and the dense mask describe the same attention.
    torch.manual_seed(0)
    tokens = torch.randint(2, 50, (2, 128))
    tokens[0, [10, 63, 64, 100]] = EOD
    tokens[1, [0, 77]] = EOD
    q, k, v = torch.randn(2, 4, 128, 16), torch.randn(2, 2, 128, 16), torch.randn(2, 2, 128, 16)
    dense = core_attention(q, k, v, DocumentMask.from_tokens(tokens, EOD, kernel="sdpa"))
    from torch.nn.attention.flex_attention import flex_attention

    block_mask = DocumentMask.from_tokens(tokens, EOD, kernel="flex").block_mask
    with pytest.warns(UserWarning, match="without torch.compile"):
        flex = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    torch.testing.assert_close(flex, dense, atol=2e-6, rtol=1e-5)
    # And it is not plain causal attention.
    assert (dense - F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)).abs().max() > 1e-2


def test_packed_sample_equals_each_document_alone():
    """The defining property: with document masking a packed sample's logits are those of each
    document run through the model by itself.

    Restarting positions changes nothing here: RoPE scores depend on relative positions only,
    and the mask keeps every pair inside one document (measured: 5e-7 off, rounding). They
    matter for absolute position embeddings and keep far-from-trained angles out of long packs.
    """
    torch.manual_seed(3)
    docs = [torch.randint(2, 64, (n,)) for n in (9, 14, 9)]
    for d in docs:
        d[-1] = EOD
    packed = torch.cat(docs)[None]
    model = sharp_llama(packed.shape[1], vocab=64)
    mask = DocumentMask.from_tokens(packed, EOD, kernel="sdpa")
    with torch.no_grad():
        logits = model(packed, positions=mask.positions, mask=mask)
        alone = torch.cat([model(d[None]) for d in docs], dim=1)
        plain = model(packed)
    torch.testing.assert_close(logits, alone, atol=2e-5, rtol=1e-4)
    # Plain causal attention lets later documents see earlier ones.
    assert (plain - alone).abs().max() > 1e-2


def test_backend_resolution():
    assert resolve_attention_backend("auto", "cpu") == "sdpa"
    assert resolve_attention_backend("auto", "cuda") == "flex"
    assert resolve_attention_backend("sdpa", "cuda") == "sdpa"
    with pytest.raises(ValueError, match="one of"):
        resolve_attention_backend("flash", "cpu")


@pytest.fixture(scope="module")
def trainer_factory(tmp_path_factory):
    from titanlike.config import load_job_config
    from titanlike.train.plan import plan_job
    from titanlike.train.trainer import Trainer

    made = []

    def make(*overrides: str) -> Trainer:
        cfg = load_job_config(["--model.flavor", "debugmodel_tiny", "--training.seq_len", "32",
                               "--training.local_batch_size", "2", "--training.steps", "1",
                               "--job.dump_folder", str(tmp_path_factory.mktemp("dm")), *overrides])
        trainer = Trainer(plan_job(cfg, 1))
        made.append(trainer)
        return trainer

    yield make
    for trainer in made:
        trainer.close()


def test_trainer_prepares_document_masked_microbatches(trainer_factory):
    trainer = trainer_factory("--training.document_masking", "--training.eod_mask_loss")
    eos = trainer.tokenizer.eos_id
    inputs = torch.tensor([[7, 8, eos, 9, 10, 11], [eos, 5, 6, 7, eos, 8]])
    labels = torch.tensor([[8, eos, 9, 10, 11, 12], [5, 6, 7, eos, 8, 9]])
    mb = trainer.prepare({"inputs": inputs, "labels": labels})
    # Predictions made from an EOD (of the next document's first token) carry no loss.
    assert mb.targets["labels"].tolist() == [[8, eos, -100, 10, 11, 12], [-100, 6, 7, eos, -100, 9]]
    assert mb.positions.tolist() == [[0, 1, 2, 0, 1, 2], [0, 0, 1, 2, 3, 0]]
    assert mb.mask is not None and mb.mask.dense is not None

    plain = trainer_factory().prepare({"inputs": inputs, "labels": labels})
    assert plain.mask is None and plain.positions is None and torch.equal(plain.targets["labels"], labels)


def test_trainer_logs_attention_by_documents_unless_compiled(trainer_factory, caplog):
    import logging

    for extra, expected in (((), "on each document of a document mask, flash_attention kernel"),
                            (("--compile.enable", "--compile.backend", "eager"), "with a document mask (dense)")):
        caplog.clear()
        trainer = trainer_factory("--training.document_masking", *extra)
        with caplog.at_level(logging.INFO, logger="titanlike"):
            trainer._log_attention()
        assert expected in caplog.text, caplog.text



# Attention one document at a time (by_documents): rows of 256 tokens, each its own boundaries. Row 1's
# 128 documents of 2 tokens cost more in calls than the dense mask, so that row reads the dense mask.
ROW_LENGTHS = ([256], [2] * 128, [16] * 16, [40, 100, 60, 56])  # one, tiny, many, a padding document last


def _ids(rows) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


def _qkv(kv_heads: int, seq: int = 256):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(4, h, seq, 8, generator=g, requires_grad=True) for h in (4, kv_heads, kv_heads)]


def _count_sdpa(monkeypatch) -> list:
    """The attn_mask of every SDPA call (None for a document's own causal or full call)."""
    calls, sdpa = [], F.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(kwargs.get("attn_mask"))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", counted)
    return calls


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_attention_by_documents_equals_the_dense_mask(monkeypatch, causal, kv_heads):
    from titanlike.models.common.attention import _sdpa

    mask = DocumentMask.from_document_ids(_ids(ROW_LENGTHS), "sdpa", causal=causal)
    assert mask.document_lengths == ((256,), None, (16,) * 16, (40, 100, 60, 56))
    q, k, v = _qkv(kv_heads)
    expected = _sdpa(q, k, v, attn_mask=mask.dense)
    grads = torch.autograd.grad(expected.square().sum(), (q, k, v))
    calls = _count_sdpa(monkeypatch)
    got = core_attention(q, k, v, mask, causal=causal)
    # One call per document, but one call with its dense mask for the row of tiny documents.
    assert [m is None for m in calls] == [True, False] + [True] * (16 + 4)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(got.square().sum(), (q, k, v)), grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_values_of_another_width_by_documents():
    # Multi-head latent attention's v has its own head_dim (models/deepseek_v3/attention.py).
    from titanlike.models.common.attention import _sdpa

    mask = DocumentMask.from_document_ids(_ids(ROW_LENGTHS), "sdpa")
    q, k, _ = (t.detach() for t in _qkv(2))
    v = torch.randn(4, 2, 256, 12)
    torch.testing.assert_close(core_attention(q, k, v, mask), _sdpa(q, k, v, attn_mask=mask.dense),
                               atol=1e-5, rtol=1e-5)


def test_short_rows_of_many_documents_keep_one_dense_call(monkeypatch):
    # Every row too short for its documents' calls: one dense call for the batch, as before.
    mask = DocumentMask.from_tokens(torch.tensor([[5, EOD, 7, 8], [EOD, 5, 6, EOD]]), EOD, kernel="sdpa")
    assert mask.document_lengths is None and mask.dense is not None
    q, k, v = (torch.randn(2, 2, 4, 8) for _ in range(3))
    calls = _count_sdpa(monkeypatch)
    core_attention(q, k, v, mask)
    assert len(calls) == 1 and calls[0] is not None


def test_fake_tensors_keep_the_dense_mask():
    # The estimator's probe builds masks from fake tensors (estimation/probe.py): no values to read.
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    ids = mode.from_tensor(_ids(ROW_LENGTHS))
    with mode:
        mask = DocumentMask.from_document_ids(ids, "sdpa")
    assert mask.document_lengths is None and mask.dense.shape == (4, 1, 256, 256)


def test_rows_keep_their_document_lengths():
    # A pipeline microbatch's rows: the same lengths, and the attention of those rows alone.
    mask = DocumentMask.from_document_ids(_ids(ROW_LENGTHS), "sdpa")
    part = mask.rows(1, 3)
    assert part.document_lengths == mask.document_lengths[1:3]
    q, k, v = (t[1:3].detach() for t in _qkv(4))
    alone = DocumentMask.from_document_ids(_ids(ROW_LENGTHS[1:3]), "sdpa")
    torch.testing.assert_close(core_attention(q, k, v, part), core_attention(q, k, v, alone))


@pytest.mark.parametrize("option", ["window", "sinks"])
def test_windows_and_sinks_keep_the_dense_mask(monkeypatch, option):
    import titanlike.models.common.attention as attention

    mask = DocumentMask.from_document_ids(_ids(ROW_LENGTHS), "sdpa")
    q, k, v = (t.detach() for t in _qkv(2))
    kwargs = {"window": 24} if option == "window" else {"sinks": torch.zeros(4)}
    expected = core_attention(q, k, v, mask, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("by_documents was called")

    monkeypatch.setattr(attention, "by_documents", refuse)
    torch.testing.assert_close(core_attention(q, k, v, mask, **kwargs), expected)
    # Zero sinks and a window over the longest document change nothing: the same as by documents.
    if option == "sinks":
        return
    wide = core_attention(q, k, v, mask, window=256)
    monkeypatch.undo()
    torch.testing.assert_close(wide, core_attention(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_compiled_attention_keeps_the_dense_mask_and_one_graph(monkeypatch):
    """Under torch.compile the lengths are not read: batches with other boundaries reuse the graph."""
    from torch._dynamo.testing import CompileCounter

    import titanlike.models.common.attention as attention

    counter = CompileCounter()
    compiled = torch.compile(core_attention, backend=counter, dynamic=False)
    q, k, v = (t.detach() for t in _qkv(2))
    masks = [DocumentMask.from_document_ids(_ids(rows), "sdpa")
             for rows in (ROW_LENGTHS, ([128, 128], [256], [1, 255], [200, 56]))]
    expected = [core_attention(q, k, v, m) for m in masks]
    monkeypatch.setattr(attention, "by_documents", None)  # tracing it would fail
    torch._dynamo.reset()
    try:
        for m, e in zip(masks, expected):
            torch.testing.assert_close(compiled(q, k, v, m), e, atol=1e-5, rtol=1e-5)
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1


@pytest.mark.parametrize("mode,option", [("full", "1"), ("selective", "op")])
def test_activation_checkpointing_recomputes_by_documents(monkeypatch, mode, option):
    """The recompute goes by documents too: the same gradients as without checkpointing, and each
    block's per-document calls made again (op-level AC then reads the saved outputs of the CPU
    flash kernel, titanlike/parallel/activation_checkpoint.py's _SAVE_OPS)."""
    import copy

    from titanlike.parallel.activation_checkpoint import apply_activation_checkpointing

    torch.manual_seed(0)
    tokens = torch.randint(2, 64, (2, 256))
    mask = DocumentMask.from_document_ids(_ids(([100, 60, 96], [30, 226])), "sdpa")
    model = sharp_llama(256, vocab=64)
    wrapped = copy.deepcopy(model)
    apply_activation_checkpointing(wrapped, mode, option)
    grads = []
    for m in (model, wrapped):
        calls = _count_sdpa(monkeypatch)
        m(tokens, positions=mask.positions, mask=mask).float().square().mean().backward()
        grads.append([p.grad for p in m.parameters()])
        monkeypatch.undo()
        assert all(c is None for c in calls) and len(calls) == 5 * 2 * (2 if m is wrapped else 1)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
