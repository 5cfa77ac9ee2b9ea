"""The Hugging Face adapter a family gives its ModelSpec (`spec.hf`), and what Llama-style adapters share.

An adapter owns everything about one family's transformers classes: the config.json model_types it
reads (and the one it writes for given args), config.json <-> model args, our state dict <->
theirs (full tensors; DTensors must be gathered first), and the token-id fields of config.json.
The args know nothing about Hugging Face, and the checkpoint code (titanlike/checkpoint/) reads no
family field: it asks the adapter.

Shared by the adapters of transformers' Llama-style decoders (Llama, Qwen3, Mixtral, DeepSeek-V3):
their parameter names (`DECODER_TOP`, `ATTENTION_NAMES`, ...), the config.json fields they have in
common (`decoder_config`), reading an unscaled rope_theta, and the RoPE row order of q/k
projections (ours pair-interleaved, HF's rotate-half).
"""

from __future__ import annotations

import abc
import json
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any, ClassVar

import torch

from titanlike.models.args import MAX_SIZE, BaseModelArgs, check_fields

StateDict = Mapping[str, torch.Tensor]


# What a config.json value may be ----------------------------------------------------------------
#
# A config.json is input from anywhere (the Hub, a colleague, an attacker): every value an adapter
# reads is checked against its rule before config_to_args sees it (HFAdapter.read_config), so that a
# hostile value is one sentence naming the key and the value, never a traceback, a division by zero
# or a table of 10^10 positions. A rule returns None for a value it accepts, else what the value
# must be. An adapter lists the rules of the keys it reads (`config_rules`: the shared decoder keys
# below and its own); tests/unit/test_hf_config_rules.py reads every adapter's config_to_args to
# prove that each key it reads has one.

Rule = Callable[[Any], "str | None"]


def _integer(low: int) -> Rule:
    def rule(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_SIZE:
            return f"an integer from {low} to {MAX_SIZE}"
        return None

    return rule


def _number(*, positive: bool) -> Rule:
    def rule(value: Any) -> str | None:
        ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) \
            and (value > 0 if positive else value >= 0)
        return None if ok else f"a finite number {'above' if positive else 'at least'} 0"

    return rule


COUNT = _integer(1)  # a size or a count: heads, layers, features, positions
INDEX = _integer(0)  # a count that may be 0, a layer or token index
POSITIVE = _number(positive=True)  # epsilons, RoPE theta and factors
NON_NEGATIVE = _number(positive=False)  # loss coefficients, init std
FLAG: Rule = lambda value: None if isinstance(value, bool) else "true or false"  # noqa: E731
TEXT: Rule = lambda value: None if isinstance(value, str) and len(value) <= 10_000 else "a string"  # noqa: E731
# A value the adapter compares with the one it supports (anything else is refused there, by name).
COMPARED: Rule = lambda value: None  # noqa: E731


def optional(rule: Rule) -> Rule:
    """null, or what `rule` accepts."""
    return lambda value: None if value is None else (None if rule(value) is None else f"null or {rule(value)}")


def list_of(rule: Rule, *, length: int | None = None) -> Rule:
    def check(value: Any) -> str | None:
        if not isinstance(value, list) or (length is not None and len(value) != length):
            return f"a list{f' of {length} items' if length else ''}"
        for i, item in enumerate(value):
            if (problem := rule(item)) is not None:
                return f"a list whose items are each {problem} (item {i} is {_show(item)})"
        return None

    return check


def one_or_list(rule: Rule) -> Rule:
    """What `rule` accepts, or a list of such values (eos_token_id may list several)."""
    return lambda value: list_of(rule)(value) if isinstance(value, list) else rule(value)


def table(rules: Mapping[str, Rule]) -> Rule:
    """A JSON object (or null) whose keys named in `rules` are checked by them (nested settings:
    rope_scaling); other keys are not read."""

    def check(value: Any) -> str | None:
        if value is None:
            return None
        if not isinstance(value, dict):
            return "an object (or null)"
        for key, rule in rules.items():
            if key in value and (problem := rule(value[key])) is not None:
                return f"an object whose {key} is {problem} (got {_show(value[key])})"
        return None

    return check


# RoPE settings (transformers 4.x rope_scaling, 5.x rope_parameters): Llama 3 scaling, YaRN, theta.
ROPE = table({
    "rope_type": TEXT, "type": TEXT, "rope_theta": POSITIVE, "factor": POSITIVE, "low_freq_factor": POSITIVE,
    "high_freq_factor": POSITIVE, "original_max_position_embeddings": optional(COUNT), "beta_fast": NON_NEGATIVE,
    "beta_slow": NON_NEGATIVE, "mscale": optional(NON_NEGATIVE), "mscale_all_dim": optional(NON_NEGATIVE),
    "attention_factor": optional(POSITIVE), "truncate": FLAG,
})

# Keys every config.json may carry and the checkpoint code reads (model_type, the token ids).
COMMON_RULES: dict[str, Rule] = {
    "model_type": TEXT, "architectures": optional(list_of(TEXT)), "tie_word_embeddings": FLAG,
    "bos_token_id": optional(one_or_list(INDEX)), "eos_token_id": optional(one_or_list(INDEX)),
    "pad_token_id": optional(one_or_list(INDEX)), "vocab_size": COUNT, "max_position_embeddings": COUNT,
    "initializer_range": NON_NEGATIVE,
}

# The keys transformers' Llama-style decoders share (Llama, Qwen3, Mixtral, DeepSeek-V3, NemotronH).
DECODER_RULES: dict[str, Rule] = {
    **COMMON_RULES, "hidden_size": COUNT, "intermediate_size": COUNT, "num_hidden_layers": COUNT,
    "num_attention_heads": COUNT, "num_key_value_heads": optional(COUNT), "head_dim": optional(COUNT),
    "rms_norm_eps": POSITIVE, "rope_theta": POSITIVE, "rope_scaling": ROPE, "rope_parameters": ROPE,
    "hidden_act": COMPARED, "attention_bias": COMPARED, "mlp_bias": COMPARED,
}

# Mixture-of-experts keys of transformers' decoders (Mixtral, Qwen3-MoE, DeepSeek-V3).
MOE_RULES: dict[str, Rule] = {
    "num_local_experts": COUNT, "num_experts": COUNT, "n_routed_experts": COUNT, "num_experts_per_tok": COUNT,
    "moe_intermediate_size": COUNT, "n_shared_experts": optional(INDEX), "norm_topk_prob": FLAG,
    "router_aux_loss_coef": NON_NEGATIVE, "decoder_sparse_step": COUNT, "mlp_only_layers": optional(list_of(INDEX)),
    "first_k_dense_replace": INDEX, "n_group": COUNT, "topk_group": COUNT, "routed_scaling_factor": POSITIVE,
    "aux_loss_alpha": NON_NEGATIVE, "seq_aux": FLAG,
}


def _show(value: Any) -> str:
    """A config.json value as it reads in the file, shortened for a one-line message."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_config_values(config: Mapping[str, Any], rules: Mapping[str, Rule]) -> None:
    """ValueError (one sentence naming the key and the value) for the first value of config that
    its rule refuses; keys without a rule are not read by the adapter and not checked."""
    for key, rule in rules.items():
        if key in config and (problem := rule(config[key])) is not None:
            raise ValueError(f"{key} is {_show(config[key])}, but it must be {problem}")


class HFAdapter(abc.ABC):
    """One family's Hugging Face interchange. Subclasses set `model_types` and implement the four
    conversions; `model_type` and `token_ids` have defaults."""

    # Every config.json model_type the family reads (one per transformers class it maps).
    model_types: ClassVar[tuple[str, ...]] = ()
    # How the family's own Hugging Face tokenizers frame a text, as tokenizers' TemplateProcessing
    # (single, pair) with role names for the special tokens (bos, eos, cls, sep; `:1` marks the
    # second segment's type id), and the roles tokenizer_config.json names (bos, eos, pad, cls, sep,
    # mask): an exported tokenizer follows them. The default: Llama 3's, BOS first.
    tokenizer_template: ClassVar[tuple[str, str]] = ("bos $A", "bos $A bos $B")
    tokenizer_roles: ClassVar[tuple[str, ...]] = ("bos", "eos", "pad")
    # The rule of every config.json key config_to_args reads (see Rule above).
    config_rules: ClassVar[Mapping[str, Rule]] = COMMON_RULES
    # A model with a scalar head (a reward model, args.has_score_head) is written as this transformers
    # class (e.g. LlamaForSequenceClassification, num_labels 1), its output projection under
    # `score_names` (ours in HF's state dict -> the class's); None: the family has no such class.
    score_architecture: ClassVar[str | None] = None
    score_names: ClassVar[Mapping[str, str]] = {}


    def extra_files(self, args, special_tokens: Mapping[str, int]) -> dict[str, dict]:
        """JSON files an export writes beside config.json (file name -> content), given the exported
        tokenizer's special tokens (text -> id): a vision-language model's preprocessor_config.json, so
        that transformers' AutoProcessor loads the folder. None by default."""
        return {}

    def read_config(self, config: Mapping[str, Any]) -> BaseModelArgs:
        """config_to_args for a config.json from anywhere: every value it reads checked first
        (config_rules), any failure of the conversion and any args field out of range one ValueError
        sentence (the caller names the file)."""
        if not isinstance(config, Mapping):
            raise ValueError("it is not a JSON object")
        check_config_values(config, self.config_rules)
        try:
            args = self.config_to_args(config)
        except (KeyError, ValueError) as e:
            detail = f"it lacks the key {e.args[0]!r}" if isinstance(e, KeyError) and e.args else str(e)
            raise ValueError(f"not a supported {self.model_types[0]} configuration: {detail}") from None
        except Exception as e:  # a combination the rules let through (a division, an assertion)
            raise ValueError(f"not a supported {self.model_types[0]} configuration "
                             f"({type(e).__name__}: {e})") from None
        check_fields(type(args), args.to_dict(), what="the model it describes")
        if self.is_score_model(config):
            # transformers saves num_labels as id2label (its default: two labels).
            id2label = config.get("id2label")
            labels = len(id2label) if isinstance(id2label, Mapping) else config.get("num_labels", 2)
            if labels != 1:
                raise ValueError(f"its {self.score_architecture} has {labels} labels, and a reward model scores with "
                                 "one (num_labels 1)")
            args = args.with_score_head()
        return args

    def is_score_model(self, config: Mapping[str, Any]) -> bool:
        """Whether a config.json describes the family's sequence-classification class (score_model's)."""
        architectures = config.get("architectures")
        return self.score_architecture is not None and isinstance(architectures, list) \
            and self.score_architecture in architectures

    def args_for_weights(self, args: BaseModelArgs, names: Collection[str]) -> BaseModelArgs:
        """The args of a folder whose config.json describes more than its tensors (`names`, HF's) hold,
        read as the model the tensors make (DeepSeek-V3: transformers' save_pretrained keeps
        num_nextn_predict_layers but drops those layers). Default: args unchanged."""
        return args

    def unlisted_tensors(self, names: Collection[str], args: BaseModelArgs) -> tuple[str, set[str]]:
        """(a file name, HF tensor names among `names`) to write into that safetensors file of their
        own, which model.safetensors.index.json does not list: tensors the transformers class has no
        module for, which it would name as unexpected on load (titanlike reads every file of a
        folder). Default: none."""
        return "", set()

    def model_type(self, args: BaseModelArgs) -> str:
        """The model_type args_to_config writes for these args (default: the family's only one)."""
        return self.model_types[0]

    @abc.abstractmethod
    def config_to_args(self, config: Mapping[str, Any]) -> BaseModelArgs:
        """Model args from a config.json (dict); ValueError (or KeyError for a missing key) when the
        configuration has no equivalent here."""

    @abc.abstractmethod
    def args_to_config(self, args: BaseModelArgs, *, max_position_embeddings: int | None = None) -> dict[str, Any]:
        """config.json contents for transformers' class of these args (the tokenizer's ids are
        token_ids', set by the checkpoint writer). max_position_embeddings: the model's real context
        when args carry a shorter training seq_len (default: args.max_seq_len). ValueError for args
        with no HF equivalent."""

    @abc.abstractmethod
    def to_hf_state_dict(self, sd: StateDict, args: BaseModelArgs) -> dict[str, torch.Tensor]:
        """Our state dict (full tensors; wrapper prefixes in keys ignored) -> HF's, as saved on disk."""

    @abc.abstractmethod
    def from_hf_state_dict(self, hf_sd: StateDict, args: BaseModelArgs) -> dict[str, torch.Tensor]:
        """HF's state dict -> ours, loadable with load_state_dict(strict=True) (tied aliases
        included); KeyError for a tensor with no name here, ValueError for values that cannot load."""

    def module_name(self, hf_name: str) -> str:
        """The path, in the family's transformers model, of the module or parameter that the checkpoint
        key `hf_name` (to_hf_state_dict's) loads into: the name peft gives an adapter or a module it
        saves. The key itself, unless the transformers class renames its checkpoint's keys on load."""
        return hf_name

    def score_model(self, hf_sd: StateDict, config: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(state dict, config.json) of a model with a scalar head, from what to_hf_state_dict and
        args_to_config give: transformers' sequence-classification class of one label, which scores
        each sequence at its last token that is not padding. ValueError (one sentence) if the family
        has none."""
        if self.score_architecture is None:
            raise ValueError(f"the {self.model_types[0]} family has no Hugging Face sequence-classification class "
                             "to write a reward model as")
        names = self.score_names
        return ({names.get(k, k): v for k, v in hf_sd.items()},
                {**config, "architectures": [self.score_architecture], "num_labels": 1})

    def unscore_model(self, hf_sd: StateDict) -> dict[str, torch.Tensor]:
        """A sequence-classification state dict (score_model's, or one transformers saved) under the names
        to_hf_state_dict gives, which from_hf_state_dict reads."""
        back = {hf: ours for ours, hf in self.score_names.items()}
        return {back.get(k, k): v for k, v in hf_sd.items()}

    def token_ids(self, *, bos: int | None, eos: int | None, pad: int | None) -> dict[str, int]:
        """The token-id fields of config.json (and generation_config.json) for the tokenizer's
        ids, in the order they are written; ids that are None are left out. The default, a decoder's:
        the ids it generates from and stops at."""
        return known_ids(bos_token_id=bos, eos_token_id=eos)


def known_ids(**ids: int | None) -> dict[str, int]:
    """The ids that are set, as ints, in the order given."""
    return {name: int(value) for name, value in ids.items() if value is not None}


# Llama-style decoders (LlamaForCausalLM's names, shared by Qwen3, Mixtral, DeepSeek-V3) ---------

# Our top-level names -> HF's, and the prefix of HF's layer N (ours: "layers.N.").
DECODER_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
DECODER_LAYERS = "model.layers."
# Per layer, under each side's layer prefix.
ATTENTION_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
BLOCK_NORM_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
DENSE_MLP_NAMES = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}


def decoder_config(args, *, max_position_embeddings: int | None = None) -> dict[str, Any]:
    """The config.json fields transformers' Llama-style decoders (Llama, Qwen3, Mixtral, DeepSeek-V3)
    share, from a DecoderArgs with rope_theta; a family's adapter adds its model_type, MLP sizes and
    RoPE variant."""
    return {
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "max_position_embeddings": max_position_embeddings or args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": float(args.rope_theta),
        "tie_word_embeddings": args.tie_word_embeddings,
    }


def rope_settings(cfg: Mapping[str, Any]) -> tuple[dict, str]:
    """(the RoPE settings, their rope_type) of a config.json: transformers 5.x nests them (with
    rope_theta) in rope_parameters, 4.x has rope_theta beside rope_scaling."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    return rope, rope.get("rope_type", rope.get("type", "default"))


def unscaled_rope_theta(cfg: Mapping[str, Any], default: float) -> float:
    """rope_theta of a config.json whose RoPE is unscaled; ValueError for any other rope_type."""
    rope, rope_type = rope_settings(cfg)
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r} (only unscaled RoPE)")
    return float(rope.get("rope_theta", cfg.get("rope_theta", default)))


def interleaved_to_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of a q/k projection from pair-interleaved RoPE order (ours, Meta's, torchtitan's: pairs
    (x[2i], x[2i+1]) of each head rotate together) to rotate-half order (HF's: x[i] with
    x[i + head_dim/2]). The attention scores are unchanged when q's and k's rows move alike."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return w.view(n_heads, head_dim // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def half_to_interleaved(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Inverse of interleaved_to_half."""
    out_dim, in_dim = w.shape
    head_dim = out_dim // n_heads
    return w.view(n_heads, 2, head_dim // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def _qk_rope_layout(convert):
    """(our per-layer name, tensor, args) -> tensor with `convert` (one RoPE row order to the
    other) applied to the q/k projections and QK-norm weights; other tensors unchanged."""
    def change(name: str | None, value: torch.Tensor, args) -> torch.Tensor:
        if name == "attention.wq.weight":
            return convert(value, args.n_heads)
        if name == "attention.wk.weight":
            return convert(value, args.num_kv_heads)
        if name in ("attention.q_norm.weight", "attention.k_norm.weight"):  # one head's features
            return convert(value.view(-1, 1), 1).view(-1)
        return value

    return change


# Our q/k rows (and QK-norm weights) in HF's rotate-half order, and back; (our per-layer name or
# None, tensor, args) -> tensor.
TO_HALF = _qk_rope_layout(interleaved_to_half)
TO_INTERLEAVED = _qk_rope_layout(half_to_interleaved)


__all__ = [
    "ATTENTION_NAMES", "BLOCK_NORM_NAMES", "COMMON_RULES", "COMPARED", "COUNT", "DECODER_LAYERS", "DECODER_RULES",
    "DECODER_TOP", "DENSE_MLP_NAMES", "FLAG", "HFAdapter", "INDEX", "MOE_RULES", "NON_NEGATIVE", "POSITIVE", "ROPE",
    "Rule", "TEXT", "check_config_values", "list_of", "one_or_list", "optional", "table",
    "TO_HALF", "TO_INTERLEAVED", "decoder_config", "half_to_interleaved", "interleaved_to_half", "known_ids",
    "rope_settings", "unscaled_rope_theta",
]
