"""Hugging Face interchange for LLaVA: LlavaForConditionalGeneration with a CLIPVisionModel or a
SiglipVisionModel tower and any language model one of our families reads.

The language model's config and weights go through its own family's adapter (found in the registry
by text_config's model_type); this adapter adds the tower, the projector and the top-level keys.

What LLaVA never computes is not held here (model.py):
- vision_feature_layer k selects the hidden state after layer k (negative: counted from the end,
  -1 the last layer's output): the tower is built with exactly those layers, and the tower's later
  layers, its final LayerNorm and SigLIP's pooling head are dropped on import;
- on export the tower is written as the layers we hold with vision_feature_layer -1, which selects
  the same features, and its final LayerNorm (which LLaVA does not apply) as the identity.

Keys: transformers 5 keeps modules under model.* in memory and writes language_model.model.*,
language_model.lm_head.*, vision_tower.* and multi_modal_projector.* to disk (the 4.x layout, with
vision_tower.vision_model.*, is read too); we write what its save_pretrained writes.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

import torch

from titanlike.models.common.hf import COMMON_RULES, COMPARED, COUNT, FLAG, INDEX, POSITIVE, TEXT, HFAdapter, \
    StateDict, list_of, optional, table
from titanlike.models.llava.model import LlavaArgs, VisionArgs

VISION_MODEL_TYPES = {"clip_vision_model": "clip", "siglip_vision_model": "siglip"}

# Our tower's names -> Hugging Face's (under vision_tower.), per layer under layers.N. / encoder.layers.N.
VISION_TOP = {
    "patch_embedding.weight": "embeddings.patch_embedding.weight",
    "patch_embedding.bias": "embeddings.patch_embedding.bias",
    "class_embedding": "embeddings.class_embedding",
    "position_embedding.weight": "embeddings.position_embedding.weight",
    "pre_norm.weight": "pre_layrnorm.weight",
    "pre_norm.bias": "pre_layrnorm.bias",
}
VISION_LAYER = {
    f"{ours}.{kind}": f"{theirs}.{kind}" for kind in ("weight", "bias") for ours, theirs in (
        ("attention.wq", "self_attn.q_proj"), ("attention.wk", "self_attn.k_proj"),
        ("attention.wv", "self_attn.v_proj"), ("attention.wo", "self_attn.out_proj"),
        ("attention_norm", "layer_norm1"), ("ffn_norm", "layer_norm2"),
        ("feed_forward.w1", "mlp.fc1"), ("feed_forward.w2", "mlp.fc2"))
}
# Hugging Face tower tensors LLaVA never reads (see the module docstring).
UNUSED_VISION = re.compile(r"^(post_layernorm\.|head\.|embeddings\.position_ids$)")

# transformers 4 wrote a LLaVA config's text_config and vision_config as their differences from the
# defaults of their config class (llava-hf/llava-1.5-7b-hf's text_config holds 7 keys, no
# hidden_size), and transformers 5 reads them with those defaults: LlamaConfig's, CLIPVisionConfig's,
# SiglipVisionConfig's, and LlavaConfig's own for an absent sub-config (CLIP ViT-L/14 at 336 px).
TEXT_DEFAULTS = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
              "tie_word_embeddings": False, "rope_theta": 10000.0},
}
_VIT = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
        "num_channels": 3, "image_size": 224}
VISION_DEFAULTS = {
    "clip_vision_model": {**_VIT, "patch_size": 32, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5},
    "siglip_vision_model": {**_VIT, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6},
}
ABSENT_VISION = {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                 "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336, "patch_size": 14}
ABSENT_TEXT = {"model_type": "llama"}

VISION_RULES = table({
    "model_type": TEXT, "hidden_size": COUNT, "intermediate_size": COUNT, "num_hidden_layers": COUNT,
    "num_attention_heads": COUNT, "num_channels": COUNT, "image_size": COUNT, "patch_size": COUNT,
    "hidden_act": TEXT, "layer_norm_eps": POSITIVE,
})


def _feature_layer(value: Any) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and -10_000 <= value <= 10_000
    return None if ok else "an integer (several feature layers are not supported)"


class LlavaHF(HFAdapter):
    model_types = ("llava",)
    config_rules = {
        **COMMON_RULES, "text_config": table({"model_type": TEXT}), "vision_config": VISION_RULES,
        "image_token_index": INDEX, "image_token_id": INDEX, "vision_feature_layer": _feature_layer,
        "vision_feature_select_strategy": TEXT, "projector_hidden_act": TEXT,
        "multimodal_projector_bias": FLAG, "image_seq_length": optional(COUNT),
        "vision_feature_layers": optional(list_of(COMPARED)),
    }

    @staticmethod
    def _text_spec(args_or_family):
        from titanlike.models.registry import get_model_spec

        family = args_or_family.language_model if isinstance(args_or_family, LlavaArgs) else args_or_family
        spec = get_model_spec(family)
        if spec.hf is None:
            raise ValueError(f"the language model family {family} has no Hugging Face adapter")
        return spec

    # config.json -------------------------------------------------------------------------------

    def config_to_args(self, cfg: Mapping[str, Any]) -> LlavaArgs:
        from titanlike.models.registry import spec_for_hf_model_type

        text_cfg, vision_cfg = cfg.get("text_config") or ABSENT_TEXT, cfg.get("vision_config") or ABSENT_VISION
        if not isinstance(text_cfg, Mapping) or not isinstance(vision_cfg, Mapping):
            raise ValueError("text_config and vision_config must both be objects")
        text_cfg = {**TEXT_DEFAULTS.get(text_cfg.get("model_type"), {}), **text_cfg}
        vision_cfg = {**VISION_DEFAULTS.get(vision_cfg.get("model_type"), {}), **vision_cfg}
        try:
            text_spec = spec_for_hf_model_type(text_cfg.get("model_type"))
        except KeyError as e:
            raise ValueError(f"text_config: {e.args[0]}") from None
        text = text_spec.hf.read_config(text_cfg)
        kind = VISION_MODEL_TYPES.get(vision_cfg.get("model_type"))
        if kind is None:
            raise ValueError(f"vision_config model_type {vision_cfg.get('model_type')!r} is not supported; supported: "
                             f"{', '.join(VISION_MODEL_TYPES)}")
        depth = vision_cfg["num_hidden_layers"]
        layer = cfg.get("vision_feature_layer", -2)
        # hidden_states[k]: the embeddings for k = 0, the output of layer k after; negative from the end.
        used = depth + 1 + layer if layer < 0 else layer
        if not 0 <= used <= depth:
            raise ValueError(f"vision_feature_layer {layer} is outside the tower's {depth} layers")
        vision = VisionArgs(
            kind=kind, image_size=vision_cfg["image_size"], patch_size=vision_cfg["patch_size"],
            num_channels=vision_cfg["num_channels"], dim=vision_cfg["hidden_size"], n_layers=used,
            n_heads=vision_cfg["num_attention_heads"], ffn_dim=vision_cfg["intermediate_size"],
            norm_eps=float(vision_cfg["layer_norm_eps"]), hidden_act=vision_cfg["hidden_act"],
            select=cfg.get("vision_feature_select_strategy", "default"))
        image_token = cfg.get("image_token_index", cfg.get("image_token_id", 32000))
        return LlavaArgs(vision=vision, language_model=text_spec.name, text=text, image_token_id=image_token,
                         projector_act=cfg.get("projector_hidden_act", "gelu"),
                         projector_bias=cfg.get("multimodal_projector_bias", True))

    def args_to_config(self, args: LlavaArgs, *, max_position_embeddings: int | None = None) -> dict[str, Any]:
        v = args.vision
        text = self._text_spec(args).hf.args_to_config(args.text, max_position_embeddings=max_position_embeddings)
        vision = {
            "model_type": next(t for t, k in VISION_MODEL_TYPES.items() if k == v.kind),
            "hidden_size": v.dim, "intermediate_size": v.ffn_dim, "num_hidden_layers": v.n_layers,
            "num_attention_heads": v.n_heads, "num_channels": v.num_channels, "image_size": v.image_size,
            "patch_size": v.patch_size, "hidden_act": v.hidden_act, "layer_norm_eps": v.norm_eps,
            "attention_dropout": 0.0,
        }
        if v.kind == "siglip":
            vision["vision_use_head"] = False  # SigLIP's pooling head: LLaVA does not use it
        return {
            "architectures": ["LlavaForConditionalGeneration"],
            "model_type": "llava",
            "text_config": text,
            "vision_config": vision,
            "image_token_index": args.image_token_id,
            "image_seq_length": v.tokens_per_image,
            "projector_hidden_act": args.projector_act,
            "vision_feature_layer": -1,  # the last layer of the tower as written: the one LLaVA reads
            "vision_feature_select_strategy": v.select,
            "multimodal_projector_bias": args.projector_bias,
            "tie_word_embeddings": text.get("tie_word_embeddings", False),
        }

    def extra_files(self, args: LlavaArgs, special_tokens: Mapping[str, int]) -> dict[str, dict]:
        """The export writes the tower's preprocessor_config.json (ModelSpec.images, data/images.py
        ImageProcessor.hf_config); here it gets LLaVA's processor class and, with the image token among
        the tokenizer's special tokens, processor_config.json too, so that AutoProcessor builds a
        LlavaProcessor that expands it to the tokens an image takes here."""
        v = args.vision
        files = {"preprocessor_config.json": {"processor_class": "LlavaProcessor"}}
        token = next((t for t, i in special_tokens.items() if i == args.image_token_id), None)
        if token is not None:
            # LlavaProcessor: (size // patch)**2 + num_additional_image_tokens, less one for "default".
            patches = (v.image_size // v.patch_size) ** 2
            files["processor_config.json"] = {
                "processor_class": "LlavaProcessor", "image_token": token, "patch_size": v.patch_size,
                "vision_feature_select_strategy": v.select,
                "num_additional_image_tokens": v.tokens_per_image - patches + (v.select == "default")}
        return files

    def compose(self, vision_config: Mapping[str, Any], vision_sd: StateDict, text_config: Mapping[str, Any],
                text_sd: StateDict, *, image_token_id: int, feature_layer: int = -2,
                select: str | None = None) -> tuple[LlavaArgs, dict[str, torch.Tensor]]:
        """(args, LLaVA state dict with Hugging Face names, the projector left out) of a pretrained vision
        tower and a causal LM from separate folders: LLaVA's starting point for stage 1. The tower's
        folder is a CLIPVisionModel / SiglipVisionModel, or a whole CLIPModel / SiglipModel (its vision
        half is taken); select defaults to "default" for CLIP (drop the class token), "full" for SigLIP."""
        if vision_config.get("model_type") in ("clip", "siglip"):
            vision_config = {**(vision_config.get("vision_config") or {}),
                             "model_type": f"{vision_config['model_type']}_vision_model"}
        kind = VISION_MODEL_TYPES.get(vision_config.get("model_type"))
        config = {"model_type": "llava", "text_config": dict(text_config), "vision_config": dict(vision_config),
                  "vision_feature_layer": feature_layer, "image_token_index": image_token_id,
                  "vision_feature_select_strategy": select or ("default" if kind == "clip" else "full")}
        args = self.read_config(config)
        hf_sd: dict[str, torch.Tensor] = {}
        for key, value in vision_sd.items():
            if key.startswith(("text_model.", "visual_projection.", "text_projection.", "logit_scale", "logit_bias")):
                continue  # the text half of a contrastive model
            hf_sd["vision_tower." + key.removeprefix("vision_model.")] = value
        for key, value in text_sd.items():
            hf_sd["language_model." + key] = value
        return args, hf_sd

    # weights -----------------------------------------------------------------------------------

    def to_hf_state_dict(self, sd: StateDict, args: LlavaArgs) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        text: dict[str, torch.Tensor] = {}
        for key, value in sd.items():
            name = _strip_wrappers(key)
            if name.startswith("vision_tower."):
                out["vision_tower." + _vision_to_hf(name[len("vision_tower."):])] = value
            elif name.startswith("projector."):
                out["multi_modal_projector." + name[len("projector."):]] = value
            elif name.startswith("language_model."):
                text[name[len("language_model."):]] = value
            else:
                raise KeyError(f"unexpected LLaVA parameter {key!r}")
        like = out.get("vision_tower.embeddings.position_embedding.weight")
        if like is not None:  # a whole tower (not some of its tensors: LoRA names one linear at a time)
            dim = args.vision.dim
            out["vision_tower.post_layernorm.weight"] = torch.ones(dim, dtype=like.dtype)
            out["vision_tower.post_layernorm.bias"] = torch.zeros(dim, dtype=like.dtype)
        # model.* and lm_head.* of the causal LM, under language_model. as transformers writes them.
        if text:
            for key, value in self._text_spec(args).hf.to_hf_state_dict(text, args.text).items():
                out["language_model." + key] = value
        return out

    def module_name(self, hf_name: str) -> str:
        # transformers (4.52 on) holds LLaVA as model.{vision_tower, multi_modal_projector, language_model}
        # and lm_head, and renames the checkpoint's keys (which it still writes) when it loads them.
        part, rest = _split_hf_key(hf_name)
        if part == "vision":
            return "model.vision_tower." + rest
        if part == "projector":
            return "model.multi_modal_projector." + rest
        return "model.language_model." + rest.removeprefix("model.") if rest.startswith("model.") else rest

    def from_hf_state_dict(self, hf_sd: StateDict, args: LlavaArgs) -> dict[str, torch.Tensor]:
        sd: dict[str, torch.Tensor] = {}
        text: dict[str, torch.Tensor] = {}
        for key, value in hf_sd.items():
            part, rest = _split_hf_key(key)
            if part == "vision":
                name = _vision_from_hf(rest, args.vision)
                if name is not None:
                    sd["vision_tower." + name] = value
            elif part == "projector":
                sd["projector." + rest] = value
            else:
                text[rest] = value
        if text:  # (a state dict of some tensors, as LoRA's modules_to_save reads, may hold none)
            for key, value in self._text_spec(args).hf.from_hf_state_dict(text, args.text).items():
                sd["language_model." + key] = value
        return sd


def _strip_wrappers(key: str) -> str:
    for prefix in ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module."):
        key = key.replace(prefix, "")
    return key


def _vision_to_hf(name: str) -> str:
    if name in VISION_TOP:
        return VISION_TOP[name]
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    if match is None or match.group(2) not in VISION_LAYER:
        raise KeyError(f"unexpected LLaVA vision parameter {name!r}")
    return f"encoder.layers.{match.group(1)}.{VISION_LAYER[match.group(2)]}"


_VISION_TOP_BACK = {hf: ours for ours, hf in VISION_TOP.items()}
_VISION_LAYER_BACK = {hf: ours for ours, hf in VISION_LAYER.items()}


def _vision_from_hf(name: str, vision: VisionArgs) -> str | None:
    """Our tower's name for a Hugging Face tower tensor, None for one LLaVA never reads."""
    if UNUSED_VISION.match(name):
        return None
    if name in _VISION_TOP_BACK:
        return _VISION_TOP_BACK[name]
    match = re.fullmatch(r"encoder\.layers\.(\d+)\.(.+)", name)
    if match is None or match.group(2) not in _VISION_LAYER_BACK:
        raise KeyError(f"unexpected Hugging Face vision tower parameter {name!r}")
    if int(match.group(1)) >= vision.n_layers:
        return None  # after the feature layer
    return f"layers.{match.group(1)}.{_VISION_LAYER_BACK[match.group(2)]}"


def _split_hf_key(key: str) -> tuple[str, str]:
    """("vision" | "projector" | "text", the rest) of a Hugging Face LLaVA key in any of its layouts; the
    text rest is as a causal LM of its family names it (model.*, lm_head.*)."""
    for prefix in ("model.vision_tower.vision_model.", "vision_tower.vision_model.", "model.vision_tower.",
                   "vision_tower."):
        if key.startswith(prefix):
            return "vision", key[len(prefix):]
    for prefix in ("model.multi_modal_projector.", "multi_modal_projector."):
        if key.startswith(prefix):
            return "projector", key[len(prefix):]
    for prefix, keep in (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."),
                         ("language_model.", "")):
        if key.startswith(prefix):
            return "text", keep + key[len(prefix):]
    raise KeyError(f"unexpected Hugging Face LLaVA parameter {key!r}")


__all__ = ["LlavaHF"]
