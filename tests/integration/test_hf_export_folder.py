"""An exported Hugging Face folder is complete: for the llama3, qwen3 and gpt2 debug models,
convert_dcp_to_hf.py writes the weights, a config.json that transformers loads without a
warning, and the training tokenizer, so that AutoTokenizer + AutoModelForCausalLM on the folder
encode a prompt as we do, give our logits, and continue it greedily as our model does.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch

from conftest import REPO, hf_warnings
from family_checks import materialize
from titanlike.checkpoint.format import model_description
from titanlike.checkpoint.hf import write_dcp_model
from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
from titanlike.data.hf_tokenizer import TOKENIZER_COPY, TOKENIZER_NOTE, tokenizer_record
from titanlike.models.registry import get_model_spec

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(REPO / "scripts"))
import convert_dcp_to_hf  # noqa: E402

ATOL = 1e-5
PROMPT = "And God said, Let there be light: and there was light. <|eot_id|> ünïcödé"
NEW_TOKENS = 4


def trained_checkpoint(tmp_path, name: str, tokenizer):
    """Our debug model (our init) as the trainer's model-only checkpoint: sidecar and all. Two
    layers keep it fast; everything config.json says about the flavor stays (context, RoPE)."""
    spec = get_model_spec(name)
    flavor = dataclasses.replace(spec.flavors["debugmodel"], n_layers=2)
    args = flavor.update_from_config(vocab_size=tokenizer.vocab_size, seq_len=64)
    model = materialize(spec.model_cls, args, seed=7)
    write_dcp_model(model.state_dict(), str(tmp_path / "dcp"), {
        "contents": "model_only", "step": 1, "tokenizer": tokenizer_record(tokenizer),
        "model": model_description(spec.name, args, context_len=flavor.context_len),
    })
    return model.eval()


def greedy(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


@pytest.mark.parametrize("name", ["llama3", "qwen3", "gpt2"])
def test_exported_folder_loads_in_transformers_as_one(tmp_path, capsys, name):
    tokenizer = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    model = trained_checkpoint(tmp_path, name, tokenizer)
    out = tmp_path / "hf"
    assert convert_dcp_to_hf.main([str(tmp_path / "dcp"), str(out)]) == 0
    assert "tokenizer: tokenizer.json and tokenizer_config.json" in capsys.readouterr().out
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(out))

    with hf_warnings() as warned:
        config = transformers.AutoConfig.from_pretrained(out)
        hf_tok = transformers.AutoTokenizer.from_pretrained(out)
        hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert warned == []
    assert (config.bos_token_id, config.eos_token_id) == (tokenizer.bos_id, tokenizer.eos_id)

    batch = hf_tok(PROMPT, return_tensors="pt")
    ids = torch.tensor([tokenizer.encode(PROMPT, bos=True, eos=False, allowed_special="all")])
    assert torch.equal(batch["input_ids"], ids)
    with torch.no_grad(), hf_warnings() as warned:
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=0, atol=ATOL)
        got = hf.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
        want = greedy(model, ids, NEW_TOKENS)
    assert warned == []
    assert torch.equal(got, want)
    assert hf_tok.decode(got[0, ids.shape[1]:]) == tokenizer.decode(want[0, ids.shape[1]:].tolist())


def test_tokenizer_that_cannot_be_converted_does_not_fail_the_export(tmp_path, capsys):
    """--tokenizer names a file that is not tiktoken ranks: the weights and config are exported
    (as in the test above), the file is copied with a note, and the script warns but succeeds."""
    tokenizer = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    trained_checkpoint(tmp_path, "gpt2", tokenizer)
    other = tmp_path / "tokenizer.spm"
    other.write_bytes(b"\x0a\x05other")
    out = tmp_path / "hf"
    assert convert_dcp_to_hf.main([str(tmp_path / "dcp"), str(out), "--tokenizer", str(other)]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and TOKENIZER_COPY in err and TOKENIZER_NOTE in err
    assert (out / TOKENIZER_COPY).read_bytes() == other.read_bytes() and (out / TOKENIZER_NOTE).is_file()
    assert not (out / "tokenizer.json").exists()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == tokenizer.eos_id
    assert (out / "model.safetensors.index.json").is_file()
