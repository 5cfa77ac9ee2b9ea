"""HFKeyMap: the plain key renames the Hugging Face adapters share (models/common/hf_keys.py)."""

from __future__ import annotations

import pytest

from titanlike.models.common.hf_keys import HFKeyMap

KEYS = HFKeyMap(
    top={"tok_embeddings.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"},
    layer={"attention.wq.weight": "self_attn.q_proj.weight", "ffn_norm.weight": "post_attention_layernorm.weight"},
    hf_layers="model.layers.",
)


@pytest.mark.parametrize("ours, hf", [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("output.weight", "lm_head.weight"),
    ("layers.0.attention.wq.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("layers.12.ffn_norm.weight", "model.layers.12.post_attention_layernorm.weight"),
])
def test_renames_both_ways(ours, hf):
    assert KEYS.to_hf(ours) == hf
    assert KEYS.from_hf(hf) == ours


@pytest.mark.parametrize("ours", [
    "norm.weight",  # not in the top-level table
    "layers.0.attention.wk.weight",  # not in the per-layer table
    "layers.x.attention.wq.weight",  # no layer index
    "model.layers.0.self_attn.q_proj.weight",  # HF's name is not ours
    "layers.0.attention.wq.weight.extra",
])
def test_unknown_keys_are_none(ours):
    assert KEYS.to_hf(ours) is None


def test_hf_names_that_are_not_ours_are_none():
    assert KEYS.from_hf("layers.0.self_attn.q_proj.weight") is None  # our prefix, HF's name
    assert KEYS.from_hf("model.layers.0.mlp.experts.3.gate_proj.weight") is None
    assert KEYS.from_hf("tok_embeddings.weight") is None


def test_split_and_layer_name():
    assert KEYS.split("layers.3.feed_forward.w1.weight") == ("3", "feed_forward.w1.weight")
    assert KEYS.split_hf("model.layers.3.mlp.experts.0.up_proj.weight") == ("3", "mlp.experts.0.up_proj.weight")
    assert KEYS.split("tok_embeddings.weight") is None
    assert KEYS.layer_name("layers.7.attention.wq.weight") == "attention.wq.weight"
    assert KEYS.layer_name("output.weight") is None


def test_prefixes_are_literal():
    # A dot in a prefix must not match any character.
    keys = HFKeyMap(top={}, layer={"w": "w"}, hf_layers="a.b.")
    assert keys.from_hf("a.b.0.w") == "layers.0.w"
    assert keys.from_hf("aXb.0.w") is None
    assert HFKeyMap(top={}, layer={"w": "v"}, hf_layers="h.", our_layers="blocks.").to_hf("blocks.2.w") == "h.2.v"


def test_tables_must_be_one_to_one():
    with pytest.raises(ValueError, match="one-to-one"):
        HFKeyMap(top={"a": "x", "b": "x"}, layer={}, hf_layers="h.")
    with pytest.raises(ValueError, match="one-to-one"):
        HFKeyMap(top={}, layer={"a": "x", "b": "x"}, hf_layers="h.")


def test_tie_output():
    table = object()
    sd = {"tok_embeddings.weight": table}
    KEYS.tie_output(sd, tied=True)
    assert sd["output.weight"] is table
    with pytest.raises(KeyError, match="tied model without model.embed_tokens.weight"):
        KEYS.tie_output({}, tied=True)
    with pytest.raises(KeyError, match="untied model without lm_head.weight"):
        KEYS.tie_output({"tok_embeddings.weight": table}, tied=False)
    head = object()
    sd = {"tok_embeddings.weight": table, "output.weight": head}
    KEYS.tie_output(sd, tied=False)
    assert sd["output.weight"] is head


def test_export_decoder_renames_skips_and_converts():
    keys = HFKeyMap(top={"tok_embeddings.weight": "embed.weight", "output.weight": "lm_head.weight"},
                    layer={"w.weight": "proj.weight"}, hf_layers="model.layers.")
    sd = {"_orig_mod.tok_embeddings.weight": 1, "layers.0.w.weight": 2, "output.weight": 3, "rope_cache": 4}
    doubled = keys.export_decoder(sd, tied=False, convert=lambda key, value: (key, 2 * value))
    assert doubled == {"embed.weight": ("tok_embeddings.weight", 2),
                       "model.layers.0.proj.weight": ("layers.0.w.weight", 4),
                       "lm_head.weight": ("output.weight", 6)}
    assert "lm_head.weight" not in keys.export_decoder(sd, tied=True, convert=lambda key, value: value)
    with pytest.raises(KeyError, match="no Hugging Face name for parameter 'layers.0.extra'"):
        keys.export_decoder({"layers.0.extra": 0}, tied=False, convert=lambda key, value: value)
