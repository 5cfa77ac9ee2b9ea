"""LLaVA: a CLIP or SigLIP vision tower, a two-layer MLP projector and a decoder family of ours as the
language model (model.py); Hugging Face's LlavaForConditionalGeneration both ways (hf_adapter.py).

The language model's args are its own family's class, got from the registry (a family imports no
other family). vocab_size and max_seq_len of the language model are placeholders the trainer
overwrites, as for the decoder families.
"""

import dataclasses
from dataclasses import dataclass

from titanlike.config.schema import opt
from titanlike.models.llava.hf_adapter import LlavaHF
from titanlike.models.llava.model import PARTS, TEXT_ENDS, Llava, LlavaArgs, VisionArgs
from titanlike.models.registry import (
    ImageInputs,
    ModelOptions,
    ModelSpec,
    PipelineEnds,
    get_model_spec,
    register_model_spec,
)

_llama = get_model_spec("llama3").args_cls


def _debug_text():
    # llama3's debugmodel_tiny at 2 layers, without RoPE scaling (as the LLaVA-1.5 language model).
    return _llama(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=2256, multiple_of=32,
                  rope_theta=10000.0, max_seq_len=2048)


def _clip_vit_l_336():
    # LLaVA-1.5's tower: CLIP ViT-L/14 at 336 px, read at its layer 23 of 24 (vision_feature_layer -2).
    return VisionArgs(kind="clip", image_size=336, patch_size=14, dim=1024, n_layers=23, n_heads=16, ffn_dim=4096,
                      norm_eps=1e-5, hidden_act="quick_gelu", select="default")


def _vicuna(dim: int, n_layers: int, mlp_width: int):
    # Vicuna (Llama 2's shapes: heads of 128, no grouped keys) with LLaVA-1.5's vocabulary of 32064. Its
    # MLP width is spelled multiple_of=mlp_width, the rule the Llama adapter reads back for a width no
    # Llama 3 flavor has.
    return _llama(dim=dim, n_layers=n_layers, n_heads=dim // 128, n_kv_heads=dim // 128, vocab_size=32064,
                  multiple_of=mlp_width, norm_eps=1e-5, rope_theta=10000.0, max_seq_len=4096)


# <|image|>, a special token of the debug tokenizer (and of Llama 3's): no text encodes to it.
DEBUG_IMAGE_TOKEN = 1803

llava_flavors: dict[str, LlavaArgs] = {
    # CPU-sized: a 32x32 image in 16 patches of 8x8 (16 image tokens once CLIP's class token is dropped).
    "debugmodel": LlavaArgs(
        vision=VisionArgs(kind="clip", image_size=32, patch_size=8, dim=48, n_layers=2, n_heads=4, ffn_dim=96,
                          norm_eps=1e-5, hidden_act="quick_gelu", select="default"),
        text=_debug_text(), image_token_id=DEBUG_IMAGE_TOKEN),
    "debugmodel_siglip": LlavaArgs(
        vision=VisionArgs(kind="siglip", image_size=32, patch_size=8, dim=48, n_layers=2, n_heads=4, ffn_dim=96,
                          norm_eps=1e-6, hidden_act="gelu_pytorch_tanh", select="full"),
        text=_debug_text(), image_token_id=DEBUG_IMAGE_TOKEN),
    # llava-hf/llava-1.5-7b-hf and -13b-hf: LLaVA-1.5's tower, Vicuna-7B / -13B, the <image> token at 32000.
    "llava-1.5-7b": LlavaArgs(vision=_clip_vit_l_336(), text=_vicuna(4096, 32, 11008), image_token_id=32000),
    "llava-1.5-13b": LlavaArgs(vision=_clip_vit_l_336(), text=_vicuna(5120, 40, 13824), image_token_id=32000),
}



def image_caption_options(cfg, args: LlavaArgs) -> dict:
    """The family's objective, image_caption (objectives/image_caption.py): captions of images,
    processed as the tower's transformers processor does."""
    v = args.vision
    options = cfg.llava
    return dict(image_token_id=args.image_token_id, tokens_per_image=v.tokens_per_image, image_size=v.image_size,
                processor=v.kind, max_images=options.max_images, max_image_pixels=options.max_image_pixels)


def image_inputs(args: LlavaArgs) -> ImageInputs:
    """A prompt's images as the caption and conversation samples hold them: each image the tower's
    placeholder tokens, its pixels processed as the tower's transformers processor does."""
    v = args.vision
    return ImageInputs(image_token_id=args.image_token_id, tokens_per_image=v.tokens_per_image, processor=v.kind,
                       image_size=v.image_size)


@dataclass
class LlavaOptions:
    """[llava]: the job's training stage."""

    freeze: list[str] = opt(
        [], f"parts left untrained, of {', '.join(PARTS)}: LLaVA's stage 1 (pretraining the projector on "
        "captions) freezes vision_tower,language_model; its stage 2 (instruction tuning) freezes vision_tower")
    max_images: int = opt(1, "images a sample of training.dataset webdataset holds at most (a sample with more is "
                          "counted and skipped); every sample carries this many, the missing ones as zeros")
    max_image_pixels: int = opt(4096 * 4096, "width x height above which an image is counted and skipped (it would "
                                "only be shrunk to the tower's size, at the cost of decoding it)")


def _with_options(args: LlavaArgs, options: LlavaOptions) -> LlavaArgs:
    # Checked here, where planning turns a ValueError into the job's one-sentence refusal.
    if options.max_images < 1:
        raise ValueError(f"llava.max_images must be at least 1, got {options.max_images}")
    if options.max_image_pixels < 1:
        raise ValueError(f"llava.max_image_pixels must be at least 1, got {options.max_image_pixels}")
    args = dataclasses.replace(args, images_per_sample=options.max_images)
    if not options.freeze:
        return args
    try:
        return dataclasses.replace(args, frozen=tuple(options.freeze))
    except ValueError as e:
        raise ValueError(f"llava.freeze: {e}") from None


def _shard(model, tp_mesh, opts) -> None:
    """ModelSpec.shard: llava_sharding, imported when a job is parallelized: its ParallelStyles import
    torch.distributed.tensor, which would cost every start about 0.6 s (models/common/parallel_styles.py)."""
    from titanlike.models.llava.sharding import llava_sharding

    llava_sharding(model, tp_mesh, opts)


register_model_spec(ModelSpec(name="llava", model_cls=Llava, flavors=llava_flavors, shard=_shard,
                              objective="image_caption", objective_options=image_caption_options,
                              images=image_inputs,
                              hf=LlavaHF(), options=ModelOptions("llava", LlavaOptions, _with_options),
                              # The tower and projector go with the embeddings the images are spliced into.
                              pipeline_ends=PipelineEnds(
                                  inputs=("vision_tower", "projector", *(f"language_model.{n}" for n in TEXT_ENDS[0])),
                                  outputs=tuple(f"language_model.{n}" for n in TEXT_ENDS[1]))))

__all__ = ["Llava", "LlavaArgs", "LlavaOptions", "VisionArgs", "llava_flavors"]
