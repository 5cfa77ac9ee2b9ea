"""Hugging Face interchange, checked against transformers' own LlamaForCausalLM (offline,
random init from a LlamaConfig), in fp32 with a tight tolerance, in both directions:

* HF folder -> convert_hf_to_dcp.py -> titanlike.load_model: same logits as transformers;
* titanlike DCP -> convert_dcp_to_hf.py -> from_pretrained: same logits as load_model;
* train.py on 2 ranks fine-tunes from an HF folder (initial_load_in_hf): its first loss is
  transformers' loss on the same batch, and its last_save_in_hf export loads in transformers.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import titanlike
from conftest import REPO, hf_warnings, read_metrics
from family_checks import (
    check_hf_export,
    check_hf_import,
    first_batch_and_hf_loss,
    materialize,
    probe_tokens,
    write_model_only_dcp,
)
from titanlike.models.llama3 import llama3_flavors
from titanlike.models.registry import get_model_spec

sys.path.insert(0, str(REPO / "scripts"))
import convert_dcp_to_hf  # noqa: E402
import convert_hf_to_dcp  # noqa: E402

HF = get_model_spec("llama3").hf
ATOL = 1e-5


def tiny_args(tied: bool):
    return dataclasses.replace(llama3_flavors["debugmodel_tiny"], n_layers=2, vocab_size=300,
                               max_seq_len=64, tie_word_embeddings=tied)


def hf_model(args, seed=0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**HF.args_to_config(args))).eval()



@pytest.mark.parametrize("tied", [False, True])
def test_hf_to_titanlike_and_back(tmp_path, tied):
    args = tiny_args(tied)
    hf = hf_model(args)
    t = probe_tokens(args.vocab_size)
    # HF -> DCP -> our model, and load_model reading the HF folder directly.
    want = check_hf_import(hf, tmp_path / "hf", tmp_path / "dcp", "llama3", t, ATOL)

    # DCP -> HF (forced into several shards) -> transformers.
    out = tmp_path / "out"
    check_hf_export(tmp_path / "dcp", out, LlamaForCausalLM, t, want, ATOL, ("--max-shard-size", "60KB"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    assert ("lm_head.weight" in index["weight_map"]) is not tied
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == hf.config.eos_token_id


def test_titanlike_weights_give_the_same_logits_in_transformers(tmp_path):
    """The other direction with weights of our own init (not HF's), via a model-only DCP."""
    from titanlike.models.llama3 import Transformer

    args = tiny_args(False)
    model = materialize(Transformer, args, seed=3).eval()
    write_model_only_dcp(model, "llama3", args, tmp_path / "dcp")
    t = probe_tokens(args.vocab_size)
    with torch.no_grad():
        want = model(t)
    check_hf_export(tmp_path / "dcp", tmp_path / "hf", LlamaForCausalLM, t, want, ATOL)


def test_convert_reports_a_folder_that_is_not_a_checkpoint(tmp_path, capsys):
    assert convert_dcp_to_hf.main([str(tmp_path), str(tmp_path / "out")]) == 1
    assert "neither a DCP checkpoint" in capsys.readouterr().err
    assert convert_hf_to_dcp.main([str(tmp_path), str(tmp_path / "out")]) == 1
    assert "config.json is missing" in capsys.readouterr().err


@pytest.mark.distributed
def _debugmodel_hf(seed: int = 4):
    """A random transformers Llama of the debug flavor (the debug tokenizer's vocabulary) and that tokenizer."""
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer

    tokenizer = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    args = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=tokenizer.vocab_size, max_seq_len=64)
    return hf_model(args, seed=seed), tokenizer


def write_debugmodel_hf(root):
    """_debugmodel_hf's model saved in the pool's scratch folder when the 2-rank launch starts (the test
    builds the same model again from the seed to know the first loss)."""
    folder = root / "hf_interchange_debugmodel"
    _debugmodel_hf()[0].save_pretrained(folder)
    return folder


# A pooled 2-rank job (conftest.TrainJobPool): its HF folder is written when its launch starts.
@pytest.mark.train_run("--training.steps", "2", "--checkpoint.enable", "--checkpoint.initial_load_path",
                       write_debugmodel_hf, "--checkpoint.initial_load_in_hf", "--checkpoint.last_save_in_hf",
                       "--training.local_batch_size", "2", "--training.global_batch_size", "8", nproc=2)
def test_train_from_hf_and_export_to_hf(train_run):
    """On 2 ranks (FSDP2): rank 0 reads the HF weights and broadcasts them into the shards;
    at the end every rank writes its shards and rank 0 converts them to HF."""
    hf, tokenizer = _debugmodel_hf()
    inputs, hf_loss = first_batch_and_hf_loss(hf, tokenizer)

    dump = train_run.folder
    first = read_metrics(dump)[0]
    assert first["step"] == 1
    assert first["loss"] == pytest.approx(hf_loss, rel=1e-5)

    export = dump / "checkpoint" / "step-2"
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json"} <= set(os.listdir(export))
    assert not (export / "dcp").exists()
    config = json.loads((export / "config.json").read_text())
    assert config["eos_token_id"] == tokenizer.eos_id and config["vocab_size"] == tokenizer.vocab_size
    # The debug flavor's context (2048) is within its RoPE scaling's original one (8192): only
    # with the scaled context in config.json does transformers load it without a warning.
    with hf_warnings() as warned:
        trained = LlamaForCausalLM.from_pretrained(export).eval()
    assert warned == []
    ours = titanlike.load_model(export)
    with torch.no_grad():
        got, want = trained(inputs).logits, ours(inputs)
        torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
        # Two training steps moved the weights away from the HF initialization.
        assert (got - hf(inputs).logits).abs().max() > 1e-3
