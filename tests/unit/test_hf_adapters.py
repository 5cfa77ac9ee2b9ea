"""Every family's Hugging Face adapter (ModelSpec.hf, models/common/hf.py) keeps the contract the
checkpoint code relies on: the model_type it writes is one it reads, and config.json read back
gives the args again. Each family's weights are checked against transformers in its own tests."""

from __future__ import annotations

import pytest

from titanlike.models.common.hf import HFAdapter
from titanlike.models.registry import get_model_spec, model_names, spec_for_hf_model_type

FLAVORS = [(name, flavor) for name in model_names() if get_model_spec(name).hf is not None
           for flavor in get_model_spec(name).flavors]
# Flavors no transformers class computes: BERT 3.9B's pre-norm blocks, the hybrid's SwiGLU experts.
NO_HF_CLASS = {("bert", "3.9B"), ("hybrid", "debugmodel_moe")}


@pytest.mark.parametrize("name, flavor", FLAVORS)
def test_each_flavor_writes_a_model_type_its_family_reads(name, flavor):
    spec = get_model_spec(name)
    args = spec.flavors[flavor]
    assert isinstance(spec.hf, HFAdapter)
    if (name, flavor) in NO_HF_CLASS:
        with pytest.raises(ValueError):
            spec.hf.args_to_config(args)
        return
    config = spec.hf.args_to_config(args)
    assert config["model_type"] == spec.hf.model_type(args) in spec.hf.model_types
    assert spec_for_hf_model_type(config["model_type"]) is spec
    # Back from config.json: the same args up to the context, which a config may state otherwise.
    back = spec.hf.config_to_args(config)
    assert back.with_context_len(args.context_len) == args
    assert spec.hf.args_to_config(back) == config


@pytest.mark.parametrize("name, ids", [
    ("llama3", {"bos_token_id": 1, "eos_token_id": 2}),
    ("gpt2", {"bos_token_id": 1, "eos_token_id": 2}),
    # Padded samples: transformers batches with the pad id; T5's decoder also starts from it.
    ("bert", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}),
    ("t5", {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "decoder_start_token_id": 0}),
])
def test_token_ids_of_config_json(name, ids):
    hf = get_model_spec(name).hf
    assert hf.token_ids(bos=1, eos=2, pad=0) == ids
    assert list(hf.token_ids(bos=None, eos=5, pad=None)) == ["eos_token_id"]
