"""BERT Hugging Face interchange, against transformers' own BertForPreTraining (and BertForMaskedLM
without the binary head), built offline from small configs with random weights, in fp32, both
ways: through the family's adapter (MLM and next-sentence logits, the losses) and through the path
users take: save_pretrained -> convert_hf_to_dcp.py -> titanlike.load_model, and our DCP ->
convert_dcp_to_hf.py -> from_pretrained.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
from safetensors.torch import load_file
from transformers import BertConfig, BertForMaskedLM, BertForPreTraining

import titanlike
from conftest import REPO
from family_checks import materialize
from titanlike.checkpoint.format import model_description
from titanlike.checkpoint.hf import write_dcp_model
from titanlike.models.bert import Bert, BertArgs, bert_flavors
from titanlike.models.common.attention import DocumentMask
from titanlike.models.outputs import IGNORE_INDEX, cross_entropy_sum
from titanlike.models.registry import get_model_spec

sys.path.insert(0, str(REPO / "scripts"))
import convert_dcp_to_hf  # noqa: E402
import convert_hf_to_dcp  # noqa: E402
import generate  # noqa: E402

HF = get_model_spec("bert").hf
ATOL = 2e-5
SEQ = 40


def tiny_args(binary_head=True) -> BertArgs:
    return dataclasses.replace(bert_flavors["debugmodel_tiny"], vocab_size=300, max_seq_len=48,
                               binary_head=binary_head)


def hf_class(args):
    return BertForPreTraining if args.binary_head else BertForMaskedLM


def hf_model(args, seed=0):
    """A random transformers model whose norms and biases are not at their init (1 and 0), so a
    mis-mapped bias or LayerNorm shows in the logits."""
    torch.manual_seed(seed)
    model = hf_class(args)(BertConfig(**HF.args_to_config(args))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "LayerNorm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model


def ours(args, seed=3) -> Bert:
    model = materialize(Bert, args, seed=seed)
    with torch.no_grad():  # off their init too
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def inputs(vocab):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (2, SEQ), generator=g)
    token_types = (torch.arange(SEQ) >= torch.tensor([[15], [22]])).long()
    return tokens, token_types


def mlm_logits(output):
    return output.prediction_logits if hasattr(output, "prediction_logits") else output.logits


@pytest.mark.parametrize("binary_head", [True, False])
def test_adapter_both_ways(binary_head):
    args = tiny_args(binary_head)
    hf = hf_model(args)
    tokens, token_types = inputs(args.vocab_size)

    # HF -> ours.
    assert HF.config_to_args(hf.config.to_dict()) == args
    model = ours(args)
    model.load_state_dict(HF.from_hf_state_dict(hf.state_dict(), args), strict=True)
    assert model.output.weight is model.tok_embeddings.weight
    with torch.no_grad():
        want = hf(input_ids=tokens, token_type_ids=token_types)
        torch.testing.assert_close(model(tokens, token_types=token_types), mlm_logits(want), rtol=0, atol=ATOL)
        if binary_head:
            h = model.encode(tokens, token_types=token_types)
            torch.testing.assert_close(model.binary_logits(h), want.seq_relationship_logits, rtol=0, atol=ATOL)
        # Padding: HF's attention_mask (1 real) and our document ids (1 padding) hide it from real tokens.
        real = torch.tensor([[1] * 30 + [0] * 10, [1] * 36 + [0] * 4])
        mask = DocumentMask.from_document_ids(1 - real, "sdpa", causal=False)
        got = model(tokens, mask=mask, token_types=token_types)
        padded = mlm_logits(hf(input_ids=tokens, token_type_ids=token_types, attention_mask=real))
        for row, n in enumerate((30, 36)):
            torch.testing.assert_close(got[row, :n], padded[row, :n], rtol=0, atol=ATOL)

    # Ours (our own init) -> HF.
    mine = ours(args, seed=5)
    back = hf_class(args)(BertConfig(**HF.args_to_config(mine.model_args))).eval()
    missing, unexpected = back.load_state_dict(HF.to_hf_state_dict(mine.state_dict(), args), strict=False)
    # The tied decoder weight and bias are transformers' aliases of the word table and the bias.
    assert unexpected == [] and set(missing) <= {"cls.predictions.decoder.weight", "cls.predictions.decoder.bias"}
    assert back.cls.predictions.decoder.weight is back.bert.embeddings.word_embeddings.weight
    with torch.no_grad():
        got = back(input_ids=tokens, token_type_ids=token_types)
        torch.testing.assert_close(mlm_logits(got), mine(tokens, token_types=token_types), rtol=0, atol=ATOL)
        if binary_head:
            h = mine.encode(tokens, token_types=token_types)
            torch.testing.assert_close(got.seq_relationship_logits, mine.binary_logits(h), rtol=0, atol=ATOL)


def test_pretraining_loss_matches_transformers():
    """HF's next_sentence_label 1 ("B is random") and ours 1 ("segments swapped") are both the
    not-in-order class: with unit weights our binary loss is HF's next-sentence loss, summed."""
    args = tiny_args()
    hf = hf_model(args)
    model = ours(args)
    model.load_state_dict(HF.from_hf_state_dict(hf.state_dict(), args), strict=True)
    tokens, token_types = inputs(args.vocab_size)
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:, ::5] = tokens[:, ::5]
    binary = torch.tensor([1, 0])
    with torch.no_grad():
        want = hf(input_ids=tokens, token_type_ids=token_types, labels=labels, next_sentence_label=binary).loss
    model.train()
    logits = model(tokens, token_types=token_types, binary_labels=binary)
    mlm = cross_entropy_sum(logits, labels) / (labels != IGNORE_INDEX).sum()
    binary_loss = model.binary_head.reported_loss_sum / len(binary)
    torch.testing.assert_close(mlm + binary_loss, want, rtol=1e-5, atol=1e-6)


def test_original_checkpoint_spellings():
    """Checkpoints converted from the TensorFlow release name LayerNorm parameters gamma / beta and
    carry position_ids; transformers lists the output bias twice (cls.predictions.decoder.bias)."""
    args = tiny_args()
    hf = hf_model(args)
    sd = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
          for k, v in hf.state_dict().items() if k != "cls.predictions.bias"}
    sd["bert.embeddings.position_ids"] = torch.arange(48)[None]
    model = ours(args)
    model.load_state_dict(HF.from_hf_state_dict(sd, args), strict=True)
    tokens, token_types = inputs(args.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, token_types=token_types),
                                   hf(input_ids=tokens, token_type_ids=token_types).prediction_logits,
                                   rtol=0, atol=ATOL)
    with pytest.raises(KeyError, match="unexpected"):
        HF.from_hf_state_dict({**sd, "bert.encoder.layer.0.crossattention.x.weight": sd[
            "cls.seq_relationship.weight"]}, args)
    # A BertForMaskedLM config over pretraining weights (as google-bert/bert-base-uncased): the
    # binary head's weights are left out, as transformers' BertForMaskedLM does.
    masked_only = tiny_args(binary_head=False)
    model = ours(masked_only)
    model.load_state_dict(HF.from_hf_state_dict(sd, masked_only), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, token_types=token_types),
                                   hf(input_ids=tokens, token_type_ids=token_types).prediction_logits,
                                   rtol=0, atol=ATOL)


@pytest.mark.parametrize("key, value", [
    ("architectures", ["BertForSequenceClassification"]),
    ("hidden_act", "relu"),
    ("position_embedding_type", "relative_key"),
    ("is_decoder", True),
])
def test_unsupported_configs_are_refused_by_name(key, value):
    config = {**HF.args_to_config(tiny_args()), key: value}
    with pytest.raises(ValueError, match=key):
        HF.config_to_args(config)
    with pytest.raises(ValueError, match="post-norm"):
        HF.args_to_config(dataclasses.replace(tiny_args(), pre_norm=True))
    with pytest.raises(ValueError, match="position table has 48 rows"):
        HF.args_to_config(tiny_args(), max_position_embeddings=512)


@pytest.mark.parametrize("binary_head", [True, False])
def test_converters_round_trip(tmp_path, binary_head):
    """HF folder -> convert_hf_to_dcp.py -> load_model, and DCP -> convert_dcp_to_hf.py -> from_pretrained,
    with the architecture named in config.json."""
    args = tiny_args(binary_head)
    hf = hf_model(args)
    hf.save_pretrained(tmp_path / "hf")
    tokens, _ = inputs(args.vocab_size)
    with torch.no_grad():
        want = mlm_logits(hf(tokens))

    assert convert_hf_to_dcp.main([str(tmp_path / "hf"), str(tmp_path / "dcp")]) == 0
    sidecar = json.loads((tmp_path / "dcp" / "titanlike.json").read_text())
    assert sidecar["model"]["name"] == "bert" and sidecar["model"]["args"]["binary_head"] is binary_head
    with torch.no_grad():
        torch.testing.assert_close(titanlike.load_model(tmp_path / "dcp")(tokens), want, rtol=0, atol=ATOL)
        torch.testing.assert_close(titanlike.load_model(tmp_path / "hf")(tokens), want, rtol=0, atol=ATOL)

    assert convert_dcp_to_hf.main([str(tmp_path / "dcp"), str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == [hf_class(args).__name__] and config["model_type"] == "bert"
    written = set(json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())["weight_map"])
    assert written == set(load_file(tmp_path / "hf" / "model.safetensors"))  # the keys save_pretrained writes
    back = hf_class(args).from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        got = back(tokens)
        torch.testing.assert_close(mlm_logits(got), want, rtol=0, atol=ATOL)
        if binary_head:
            torch.testing.assert_close(got.seq_relationship_logits, hf(tokens).seq_relationship_logits,
                                       rtol=0, atol=ATOL)


def test_our_weights_export_and_pre_norm_refusal(tmp_path, capsys):
    """Weights of our own init through a model-only DCP; a pre-norm BERT (no transformers class)
    fails the export in one line naming the reason, writing nothing."""
    args = tiny_args()
    model = ours(args, seed=7)
    write_dcp_model(model.state_dict(), str(tmp_path / "dcp"),
                    {"contents": "model_only", "step": 0, "model": model_description("bert", args)})
    assert convert_dcp_to_hf.main([str(tmp_path / "dcp"), str(tmp_path / "hf")]) == 0
    hf = BertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    tokens, token_types = inputs(args.vocab_size)
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=tokens, token_type_ids=token_types).prediction_logits,
                                   model(tokens, token_types=token_types), rtol=0, atol=ATOL)

    pre = dataclasses.replace(args, pre_norm=True)
    model = ours(pre)
    write_dcp_model(model.state_dict(), str(tmp_path / "pre"),
                    {"contents": "model_only", "step": 0, "model": model_description("bert", pre)})
    capsys.readouterr()
    assert convert_dcp_to_hf.main([str(tmp_path / "pre"), str(tmp_path / "pre_hf")]) == 1
    assert "convert_dcp_to_hf: Hugging Face's BERT is post-norm" in capsys.readouterr().err
    assert not (tmp_path / "pre_hf").exists()


def test_generate_refuses_an_encoder(tmp_path, capsys):
    """scripts/generate.py samples next tokens; a masked-LM checkpoint is refused in one line."""
    hf_model(tiny_args()).save_pretrained(tmp_path / "hf")
    capsys.readouterr()  # transformers' progress bar
    assert generate.main([str(tmp_path / "hf"), "--max-new-tokens", "2"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "decoder-only" in err and "masked_lm samples" in err, err
