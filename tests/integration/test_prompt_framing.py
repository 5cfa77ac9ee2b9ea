"""A text prompt gives the tokens transformers' tokenizer gives on the model's export (issue 45.20):
Llama BOS first, GPT-2 nothing, T5 EOS last, read from the exported tokenizer folder (its
tokenizer.json's post-processor) or, for a ranks file, from the family
(inference/processor.py prompt_framing). lm-eval's word perplexity on a GPT-2 checkpoint equals
lm-eval's `hf` model on its export."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from family_checks import materialize

transformers = pytest.importorskip("transformers")

TIKTOKEN = "titanlike/data/assets/debug_tokenizer.tiktoken"
TEXT = "In the beginning God created the heaven and the earth."


def _export(root, family: str, flavor: str, **changes) -> tuple[torch.nn.Module, str, str]:
    """(a tiny random model of `family`, its DCP checkpoint, its export with the debug tokenizer)."""
    from titanlike.checkpoint.format import model_description
    from titanlike.checkpoint.hf import export_dcp_to_hf, write_dcp_model
    from titanlike.models.registry import get_model_spec

    spec = get_model_spec(family)
    args = dataclasses.replace(spec.flavors[flavor], vocab_size=2048, **changes)
    model = materialize(spec.model_cls, args, seed=0)
    dcp, hf = str(root / f"{family}_dcp"), str(root / f"{family}_hf")
    write_dcp_model(model.state_dict(), dcp, {"contents": "model_only", "step": 0,
                                              "model": model_description(family, args),
                                              "tokenizer": {"bos_id": 1792, "eos_id": 1793}})
    export_dcp_to_hf(dcp, hf, tokenizer_path=TIKTOKEN)
    return model, dcp, hf


@pytest.mark.parametrize("family,flavor,framed", [
    ("llama3", "debugmodel_tiny", lambda ids, bos, eos: [bos] + ids),
    ("gpt2", "debugmodel", lambda ids, bos, eos: ids),
    ("t5", "debugmodel", lambda ids, bos, eos: ids + [eos]),
])
def test_prompt_tokens_equal_transformers_on_the_export(tmp_path, family, flavor, framed):
    from transformers import AutoTokenizer

    from titanlike.data.tokenizer import build_tokenizer
    from titanlike.inference.processor import Processor

    model, _, hf = _export(tmp_path, family, flavor)
    theirs = AutoTokenizer.from_pretrained(hf)
    want = theirs(TEXT)["input_ids"]
    ranks = build_tokenizer(TIKTOKEN)
    assert want == framed(ranks.encode(TEXT, bos=False, eos=False), 1792, 1793)
    # The export's folder (its tokenizer.json says it) and the ranks file (the family says it).
    for tokenizer in (build_tokenizer(hf), ranks):
        assert Processor.for_model(model, tokenizer).encode(TEXT) == want, (family, tokenizer)


def test_gpt2_word_perplexity_equals_lm_eval_hf(tmp_path, monkeypatch):
    pytest.importorskip("lm_eval")
    from lm_eval_assets import evaluate, offline, responses

    _, dcp, hf = _export(tmp_path, "gpt2", "debugmodel", n_layers=2, dim=64, n_heads=4, max_seq_len=64)
    (tmp_path / "tasks").mkdir()
    from lm_eval_assets import _tasks

    include = _tasks(tmp_path / "tasks")
    offline(monkeypatch)
    ours = evaluate("titanlike", f"checkpoint={dcp},tokenizer={hf}", include, limit=3)
    theirs = evaluate("hf", f"pretrained={hf},dtype=float32,max_length=64", include, limit=3)
    a, b = responses(ours)["tl_ppl"], responses(theirs)["tl_ppl"]
    assert a.keys() == b.keys()
    for doc in a:
        assert a[doc][0] == pytest.approx(b[doc][0], abs=1e-4), doc
    ppl = "word_perplexity,none"
    assert ours["results"]["tl_ppl"][ppl] == pytest.approx(theirs["results"]["tl_ppl"][ppl], rel=1e-4)
