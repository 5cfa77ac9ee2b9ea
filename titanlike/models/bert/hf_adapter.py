"""Hugging Face interchange for BERT: BertForPreTraining's (binary_head=True) or
BertForMaskedLM's (binary_head=False) state-dict keys and config.json.

Differences besides names:
- Tied output projection: cls.predictions.decoder.weight is the word table (not written; read
  back as an alias). Its bias is cls.predictions.bias, which transformers also lists as
  cls.predictions.decoder.bias (the same tensor): either spelling is read, the first is written.
- HF's next-sentence label 1 means "B is a random sentence", ours (Megatron's sentence order) 1
  means "the segments were swapped": both are "not in order", so bert.pooler.dense and
  cls.seq_relationship map onto binary_head.pooler and binary_head.classifier unchanged.
- Checkpoints converted from the original TensorFlow release name LayerNorm parameters gamma and
  beta, and some carry position_ids / token_type_ids buffers (not weights, skipped).
- HF's BERT is post-norm only: a pre_norm model (Megatron's block order) has no HF class.
- A folder whose config names BertForMaskedLM reads as a model without the binary head; the pooler
  and cls.seq_relationship weights such folders may still hold (google-bert/bert-base-uncased's
  do) are left out, as transformers' BertForMaskedLM.from_pretrained leaves them.

Works on plain tensors (DTensors must be gathered first).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from titanlike.models.bert.model import BertArgs
from titanlike.models.common.hf import COMMON_RULES, COMPARED, COUNT, POSITIVE, HFAdapter, known_ids
from titanlike.models.common.hf_keys import HFKeyMap
from titanlike.models.common.init import canonical_fqn

# Our module names -> HF's: top-level, and per layer (under layers.N. / bert.encoder.layer.N.),
# each with its weight and bias.
_LAYER_MODULES = {
    "attention.wq": "attention.self.query",
    "attention.wk": "attention.self.key",
    "attention.wv": "attention.self.value",
    "attention.wo": "attention.output.dense",
    "attention_norm": "attention.output.LayerNorm",
    "feed_forward.w1": "intermediate.dense",
    "feed_forward.w2": "output.dense",
    "ffn_norm": "output.LayerNorm",
}
_TOP_MODULES = {
    "tok_embeddings": "bert.embeddings.word_embeddings",
    "pos_embeddings": "bert.embeddings.position_embeddings",
    "type_embeddings": "bert.embeddings.token_type_embeddings",
    "embedding_norm": "bert.embeddings.LayerNorm",
    "lm_head.dense": "cls.predictions.transform.dense",
    "lm_head.norm": "cls.predictions.transform.LayerNorm",
    "binary_head.pooler": "bert.pooler.dense",
    "binary_head.classifier": "cls.seq_relationship",
}


def _params(modules: dict[str, str]) -> dict[str, str]:
    return {f"{ours}.{kind}": f"{hf}.{kind}" for ours, hf in modules.items() for kind in ("weight", "bias")}


KEYS = HFKeyMap(
    top={**{k: v for k, v in _params(_TOP_MODULES).items() if "_embeddings.bias" not in k},
         "output.bias": "cls.predictions.bias"},
    layer=_params(_LAYER_MODULES),
    hf_layers="bert.encoder.layer.",
)
_TIED = "cls.predictions.decoder.weight"
# Other HF spellings: transformers also lists the output bias under the decoder, TensorFlow
# conversions name LayerNorm parameters gamma and beta.
_HF_ALIASES = {"cls.predictions.decoder.bias": "cls.predictions.bias"}
_TF_NAMES = {"gamma": "weight", "beta": "bias"}
_HF_BUFFERS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")


# Settings BertConfig has that change the computation, with the value our model computes.
_FIXED = {"hidden_act": "gelu", "is_decoder": False, "add_cross_attention": False,
          "position_embedding_type": "absolute", "tie_word_embeddings": True}


_ARCHITECTURES = ("BertForPreTraining", "BertForMaskedLM")


class BertHF(HFAdapter):
    """BertForPreTraining (binary_head) and BertForMaskedLM."""

    model_types = ("bert",)
    # BERT's tokenizers: [CLS] A [SEP] (B [SEP], type 1), and [MASK] for fill-mask.
    tokenizer_template = ("cls $A sep", "cls $A sep $B:1 sep:1")
    tokenizer_roles = ("cls", "sep", "mask", "pad")
    config_rules = {
        **COMMON_RULES, **{key: COMPARED for key in _FIXED}, "hidden_size": COUNT, "intermediate_size": COUNT,
        "num_hidden_layers": COUNT, "num_attention_heads": COUNT, "type_vocab_size": COUNT, "layer_norm_eps": POSITIVE,
    }

    def to_hf_state_dict(self, sd: Mapping[str, torch.Tensor], args: BertArgs) -> dict[str, torch.Tensor]:
        """Our state dict (full tensors) -> BertForPreTraining's (BertForMaskedLM's without the binary
        head). Wrapper prefixes in keys are ignored."""
        if args.pre_norm:
            raise ValueError("Hugging Face's BERT is post-norm: a pre_norm BERT has no transformers class")
        hf: dict[str, torch.Tensor] = {}
        for key, value in sd.items():
            key = canonical_fqn(key)
            if key == "output.weight":
                continue  # the word table
            hf_key = KEYS.to_hf(key)
            if hf_key is None:
                raise KeyError(f"no Hugging Face name for parameter {key!r}")
            hf[hf_key] = value
        return hf

    def from_hf_state_dict(self, hf_sd: Mapping[str, torch.Tensor], args: BertArgs) -> dict[str, torch.Tensor]:
        """BertForPreTraining's (or BertForMaskedLM's) state dict -> ours (load_state_dict(strict=True))."""
        sd: dict[str, torch.Tensor] = {}
        for key, value in hf_sd.items():
            key = re.sub(r"\.(gamma|beta)$", lambda m: "." + _TF_NAMES[m.group(1)], key)
            if key in _HF_BUFFERS or key == _TIED:
                continue  # not weights, or the word table again
            name = KEYS.from_hf(_HF_ALIASES.get(key, key))
            if name is None:
                raise KeyError(f"unexpected Hugging Face BERT parameter {key!r}")
            if name.startswith("binary_head.") and not args.binary_head:
                continue  # a BertForMaskedLM folder holding pretraining weights
            sd[name] = value
        if "tok_embeddings.weight" not in sd:
            raise KeyError("no bert.embeddings.word_embeddings.weight (word embeddings)")
        sd["output.weight"] = sd["tok_embeddings.weight"]
        return sd

    def args_to_config(self, args: BertArgs, *, max_position_embeddings: int | None = None) -> dict[str, Any]:
        """config.json contents for BertForPreTraining (BertForMaskedLM without the binary head).

        max_position_embeddings is the position table's rows (a weight): args.max_seq_len; another
        value is refused rather than written into an unloadable folder. Dropout is 0, as trained.
        """
        if args.pre_norm:
            raise ValueError("Hugging Face's BERT is post-norm: a pre_norm BERT has no transformers class")
        if max_position_embeddings not in (None, args.max_seq_len):
            raise ValueError(f"BERT's position table has {args.max_seq_len} rows; its config cannot say "
                             f"max_position_embeddings={max_position_embeddings}")
        return {
            "architectures": ["BertForPreTraining" if args.binary_head else "BertForMaskedLM"],
            "model_type": self.model_type(args),
            "hidden_size": args.dim,
            "num_hidden_layers": args.n_layers,
            "num_attention_heads": args.n_heads,
            "intermediate_size": args.ffn_hidden_dim,
            "hidden_act": "gelu",
            "max_position_embeddings": args.max_seq_len,
            "type_vocab_size": args.type_vocab_size,
            "vocab_size": args.vocab_size,
            "layer_norm_eps": args.norm_eps,
            "initializer_range": args.init_std,
            "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0,
            "tie_word_embeddings": True,
            "is_decoder": False,
            "add_cross_attention": False,
            "bos_token_id": None,
            "eos_token_id": None,
        }

    def config_to_args(self, cfg: Mapping[str, Any]) -> BertArgs:
        """BertArgs for a BertForPreTraining / BertForMaskedLM config.json (dict); ValueError naming an
        unsupported key."""
        for key, expected in _FIXED.items():
            if key in cfg and cfg[key] != expected:
                raise ValueError(f"unsupported BERT config: {key}={cfg[key]!r} (only {expected!r} is supported)")
        dim = cfg["hidden_size"]
        ffn = cfg.get("intermediate_size", 4 * dim)
        architectures = cfg.get("architectures") or ["BertForPreTraining"]
        unknown = sorted(set(architectures) - set(_ARCHITECTURES))
        if unknown:
            raise ValueError(f"unsupported BERT config: architectures={unknown} "
                             f"(supported: {', '.join(_ARCHITECTURES)})")
        return BertArgs(
            dim=dim,
            n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"],
            vocab_size=cfg["vocab_size"],
            max_seq_len=cfg.get("max_position_embeddings", 512),
            type_vocab_size=cfg.get("type_vocab_size", 2),
            norm_eps=cfg.get("layer_norm_eps", 1e-12),
            init_std=cfg.get("initializer_range", 0.02),
            binary_head="BertForMaskedLM" not in architectures,
            explicit_ffn_hidden_dim=None if ffn == 4 * dim else ffn,
        )

    def token_ids(self, *, bos: int | None, eos: int | None, pad: int | None) -> dict[str, int]:
        """With the pad id: our masked-LM samples are padded, and transformers reads it to batch."""
        return known_ids(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)


__all__ = ["KEYS", "BertHF"]
