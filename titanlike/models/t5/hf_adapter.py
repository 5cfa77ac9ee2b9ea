"""Hugging Face interchange for T5: T5ForConditionalGeneration's state-dict keys and config.json.

Differences besides names:
- Our blocks are one list, encoder first: our layer E + j is HF's decoder.block.j (E encoder layers).
- HF keeps each stack's relative-bias table in its block 0 (an nn.Embedding (num_buckets, n_heads));
  ours are the top-level encoder_relative_bias / decoder_relative_bias, stored (n_heads,
  num_buckets) so tensor parallelism splits heads on dim 0: transposed both ways.
- HF's encoder.embed_tokens and decoder.embed_tokens are aliases of shared; they are written
  nowhere and read only as aliases. Some old checkpoints carry an unused
  decoder.block.0.layer.1.EncDecAttention.relative_attention_bias; it is skipped, as HF does.
- Tying: transformers 5 always builds lm_head as an alias of shared and keeps the two apart only
  when a checkpoint holds both with different values; whether the output is scaled by
  d_model^-0.5 is its own flag (scale_decoder_outputs, which transformers 4 derived from
  tie_word_embeddings). We write both flags, so v1.1 (untied, unscaled) and original T5 (tied,
  scaled) folders read the same in transformers 4 and 5, and read both spellings.

Works on plain tensors (DTensors must be gathered first).
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from titanlike.models.common.hf import COMMON_RULES, COMPARED, COUNT, FLAG, POSITIVE, HFAdapter, known_ids, optional
from titanlike.models.common.init import canonical_fqn
from titanlike.models.t5.model import FEED_FORWARD_VARIANTS, T5Args

_ATTENTION = {"wq": "q", "wk": "k", "wv": "v", "wo": "o"}
# Our block-relative names -> HF's, for an encoder block and a decoder block.
_FFN = {"w1": ("wi_0", "wi"), "w3": ("wi_1", None), "w2": ("wo", "wo")}  # (gated, relu)


def _block_keys(args: T5Args, *, decoder: bool) -> dict[str, str]:
    ffn_layer = 2 if decoder else 1
    keys = {"attention_norm.weight": "layer.0.layer_norm.weight",
            "ffn_norm.weight": f"layer.{ffn_layer}.layer_norm.weight"}
    for ours, hf in _ATTENTION.items():
        keys[f"attention.{ours}.weight"] = f"layer.0.SelfAttention.{hf}.weight"
        if decoder:
            keys[f"cross_attention.{ours}.weight"] = f"layer.1.EncDecAttention.{hf}.weight"
    if decoder:
        keys["cross_attention_norm.weight"] = "layer.1.layer_norm.weight"
    for ours, (gated, relu) in _FFN.items():
        hf = gated if args.gated else relu
        if hf is not None:
            keys[f"feed_forward.{ours}.weight"] = f"layer.{ffn_layer}.DenseReluDense.{hf}.weight"
    return keys


_TOP = {
    "tok_embeddings.weight": "shared.weight",
    "encoder_norm.weight": "encoder.final_layer_norm.weight",
    "norm.weight": "decoder.final_layer_norm.weight",
    "output.weight": "lm_head.weight",
}
_BIAS_TABLES = {
    "encoder_relative_bias.weight": "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
    "decoder_relative_bias.weight": "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
}
_HF_ALIASES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
_HF_UNUSED = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)
_OUR_LAYER_RE = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER_RE = re.compile(r"(encoder|decoder)\.block\.(\d+)\.(.+)")


class T5HF(HFAdapter):
    """T5ForConditionalGeneration."""

    model_types = ("t5",)
    # T5's tokenizers end a text with EOS (</s>) and start none; the decoder starts from the pad id.
    tokenizer_template = ("$A eos", "$A eos $B eos")
    tokenizer_roles = ("eos", "pad")
    config_rules = {
        **COMMON_RULES, "feed_forward_proj": COMPARED, "dense_act_fn": COMPARED, "d_model": COUNT, "num_layers": COUNT,
        "num_decoder_layers": optional(COUNT), "num_heads": COUNT, "d_kv": COUNT, "d_ff": COUNT,
        "scale_decoder_outputs": FLAG, "relative_attention_num_buckets": COUNT,
        "relative_attention_max_distance": COUNT, "layer_norm_epsilon": POSITIVE, "n_positions": optional(COUNT),
    }

    def to_hf_state_dict(self, sd: Mapping[str, torch.Tensor], args: T5Args) -> dict[str, torch.Tensor]:
        """Our state dict (full tensors) -> T5ForConditionalGeneration's. Wrapper prefixes are ignored."""
        encoder_keys, decoder_keys = _block_keys(args, decoder=False), _block_keys(args, decoder=True)
        hf: dict[str, torch.Tensor] = {}
        for key, value in sd.items():
            key = canonical_fqn(key)
            if key == "output.weight" and args.tie_word_embeddings:
                continue
            if key in _TOP:
                hf[_TOP[key]] = value
                continue
            if key in _BIAS_TABLES:
                hf[_BIAS_TABLES[key]] = value.t().contiguous()
                continue
            m = _OUR_LAYER_RE.fullmatch(key)
            if m is None:
                raise KeyError(f"no Hugging Face name for parameter {key!r}")
            layer, name = int(m.group(1)), m.group(2)
            decoder = layer >= args.n_encoder_layers
            table = decoder_keys if decoder else encoder_keys
            if name not in table:
                raise KeyError(f"no Hugging Face name for parameter {key!r}")
            stack, index = ("decoder", layer - args.n_encoder_layers) if decoder else ("encoder", layer)
            hf[f"{stack}.block.{index}.{table[name]}"] = value
        return hf

    def from_hf_state_dict(self, hf_sd: Mapping[str, torch.Tensor], args: T5Args) -> dict[str, torch.Tensor]:
        """T5ForConditionalGeneration's state dict -> ours (loadable with load_state_dict(strict=True))."""
        back = {"encoder": {hf: ours for ours, hf in _block_keys(args, decoder=False).items()},
                "decoder": {hf: ours for ours, hf in _block_keys(args, decoder=True).items()}}
        top = {hf: ours for ours, hf in _TOP.items()}
        tables = {hf: ours for ours, hf in _BIAS_TABLES.items()}
        sd: dict[str, torch.Tensor] = {}
        for key, value in hf_sd.items():
            if key in _HF_ALIASES or key in _HF_UNUSED:
                continue
            if key in top:
                sd[top[key]] = value
                continue
            if key in tables:
                sd[tables[key]] = value.t().contiguous()
                continue
            m = _HF_LAYER_RE.fullmatch(key)
            if m is None or m.group(3) not in back[m.group(1)]:
                raise KeyError(f"unexpected Hugging Face T5 parameter {key!r}")
            stack, index, name = m.group(1), int(m.group(2)), m.group(3)
            limit = args.n_encoder_layers if stack == "encoder" else args.n_decoder_layers
            if index >= limit:
                raise KeyError(f"{key}: the config has {limit} {stack} layers")
            layer = index + (args.n_encoder_layers if stack == "decoder" else 0)
            sd[f"layers.{layer}.{back[stack][name]}"] = value
        if "tok_embeddings.weight" not in sd:
            # A folder written with only an alias of the shared table.
            alias = next((hf_sd[k] for k in _HF_ALIASES if k in hf_sd), None)
            if alias is None:
                raise KeyError("no shared.weight (token embeddings)")
            sd["tok_embeddings.weight"] = alias
        if args.tie_word_embeddings:
            head = sd.get("output.weight")
            if head is not None and not torch.equal(head, sd["tok_embeddings.weight"]):
                raise ValueError("lm_head.weight differs from shared.weight, but the config ties them; set "
                                 "tie_word_embeddings false in config.json")
            sd["output.weight"] = sd["tok_embeddings.weight"]
        elif "output.weight" not in sd:
            raise KeyError("untied model without lm_head.weight (is tie_word_embeddings set correctly?)")
        return sd

    def args_to_config(self, args: T5Args, *, max_position_embeddings: int | None = None) -> dict[str, Any]:
        """config.json contents for T5ForConditionalGeneration.

        n_positions is informative only (relative positions have no table); dropout is 0, as the model
        was trained. The token ids are the tokenizer's (token_ids), set by the checkpoint writer.
        """
        return {
            "architectures": ["T5ForConditionalGeneration"],
            "model_type": self.model_type(args),
            "is_encoder_decoder": True,
            "d_model": args.dim,
            "d_kv": args.head_dim,
            "d_ff": args.ffn_hidden_dim,
            "num_layers": args.n_encoder_layers,
            "num_decoder_layers": args.n_decoder_layers,
            "num_heads": args.n_heads,
            "vocab_size": args.vocab_size,
            "relative_attention_num_buckets": args.relative_attention_num_buckets,
            "relative_attention_max_distance": args.relative_attention_max_distance,
            "layer_norm_epsilon": args.norm_eps,
            "feed_forward_proj": args.feed_forward,
            "tie_word_embeddings": args.tie_word_embeddings,
            "scale_decoder_outputs": args.scale_decoder_outputs,
            "n_positions": max_position_embeddings or args.max_seq_len,
            "dropout_rate": 0.0,
            "initializer_factor": 1.0,
            "pad_token_id": None,
            "decoder_start_token_id": None,
            "use_cache": True,
        }

    def config_to_args(self, cfg: Mapping[str, Any]) -> T5Args:
        """T5Args for a T5ForConditionalGeneration config.json (dict); ValueError naming an unsupported key."""
        proj = cfg.get("feed_forward_proj", "relu")
        if proj not in FEED_FORWARD_VARIANTS:
            raise ValueError(f"unsupported T5 config: feed_forward_proj={proj!r} (supported: "
                             f"{', '.join(FEED_FORWARD_VARIANTS)})")
        if cfg.get("dense_act_fn") not in (None, "gelu_new" if proj == "gated-gelu" else "relu"):
            raise ValueError(f"unsupported T5 config: dense_act_fn={cfg['dense_act_fn']!r} with "
                             f"feed_forward_proj={proj!r}")
        tied = cfg.get("tie_word_embeddings", True) is not False
        n_layers = cfg.get("num_layers", 6)
        return T5Args(
            dim=cfg.get("d_model", 512),
            n_encoder_layers=n_layers,
            n_decoder_layers=cfg.get("num_decoder_layers") or n_layers,
            n_heads=cfg.get("num_heads", 8),
            head_dim=cfg.get("d_kv", 64),
            ffn_hidden_dim=cfg.get("d_ff", 2048),
            vocab_size=cfg.get("vocab_size", 32128),
            feed_forward=proj,
            tie_word_embeddings=tied,
            # transformers 4 scaled exactly when tied; 5 writes the flag.
            scale_decoder_outputs=bool(cfg.get("scale_decoder_outputs", tied)),
            relative_attention_num_buckets=cfg.get("relative_attention_num_buckets", 32),
            relative_attention_max_distance=cfg.get("relative_attention_max_distance", 128),
            norm_eps=cfg.get("layer_norm_epsilon", 1e-6),
            max_seq_len=cfg.get("n_positions") or 512,
        )

    def token_ids(self, *, bos: int | None, eos: int | None, pad: int | None) -> dict[str, int]:
        """With the pad id: our span-corruption samples pad the encoder's input with it
        (transformers reads it to batch and generate) and start the decoder from it
        (data/span_corruption.py), as T5's decoder_start_token_id."""
        return known_ids(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, decoder_start_token_id=pad)


__all__ = ["T5HF"]
