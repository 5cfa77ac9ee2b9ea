"""GPT-2 Hugging Face interchange, checked against transformers' own GPT2LMHeadModel (offline,
random init from a GPT2Config), in fp32 with a tight tolerance, in both directions, through the
family's adapter and through the generic checkpoint code (import/export, load_model, train.py).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

import titanlike
from conftest import TINY_JOB, hf_warnings, read_metrics, train_here
from family_checks import first_batch_and_hf_loss, materialize, probe_tokens
from titanlike.checkpoint.format import CheckpointError
from titanlike.checkpoint.hf import export_dcp_to_hf, import_hf_to_dcp
from titanlike.models.gpt2 import GPT2, GPT2Args, gpt2_flavors
from titanlike.models.registry import get_model_spec

HF = get_model_spec("gpt2").hf
ATOL = 1e-5


def tiny_args(tied=True, gelu="tanh") -> GPT2Args:
    return dataclasses.replace(gpt2_flavors["debugmodel"], dim=64, n_layers=2, n_heads=4, vocab_size=300,
                               max_seq_len=48, tie_word_embeddings=tied, gelu_approximate=gelu)


def hf_model(args, seed=0) -> GPT2LMHeadModel:
    """A random GPT2LMHeadModel whose norms and biases are not at their init (1 and 0), so a
    mis-mapped bias or LayerNorm shows in the logits."""
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(GPT2Config(**HF.args_to_config(args))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" in name or name.endswith(".bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def ours(args, seed=3) -> GPT2:
    return materialize(GPT2, args, seed=seed).eval()



# gelu "none": the exact GELU (HF's "gelu", Megatron-LM's default) of a GPT trained without --openai-gelu.
@pytest.mark.parametrize("tied, gelu", [(True, "tanh"), (False, "tanh"), (True, "none")])
def test_adapter_both_ways(tied, gelu):
    args = tiny_args(tied, gelu)
    hf = hf_model(args)
    t = probe_tokens(args.vocab_size)
    positions = torch.stack([torch.arange(40), torch.arange(40) % 13])  # restarting per "document"

    # HF -> ours.
    assert HF.config_to_args(hf.config.to_dict()) == args
    model = ours(args)
    model.load_state_dict(HF.from_hf_state_dict(hf.state_dict(), args), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(t), hf(t).logits, rtol=0, atol=ATOL)
        torch.testing.assert_close(model(t, positions=positions), hf(t, position_ids=positions).logits,
                                   rtol=0, atol=ATOL)

    # Ours (our own init) -> HF.
    mine = ours(args, seed=5)
    back = GPT2LMHeadModel(GPT2Config(**HF.args_to_config(mine.model_args))).eval()
    missing, unexpected = back.load_state_dict(HF.to_hf_state_dict(mine.state_dict(), args), strict=False)
    assert unexpected == [] and missing == (["lm_head.weight"] if tied else [])
    assert (back.lm_head.weight is back.transformer.wte.weight) is tied
    with torch.no_grad():
        torch.testing.assert_close(back(t).logits, mine(t), rtol=0, atol=ATOL)


def test_original_gpt2_key_spelling_and_mask_buffers():
    # openai-community/gpt2's files are GPT2Model's keys (no "transformer." prefix) and older
    # transformers saved the causal mask as attn.bias / attn.masked_bias.
    args = tiny_args()
    hf = hf_model(args)
    sd = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    for i in range(args.n_layers):
        sd[f"h.{i}.attn.bias"] = torch.ones(1, 1, 48, 48).tril()
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    model = ours(args)
    model.load_state_dict(HF.from_hf_state_dict(sd, args), strict=True)
    t = probe_tokens(args.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(t), hf(t).logits, rtol=0, atol=ATOL)


@pytest.mark.parametrize("key, value", [
    ("scale_attn_by_inverse_layer_idx", True),
    ("reorder_and_upcast_attn", True),
    ("scale_attn_weights", False),
    ("activation_function", "relu"),
    ("n_inner", 100),
])
def test_unsupported_configs_are_refused_by_name(key, value):
    config = {**HF.args_to_config(tiny_args()), key: value}
    with pytest.raises(ValueError, match=key):
        HF.config_to_args(config)
    # gelu_pytorch_tanh is the same function as gelu_new.
    assert HF.config_to_args({**config, key: HF.args_to_config(tiny_args())[key]}) == tiny_args()
    assert HF.config_to_args({**config, "activation_function": "gelu_pytorch_tanh", key:
                              HF.args_to_config(tiny_args())[key]}) == tiny_args()


def test_checkpoint_round_trip_and_load_model(tmp_path):
    args = tiny_args()
    hf = hf_model(args)
    hf.save_pretrained(tmp_path / "hf")
    t = probe_tokens(args.vocab_size)
    with torch.no_grad():
        want = hf(t).logits

    # HF folder -> model directly, and HF -> DCP -> model.
    with torch.no_grad():
        torch.testing.assert_close(titanlike.load_model(tmp_path / "hf")(t), want, rtol=0, atol=ATOL)
    import_hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"))
    sidecar = json.loads((tmp_path / "dcp" / "titanlike.json").read_text())
    assert sidecar["model"]["name"] == "gpt2" and sidecar["model"]["args"]["max_seq_len"] == 48
    with torch.no_grad():
        torch.testing.assert_close(titanlike.load_model(tmp_path / "dcp")(t), want, rtol=0, atol=ATOL)

    # DCP -> HF (several shards) -> transformers.
    export_dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "out"), max_shard_bytes=60_000)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["n_positions"], config["activation_function"]) == ("gpt2", 48, "gelu_new")
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 2
    back = GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(t).logits, want, rtol=0, atol=ATOL)

    # An unsupported config fails as a checkpoint error naming the key.
    bad = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**bad, "reorder_and_upcast_attn": True}))
    with pytest.raises(CheckpointError, match="reorder_and_upcast_attn"):
        titanlike.load_model(tmp_path / "hf")


def test_train_from_hf_and_export_to_hf(tmp_path):
    """train.py (one process) starts from an HF folder of the debug flavor: its first loss is
    transformers' loss on the same batch; its final HF export loads in transformers."""
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer

    tokenizer = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    args = gpt2_flavors["debugmodel"].update_from_config(vocab_size=tokenizer.vocab_size, seq_len=64)
    hf = hf_model(args, seed=4)
    hf.save_pretrained(tmp_path / "hf")
    inputs, hf_loss = first_batch_and_hf_loss(hf, tokenizer)

    dump = tmp_path / "run"
    proc = train_here([*TINY_JOB, "--model.name", "gpt2", "--model.flavor", "debugmodel", "--job.dump_folder",
                       str(dump), "--training.steps", "2", "--training.local_batch_size", "8",
                       "--checkpoint.enable", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
                       "--checkpoint.initial_load_in_hf", "--checkpoint.last_save_in_hf"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = read_metrics(dump)[0]
    assert first["loss"] == pytest.approx(hf_loss, rel=1e-5)
    export = dump / "checkpoint" / "step-2"
    config = json.loads((export / "config.json").read_text())
    assert config["n_positions"] == 1024 and config["eos_token_id"] == tokenizer.eos_id
    # The job's tokenizer is part of the export, and the log says so.
    assert "checkpoint: tokenizer.json and tokenizer_config.json from" in proc.stderr
    with hf_warnings() as warned:
        hf_tok = AutoTokenizer.from_pretrained(export)
        trained = GPT2LMHeadModel.from_pretrained(export).eval()
    assert warned == []
    text = "And the evening and the morning were the first day."
    # GPT-2's convention: its tokenizer adds no special token (issue 32 item 4).
    assert hf_tok(text)["input_ids"] == tokenizer.encode(text, bos=False, eos=False)
    with torch.no_grad():
        got = trained(inputs).logits
        torch.testing.assert_close(got, titanlike.load_model(export)(inputs), rtol=0, atol=ATOL)
        assert (got - hf(inputs).logits).abs().max() > 1e-3
