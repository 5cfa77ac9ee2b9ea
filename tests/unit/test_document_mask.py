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

