"""The Qwen3-Next family (models/qwen3_next): the layer pattern, the Gated DeltaNet mixer on packed
documents, the decoding state's size, and the family's rules. Logits against transformers are in
tests/integration/test_qwen3_next_hf.py, greedy generation against transformers in
tests/conformance/test_generation.py, the layouts in tests/layouts/test_family_layouts.py, and the
delta rule itself in tests/unit/test_gated_delta.py."""

from __future__ import annotations

import pytest
import torch

from titanlike.config import ConfigError, load_job_config
from titanlike.models.common.attention import DocumentMask
from titanlike.models.qwen3_next import Qwen3Next, qwen3_next_flavors
from titanlike.models.qwen3_next.model import GatedAttention, GatedDeltaNet, GatedSharedExpert
from titanlike.parallel.parallel_dims import ParallelDims
from titanlike.train.plan import plan_job

TINY = qwen3_next_flavors["debugmodel_tiny"]


def dims(tp=1, cp=1) -> ParallelDims:
    return ParallelDims.resolve(world_size=tp * cp, dp_replicate=1, dp_shard=-1, cp=cp, tp=tp)


def model(args=TINY, seed=0):
    m = Qwen3Next(args)
    m.init_weights(seed=seed)
    return m.eval()


def test_the_published_pattern_every_fourth_layer_full_attention():
    args = qwen3_next_flavors["80B-A3B"]
    assert [i for i in range(args.n_layers) if args.is_full_attention(i)] == list(range(3, 48, 4))
    assert args.rotary_dim == 64
    with torch.device("meta"):
        m = Qwen3Next(TINY)  # interval 2, a dense first layer
    kinds = [(type(getattr(b, b.mixer_name)).__name__, b.mlp_name) for b in m.layers.values()]
    assert kinds == [("GatedDeltaNet", "feed_forward"), ("GatedAttention", "moe"), ("GatedDeltaNet", "moe"),
                     ("GatedAttention", "moe")]
    assert isinstance(m.layers["1"].moe.shared_experts, GatedSharedExpert)
    assert isinstance(m.layers["1"].attention, GatedAttention) and isinstance(m.layers["0"].linear_attention,
                                                                              GatedDeltaNet)


def test_packed_documents_are_computed_as_if_apart():
    # The conv and the delta rule restart where a document starts, attention is masked: each document of a
    # packed row gets the logits it gets alone (positions restart too).
    m = model()
    g = torch.Generator().manual_seed(0)
    first, second = (torch.randint(3, TINY.vocab_size, (1, n), generator=g) for n in (23, 17))
    ids = torch.cat([torch.zeros(1, 23, dtype=torch.long), torch.ones(1, 17, dtype=torch.long)], dim=1)
    mask = DocumentMask.from_document_ids(ids, "sdpa")
    with torch.no_grad():
        packed = m(torch.cat([first, second], dim=1), positions=mask.positions, mask=mask)
        apart = torch.cat([m(first), m(second)], dim=1)
    torch.testing.assert_close(packed, apart, rtol=0, atol=2e-5)


def test_the_decoding_state_of_a_delta_layer_does_not_grow_with_the_sequence():
    """The delta layers' state (conv inputs and the k_dim x v_dim matrix per value head) is the same after a
    prompt of 8 tokens and after one of 64 plus 16 decode steps; attention's keys and values fill slots."""
    m = model()
    sizes = {}
    for prompt in (8, 64):
        cache = m.init_cache(2, 96, device="cpu", dtype=torch.float32)
        tokens = torch.randint(3, TINY.vocab_size, (2, prompt))
        m.prefill(tokens, torch.tensor([prompt, prompt - 3]), cache)
        for _ in range(16 if prompt == 64 else 0):
            m.decode_step(torch.randint(3, TINY.vocab_size, (2,)), cache)
        delta = {k: e for k, e in cache.layers.items() if not m.layers[k].full_attention}
        sizes[prompt] = sum(t.numel() * t.element_size() for e in delta.values() for t in (e.conv, e.ssm))
    per_layer_row = (TINY.linear_v_heads * TINY.linear_k_dim * TINY.linear_v_dim * 4
                     + (TINY.conv_kernel - 1) * TINY.conv_dim * 4)
    assert sizes[8] == sizes[64] == 2 * 2 * per_layer_row  # two delta layers, two rows


def test_context_parallelism_is_refused_in_one_sentence_before_any_process_group():
    with pytest.raises(ValueError, match="context_parallel_degree 2 is not supported by Gated DeltaNet layers"):
        TINY.validate(dims(cp=2), seq_len=64)
    cfg = load_job_config(["--model.name", "qwen3_next", "--model.flavor", "debugmodel_tiny",
                           "--parallelism.context_parallel_degree", "2", "--training.seq_len", "64"])
    with pytest.raises(ConfigError) as err:
        plan_job(cfg, world_size=2)
    assert "is not supported by Gated DeltaNet layers" in str(err.value) and "\n" not in str(err.value)


def test_tensor_parallelism_must_split_whole_key_heads():
    args = qwen3_next_flavors["debugmodel"]  # 4 key heads, 8 attention heads, 2 key/value heads
    args.validate(dims(tp=2), seq_len=64)
    with pytest.raises(ValueError, match="2 key/value heads are not divisible by tensor_parallel_degree 4"):
        args.validate(dims(tp=4), seq_len=64)


def test_flops_grow_with_the_sequence_only_through_full_attention():
    args = qwen3_next_flavors["80B-A3B"]
    assert args.flops_per_token(8192) - args.flops_per_token(4096) == 12 * 12 * 16 * 256 * 4096


def test_debug_flavors_count_what_they_build():
    for name in ("debugmodel", "debugmodel_moe", "debugmodel_tiny"):
        args = qwen3_next_flavors[name]
        with torch.device("meta"):
            assert sum(p.numel() for p in Qwen3Next(args).parameters()) == args.num_params(), name
