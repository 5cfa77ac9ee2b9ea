"""Hugging Face interchange for GPT-2: GPT2LMHeadModel's state-dict keys and config.json.

Differences besides names:
- HF's GPT-2 uses Conv1D layers whose weights are stored (in_features, out_features), the
  transpose of nn.Linear's; every projection is transposed on the way in and out.
- HF fuses q, k and v into one c_attn projection (output features q | k | v); we keep wq, wk,
  wv (split by heads under tensor parallelism), so c_attn is split and concatenated.
- Tied embeddings: HF's saved folders hold no lm_head.weight for a tied model; our state dict
  has output.weight as an alias of tok_embeddings.weight.
- Older HF checkpoints carry the attention mask as buffers (attn.bias, attn.masked_bias); they
  are not weights and are skipped. The original openai-community/gpt2 files also lack the
  "transformer." prefix (they are GPT2Model's keys); both spellings are read.

Works on plain tensors (DTensors must be gathered first).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from titanlike.models.common.hf import COMMON_RULES, COMPARED, COUNT, POSITIVE, HFAdapter, optional
from titanlike.models.common.hf_keys import HFKeyMap
from titanlike.models.common.init import canonical_fqn
from titanlike.models.gpt2.model import GPT2Args

# Our names -> HF's for tensors that only need a rename (the layers' under layers.N. /
# transformer.h.N.); wq, wk and wv are fused into c_attn.
KEYS = HFKeyMap(
    top={
        "tok_embeddings.weight": "transformer.wte.weight",
        "pos_embeddings.weight": "transformer.wpe.weight",
        "norm.weight": "transformer.ln_f.weight",
        "norm.bias": "transformer.ln_f.bias",
        "output.weight": "lm_head.weight",
    },
    layer={
        "attention_norm.weight": "ln_1.weight",
        "attention_norm.bias": "ln_1.bias",
        "attention.wo.weight": "attn.c_proj.weight",
        "attention.wo.bias": "attn.c_proj.bias",
        "ffn_norm.weight": "ln_2.weight",
        "ffn_norm.bias": "ln_2.bias",
        "feed_forward.w1.weight": "mlp.c_fc.weight",
        "feed_forward.w1.bias": "mlp.c_fc.bias",
        "feed_forward.w2.weight": "mlp.c_proj.weight",
        "feed_forward.w2.bias": "mlp.c_proj.bias",
    },
    hf_layers="transformer.h.",
)
# Our per-layer weights that are a Conv1D weight in HF (stored transposed).
_CONV1D = ("attention.wo.weight", "feed_forward.w1.weight", "feed_forward.w2.weight")
_QKV = ("wq", "wk", "wv")
# Non-persistent attention-mask buffers some transformers versions saved.
_HF_BUFFERS = ("attn.bias", "attn.masked_bias")

# Activations that are the tanh-approximated GELU our MLP computes by default, and the exact one
# (gelu_approximate "none").
_TANH_GELU = ("gelu_new", "gelu_pytorch_tanh")
_EXACT_GELU = ("gelu",)


def _t(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous()


# Settings GPT2Config has that change the computation, with the value our model computes.
_FIXED = {
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
}


class GPT2HF(HFAdapter):
    """GPT2LMHeadModel (and GPT2Model's keys, read)."""

    model_types = ("gpt2",)
    # GPT-2's tokenizer adds no special token to a text.
    tokenizer_template = ("$A", "$A $B")
    config_rules = {
        **COMMON_RULES, **{key: COMPARED for key in _FIXED}, "activation_function": COMPARED, "n_embd": COUNT,
        "n_inner": optional(COUNT), "n_positions": COUNT, "n_ctx": optional(COUNT), "n_layer": COUNT, "n_head": COUNT,
        "layer_norm_epsilon": POSITIVE,
    }

    def to_hf_state_dict(self, sd: Mapping[str, torch.Tensor], args: GPT2Args) -> dict[str, torch.Tensor]:
        """Our state dict (full tensors) -> GPT2LMHeadModel's. Wrapper prefixes in keys are ignored."""
        hf: dict[str, torch.Tensor] = {}
        qkv: dict[str, dict[str, dict[str, torch.Tensor]]] = {}  # layer -> weight|bias -> wq|wk|wv -> tensor
        for key, value in sd.items():
            key = canonical_fqn(key)
            if key == "output.weight" and args.tie_word_embeddings:
                continue
            hf_key = KEYS.to_hf(key)
            if hf_key is not None:
                hf[hf_key] = _t(value) if KEYS.layer_name(key) in _CONV1D else value
                continue
            layer, name = KEYS.split(key) or (None, "")
            parts = name.split(".")
            if len(parts) != 3 or parts[0] != "attention" or parts[1] not in _QKV:
                raise KeyError(f"no Hugging Face name for parameter {key!r}")
            qkv.setdefault(layer, {}).setdefault(parts[2], {})[parts[1]] = value
        for layer, kinds in qkv.items():
            for kind, proj in kinds.items():
                if set(proj) != set(_QKV):
                    raise KeyError(f"layer {layer}: attention {kind} needs wq, wk and wv, got {sorted(proj)}")
                fused = torch.cat([proj[p] for p in _QKV], dim=0)  # (3 dim, dim) or (3 dim,)
                hf[f"transformer.h.{layer}.attn.c_attn.{kind}"] = _t(fused) if kind == "weight" else fused
        return hf

    def from_hf_state_dict(self, hf_sd: Mapping[str, torch.Tensor], args: GPT2Args) -> dict[str, torch.Tensor]:
        """GPT2LMHeadModel's (or GPT2Model's) state dict -> ours (loadable with load_state_dict(strict=True))."""
        sd: dict[str, torch.Tensor] = {}
        for key, value in hf_sd.items():
            if not key.startswith(("transformer.", "lm_head.")):
                key = f"transformer.{key}"  # GPT2Model's keys (the original openai-community files)
            if key == "lm_head.weight" and args.tie_word_embeddings:
                continue
            name = KEYS.from_hf(key)
            if name is not None:
                sd[name] = _t(value) if KEYS.layer_name(name) in _CONV1D else value
                continue
            layer, hf_name = KEYS.split_hf(key) or (None, "")
            if hf_name in _HF_BUFFERS:
                continue
            if hf_name not in ("attn.c_attn.weight", "attn.c_attn.bias"):
                raise KeyError(f"unexpected Hugging Face GPT-2 parameter {key!r}")
            kind = hf_name.rsplit(".", 1)[1]
            fused = _t(value) if kind == "weight" else value  # (3 dim, dim) or (3 dim,)
            if fused.shape[0] != 3 * args.dim:
                raise KeyError(f"{key} has {fused.shape[0]} output features, expected 3 x {args.dim}")
            for name, part in zip(_QKV, fused.chunk(3, dim=0)):
                sd[f"layers.{layer}.attention.{name}.{kind}"] = part.contiguous()
        if "tok_embeddings.weight" not in sd:
            raise KeyError("no transformer.wte.weight (token embeddings)")
        if args.tie_word_embeddings:
            sd["output.weight"] = sd["tok_embeddings.weight"]
        elif "output.weight" not in sd:
            raise KeyError("untied model without lm_head.weight (is tie_word_embeddings set correctly?)")
        return sd

    def args_to_config(self, args: GPT2Args, *, max_position_embeddings: int | None = None) -> dict[str, Any]:
        """config.json contents for GPT2LMHeadModel.

        n_positions is the row count of the position table (a weight): it is args.max_seq_len, and a
        different max_position_embeddings is refused rather than written into an unloadable folder.
        bos/eos ids are left unset (the checkpoint writer adds the tokenizer's); dropout is 0, as
        the model was trained.
        """
        if max_position_embeddings not in (None, args.max_seq_len):
            raise ValueError(f"GPT-2's position table has {args.max_seq_len} rows; its config cannot say "
                             f"n_positions={max_position_embeddings}")
        return {
            "architectures": ["GPT2LMHeadModel"],
            "model_type": self.model_type(args),
            "n_embd": args.dim,
            "n_layer": args.n_layers,
            "n_head": args.n_heads,
            "n_inner": args.ffn_hidden_dim,
            "n_positions": args.max_seq_len,
            "n_ctx": args.max_seq_len,
            "vocab_size": args.vocab_size,
            "layer_norm_epsilon": args.norm_eps,
            "activation_function": "gelu_new" if args.gelu_approximate == "tanh" else "gelu",
            "tie_word_embeddings": args.tie_word_embeddings,
            "initializer_range": args.init_std,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
            "attn_pdrop": 0.0,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "add_cross_attention": False,
            "bos_token_id": None,
            "eos_token_id": None,
            "use_cache": True,
        }

    def config_to_args(self, cfg: Mapping[str, Any]) -> GPT2Args:
        """GPT2Args for a GPT2LMHeadModel config.json (dict); ValueError naming an unsupported key."""
        for key, expected in _FIXED.items():
            if key in cfg and bool(cfg[key]) != expected:
                raise ValueError(f"unsupported GPT-2 config: {key}={cfg[key]!r} (only {expected!r} is supported)")
        activation = cfg.get("activation_function", "gelu_new")
        if activation not in (*_TANH_GELU, *_EXACT_GELU):
            raise ValueError(f"unsupported GPT-2 config: activation_function={activation!r} "
                             f"(supported: {', '.join((*_TANH_GELU, *_EXACT_GELU))})")
        dim = cfg["n_embd"]
        n_inner = cfg.get("n_inner")
        if n_inner not in (None, 4 * dim):
            raise ValueError(f"unsupported GPT-2 config: n_inner={n_inner!r} (only None or 4 x n_embd = {4 * dim})")
        n_positions = cfg["n_positions"]
        if cfg.get("n_ctx") not in (None, n_positions):
            raise ValueError(f"unsupported GPT-2 config: n_ctx={cfg['n_ctx']!r} differs from n_positions={n_positions}")
        return GPT2Args(
            dim=dim,
            n_layers=cfg["n_layer"],
            n_heads=cfg["n_head"],
            vocab_size=cfg["vocab_size"],
            max_seq_len=n_positions,
            norm_eps=cfg.get("layer_norm_epsilon", 1e-5),
            tie_word_embeddings=cfg.get("tie_word_embeddings", True),
            init_std=cfg.get("initializer_range", 0.02),
            gelu_approximate="tanh" if activation in _TANH_GELU else "none",
        )


__all__ = ["KEYS", "GPT2HF"]
