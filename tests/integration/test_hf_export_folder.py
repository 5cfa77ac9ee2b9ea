"""An exported Hugging Face folder is complete: for the llama3, qwen3 and gpt2 debug models,
convert_dcp_to_hf.py writes the weights, a config.json that transformers loads without a
warning, and the training tokenizer, so that AutoTokenizer + AutoModelForCausalLM on the folder
encode a prompt as the family's tokenizers do, give our logits, and continue it greedily as our
model does. For all 8 families, the folder loads with no warning at all and runs the family's task.
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
    ids = torch.tensor([convention_ids(name, tokenizer, PROMPT)])
    assert torch.equal(batch["input_ids"], ids)
    with torch.no_grad(), hf_warnings() as warned:
        torch.testing.assert_close(hf(ids).logits, model(ids), rtol=0, atol=ATOL)
        got = hf.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
        want = greedy(model, ids, NEW_TOKENS)
    assert warned == []
    assert torch.equal(got, want)
    assert hf_tok.decode(got[0, ids.shape[1]:]) == tokenizer.decode(want[0, ids.shape[1]:].tolist())


def convention_ids(name: str, tokenizer, text: str) -> list[int]:
    """The ids the family's own Hugging Face tokenizers give `text` (issue 32 item 4): Llama-style
    decoders start with BOS, GPT-2 adds nothing, BERT wraps it in [CLS] ... [SEP], T5 ends it with
    EOS. Our special tokens take those roles (titanlike/data/special_tokens.py)."""
    from titanlike.data.special_tokens import special_token_ids

    ids = tokenizer.encode(text, bos=False, eos=False, allowed_special="all")
    if name == "gpt2":
        return ids
    if name == "bert":
        roles = special_token_ids(tokenizer, ["cls", "sep"])
        return [roles["cls"], *ids, roles["sep"]]
    if name == "t5":
        return [*ids, tokenizer.eos_id]
    return [tokenizer.bos_id, *ids]


def small_args(name: str):
    """The family's debug flavor, two layers (or blocks) deep where it has a layer count."""
    args = get_model_spec(name.removesuffix("_v1_1")).flavors["debugmodel"]
    names = {f.name for f in dataclasses.fields(args)}
    small = {k: 2 for k in ("n_layers", "n_encoder_layers", "n_decoder_layers") if k in names}
    if name == "deepseek_v3":
        small["mtp_num_layers"] = 1  # exported after the trunk: transformers must not list it as unexpected
    if name == "t5":  # the original T5: tied, scaled output
        small.update(tie_word_embeddings=True, scale_decoder_outputs=True)
    return dataclasses.replace(args, **small)


def export(tmp_path, name: str, tokenizer):
    """Our model of `name`'s small args, as the trainer's model-only checkpoint, through convert_dcp_to_hf."""
    spec = get_model_spec(name.removesuffix("_v1_1"))
    args = small_args(name).update_from_config(vocab_size=tokenizer.vocab_size, seq_len=64)
    model = materialize(spec.model_cls, args, seed=7)
    write_dcp_model(model.state_dict(), str(tmp_path / "dcp"), {
        "contents": "model_only", "step": 1, "tokenizer": tokenizer_record(tokenizer),
        "model": model_description(spec.name, args, context_len=small_args(name).context_len)})
    out = tmp_path / "hf"
    assert convert_dcp_to_hf.main([str(tmp_path / "dcp"), str(out)]) == 0
    return out


def kernel_notes(messages: list[str]) -> list[str]:
    """Messages other than transformers' notes that an optional CUDA kernel package is not installed
    (Mamba-2's causal_conv1d / mamba_ssm on this CPU machine): about the machine, not the folder."""
    return [m for m in messages if "is not installed" not in m and "fast path" not in m]


@pytest.mark.parametrize("name", ["llama3", "qwen3", "mixtral", "deepseek_v3", "gpt2", "hybrid", "bert", "t5"])
def test_every_family_exports_a_folder_transformers_loads_without_a_warning(tmp_path, name):
    """Model, config and tokenizer load with no warning, the tokenizer follows the family's
    convention, and the family's task runs on the folder: text-generation for decoders, fill-mask
    for BERT, and for T5 the generation transformers' text2text-generation pipeline ran before
    transformers 5 removed it (tokenize, generate, decode)."""
    tokenizer = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    out = export(tmp_path, name, tokenizer)

    auto = {"bert": transformers.AutoModelForPreTraining, "t5": transformers.AutoModelForSeq2SeqLM}.get(
        name, transformers.AutoModelForCausalLM)
    with hf_warnings() as warned:
        transformers.AutoConfig.from_pretrained(out)
        hf_tok = transformers.AutoTokenizer.from_pretrained(out)
        hf = auto.from_pretrained(out).eval()
    assert warned == []
    assert hf_tok(PROMPT)["input_ids"] == convention_ids(name, tokenizer, PROMPT)

    with hf_warnings() as warned:
        if name == "bert":
            # The pipeline loads the folder into BertForMaskedLM, which has no pooler nor sentence
            # head: its load report names those weights, as for google-bert/bert-base-uncased.
            fill = transformers.pipeline("fill-mask", model=str(out), top_k=3)
            found = fill(f"And God said, Let there be {hf_tok.mask_token}: and there was light.")
            assert len(found) == 3 and all(f["token_str"] for f in found)
            warned.clear()
        elif name == "t5":
            batch = hf_tok(["translate: And God said, Let there be light."], return_tensors="pt")
            ids = hf.generate(**batch, max_new_tokens=NEW_TOKENS, do_sample=False)
            assert ids[0, 0] == hf.config.decoder_start_token_id and 1 < ids.shape[1] <= NEW_TOKENS + 1
            assert isinstance(hf_tok.decode(ids[0], skip_special_tokens=True), str)
        else:
            generate = transformers.pipeline("text-generation", model=str(out))
            text = generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)[0]["generated_text"]
            assert text.startswith(PROMPT) and len(text) > len(PROMPT)
    assert kernel_notes(warned) == []


def test_an_untied_t5_export_warns_only_as_transformers_warns_for_every_untied_t5(tmp_path):
    """transformers 5 forces T5Config.tie_word_embeddings to true (its T5 always ties), so loading any
    T5 v1.1 folder whose lm_head differs from its embeddings (Google's t5-v1_1 and flan-t5 too) logs
    that it keeps them apart. Ours says tie_word_embeddings false and loads as it was trained: that
    message is the only one, and lm_head stays its own."""
    tokenizer = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    out = export(tmp_path, "t5_v1_1", tokenizer)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    with hf_warnings() as warned:
        hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(out)
    assert len(warned) == 1 and "we will NOT tie them" in warned[0]
    assert hf.lm_head.weight is not hf.shared.weight


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
