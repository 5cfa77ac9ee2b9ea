"""T5 Hugging Face interchange, checked against transformers' own T5ForConditionalGeneration (offline,
random init from a T5Config), in fp32 with a tight tolerance, in both directions, for T5 v1.1
(gated-GELU, untied, unscaled) and the original T5 (ReLU, tied, output scaled by d_model^-0.5),
through the family's adapter and through the generic checkpoint code (import/export, load_model).

Inputs have padding (an encoder attention mask) so the mask's mapping is checked too.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from transformers import T5Config, T5ForConditionalGeneration

import titanlike
from conftest import hf_warnings
from family_checks import materialize
from titanlike.checkpoint.hf import export_dcp_to_hf, import_hf_to_dcp
from titanlike.models.common.attention import DocumentMask
from titanlike.models.registry import get_model_spec
from titanlike.models.t5 import T5, T5Args, t5_flavors

HF = get_model_spec("t5").hf
ATOL = 1e-5
VARIANTS = {"v1_1": dict(feed_forward="gated-gelu", tie_word_embeddings=False, scale_decoder_outputs=False),
            "original": dict(feed_forward="relu", tie_word_embeddings=True, scale_decoder_outputs=True)}


def tiny_args(variant: str) -> T5Args:
    # 8 buckets up to distance 20: the 40-token inputs reach the log-spaced and the capped buckets.
    return dataclasses.replace(t5_flavors["debugmodel"], dim=64, n_heads=4, head_dim=16, ffn_hidden_dim=96,
                               n_encoder_layers=2, n_decoder_layers=3, vocab_size=300, max_seq_len=40,
                               relative_attention_num_buckets=8, relative_attention_max_distance=20,
                               **VARIANTS[variant])


def hf_model(args: T5Args, seed=0) -> T5ForConditionalGeneration:
    """A random T5ForConditionalGeneration whose norms are not at their init (1), so a mis-mapped
    norm shows in the logits. transformers 5 builds lm_head as an alias of shared whatever the
    config says; an untied model gets its own lm_head here (as loading a v1.1 checkpoint does)."""
    torch.manual_seed(seed)
    model = T5ForConditionalGeneration(T5Config(**HF.args_to_config(args))).eval()
    with torch.no_grad():
        if not args.tie_word_embeddings:
            model.lm_head.weight = torch.nn.Parameter(0.05 * torch.randn_like(model.lm_head.weight))
        for name, p in model.named_parameters():
            if "layer_norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def ours(args: T5Args, seed=3) -> T5:
    return materialize(T5, args, seed=seed).eval()


def inputs(vocab: int):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (2, 40), generator=g)
    decoder_inputs = torch.randint(0, vocab, (2, 24), generator=g)
    document_ids = torch.zeros(2, 40, dtype=torch.long)
    document_ids[1, 29:] = 1  # sample 1 ends in 11 tokens of padding
    return tokens, decoder_inputs, document_ids


def hf_logits(model, tokens, decoder_inputs, document_ids):
    return model(input_ids=tokens, attention_mask=1 - document_ids, decoder_input_ids=decoder_inputs).logits


def our_logits(model, tokens, decoder_inputs, document_ids):
    mask = DocumentMask.from_document_ids(document_ids, "sdpa", causal=False)
    return model(tokens, mask=mask, decoder_inputs=decoder_inputs)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_adapter_both_ways(variant):
    args = tiny_args(variant)
    hf = hf_model(args)
    batch = inputs(args.vocab_size)
    # The config we write reads back as the same args (transformers 5's in-memory config always
    # says tie_word_embeddings=True, so the written one is the reference).
    assert HF.config_to_args(HF.args_to_config(args)) == args
    assert hf.config.scale_decoder_outputs is args.scale_decoder_outputs

    # HF -> ours.
    model = ours(args)
    model.load_state_dict(HF.from_hf_state_dict(hf.state_dict(), args), strict=True)
    with torch.no_grad():
        want = hf_logits(hf, *batch)
        torch.testing.assert_close(our_logits(model, *batch), want, rtol=0, atol=ATOL)
        # The padding mask matters in both models: unmasked, our logits differ.
        assert (model(batch[0], decoder_inputs=batch[1]) - want).abs().max() > 1e-3

    # Ours (our own init) -> HF.
    mine = ours(args, seed=5)
    back = T5ForConditionalGeneration(T5Config(**HF.args_to_config(mine.model_args))).eval()
    if not args.tie_word_embeddings:
        back.lm_head.weight = torch.nn.Parameter(torch.empty_like(back.lm_head.weight))
    missing, unexpected = back.load_state_dict(HF.to_hf_state_dict(mine.state_dict(), args), strict=False)
    aliases = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight"}
    assert unexpected == [] and set(missing) == aliases | ({"lm_head.weight"} if args.tie_word_embeddings else set())
    assert (back.lm_head.weight is back.shared.weight) is args.tie_word_embeddings
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(back, *batch), our_logits(mine, *batch), rtol=0, atol=ATOL)


def test_unsupported_configs_are_refused_by_name():
    config = HF.args_to_config(tiny_args("v1_1"))
    with pytest.raises(ValueError, match="feed_forward_proj"):
        HF.config_to_args({**config, "feed_forward_proj": "gated-silu"})
    # transformers 4's configs have no scale_decoder_outputs: tying implies the scale.
    legacy = {k: v for k, v in HF.args_to_config(tiny_args("original")).items()
              if k != "scale_decoder_outputs"}
    assert HF.config_to_args(legacy) == tiny_args("original")
    # transformers 5 saves every T5 config with tie_word_embeddings=true; a folder that still holds
    # a different lm_head is refused in one sentence rather than read as tied.
    args = tiny_args("original")
    hf_sd = HF.to_hf_state_dict(ours(args).state_dict(), dataclasses.replace(args, tie_word_embeddings=False))
    hf_sd["lm_head.weight"] = hf_sd["lm_head.weight"] + 1
    with pytest.raises(ValueError, match="tie_word_embeddings false"):
        HF.from_hf_state_dict(hf_sd, args)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_checkpoint_round_trip_and_load_model(tmp_path, variant):
    args = tiny_args(variant)
    hf = hf_model(args)
    hf.save_pretrained(tmp_path / "hf")
    if not args.tie_word_embeddings:
        # transformers 5 writes tie_word_embeddings=true for every T5; a v1.1 folder from the Hub
        # (written by transformers 4) says false. Read it as the Hub's.
        config = json.loads((tmp_path / "hf" / "config.json").read_text())
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    batch = inputs(args.vocab_size)
    with torch.no_grad():
        want = hf_logits(hf, *batch)

    # HF folder -> model directly, and HF -> DCP -> model.
    with torch.no_grad():
        torch.testing.assert_close(our_logits(titanlike.load_model(tmp_path / "hf"), *batch), want, rtol=0, atol=ATOL)
    import_hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"))
    sidecar = json.loads((tmp_path / "dcp" / "titanlike.json").read_text())
    assert sidecar["model"]["name"] == "t5" and sidecar["model"]["args"]["feed_forward"] == args.feed_forward
    with torch.no_grad():
        torch.testing.assert_close(our_logits(titanlike.load_model(tmp_path / "dcp"), *batch), want, rtol=0, atol=ATOL)

    # DCP -> HF (several shards) -> transformers, with the architecture transformers needs.
    export_dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "out"), max_shard_bytes=100_000)
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["T5ForConditionalGeneration"] and config["model_type"] == "t5"
    # The pad id travels through the sidecar; generation starts the decoder from it (as our samples do).
    assert config["pad_token_id"] == config["decoder_start_token_id"] == hf.config.pad_token_id
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 1
    with hf_warnings() as warned:
        back = T5ForConditionalGeneration.from_pretrained(tmp_path / "out").eval()
    # An untied export holds shared and lm_head; transformers 5 keeps them apart, with a warning.
    assert all("tie" in w for w in warned), warned
    assert (back.lm_head.weight is back.shared.weight) is args.tie_word_embeddings
    with torch.no_grad():
        torch.testing.assert_close(hf_logits(back, *batch), want, rtol=0, atol=ATOL)


def test_generation_starts_the_decoder_where_the_folder_says(tmp_path):
    """A Hugging Face folder whose decoder_start_token_id is not 0 (T5's own): generate.py's engine
    starts the decoder from config.json's id, and its greedy tokens equal transformers' generate;
    without one, from the tokenizer's pad token; a start id outside the vocabulary is one sentence."""
    from titanlike.inference import Engine, GenerationError, SamplingParams
    from titanlike.inference.loading import decoder_start_id

    # As many decoder layers as encoder ones: transformers' generate sizes its cache by the encoder's.
    hf = hf_model(dataclasses.replace(tiny_args("original"), n_decoder_layers=2))
    hf.config.decoder_start_token_id = hf.generation_config.decoder_start_token_id = 7
    hf.save_pretrained(tmp_path / "hf")
    model = titanlike.load_model(tmp_path / "hf").eval()
    tokenizer = None  # no tokenizer files: the folder's config.json is what is read
    start = decoder_start_id(str(tmp_path / "hf"), tokenizer, model)
    assert start == 7
    prompts = [[11, 20, 31, 9, 14], [40, 41, 5]]
    got = [c.tokens for c in Engine(model, start_id=start).generate(prompts, SamplingParams(max_new_tokens=6))[0]]
    ids = torch.zeros(2, 5, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, :len(p)], mask[row, :len(p)] = torch.tensor(p), 1
    want = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert want[:, 0].tolist() == [7, 7] and got == want[:, 1:].tolist()
    from0 = [c.tokens for c in Engine(model, start_id=0).generate(prompts, SamplingParams(max_new_tokens=6))[0]]
    assert from0 != got  # the start token matters: the test can tell

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    # No id in config.json: the tokenizer's pad token, found as the span-corruption samples find it.
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "decoder_start_token_id": None}))
    from tokenizers import Tokenizer, models

    words = {"<unk>": 0, "</s>": 1, "hello": 2, "<pad>": 5}
    (tmp_path / "tok").mkdir()
    Tokenizer(models.WordLevel(words, unk_token="<unk>")).save(str(tmp_path / "tok" / "tokenizer.json"))
    from titanlike.data import build_tokenizer

    assert decoder_start_id(str(tmp_path / "hf"), build_tokenizer(str(tmp_path / "tok")), model) == 5
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "decoder_start_token_id": 10**9}))
    with pytest.raises(GenerationError, match="decoder start token 1000000000, which is not an id"):
        decoder_start_id(str(tmp_path / "hf"), tokenizer, model)

