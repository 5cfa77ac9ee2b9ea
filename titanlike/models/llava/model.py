"""LLaVA: a ViT vision tower (CLIP or SigLIP), a two-layer MLP projector and a decoder family of ours.

    image -> patches (a strided conv) [+ CLIP's class token] + learned positions [-> CLIP's pre-norm]
          -> pre-norm encoder blocks (bidirectional attention, biases, LayerNorm)
          -> the features of the layer LLaVA reads [minus the class token: "default" selection]
          -> projector: linear, GELU, linear (vision width -> text width)
    text tokens -> the decoder's embeddings; every `<image>` placeholder token takes one image
    feature, in order -> the decoder's blocks, norm and output.

The tower holds only the layers LLaVA reads: Hugging Face's vision_feature_layer -2 (LLaVA-1.5) takes
the output of the second-to-last layer, so the last one (and the towers' final norm, which LLaVA
never applies) is not built: it would get no gradient and cost memory. The adapter maps
num_hidden_layers and vision_feature_layer to the layers built (hf_adapter.py).

The language model is any registered decoder family whose forward takes `embeddings` (the Decoder
skeleton of models/common/decoder.py); it is built through the registry, never imported.

Pipeline stages: the tower and the projector go with the embeddings to the first stage (the spec's
pipeline_ends), the language model's blocks are split as a decoder's, its norm and output go to the
last. `layer_costs` adds the images' forward FLOPs to the first layer's, so the balanced split gives
the first stage fewer blocks when the images weigh.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from titanlike.models import protocol
from titanlike.models.args import AttentionShape, BaseModelArgs, LayoutDegrees
from titanlike.models.common.attention import Attention, DocumentMask, core_attention
from titanlike.models.common.block import TransformerBlock
from titanlike.models.common.feed_forward import GeluMLP
from titanlike.models.common.init import LinearInit, normal_, trunc_normal_, zeros_
from titanlike.models.common.norms import init_norm
from titanlike.models.common.image_tokens import image_index as placeholder_index

TOWERS = ("clip", "siglip")
PARTS = ("vision_tower", "projector", "language_model")
SELECT_STRATEGIES = ("default", "full")
# The language model's pipeline ends (inputs, outputs) llava's split cuts it at (the Decoder skeleton's,
# llama3's): the tower and projector join its input end on the first stage.
TEXT_ENDS = (("tok_embeddings",), ("norm", "output"))
# Hugging Face's activation names (hidden_act, projector_hidden_act) that the towers and the projector use.
ACTIVATIONS = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),  # CLIP's
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),  # SigLIP's
    "gelu": F.gelu,  # LLaVA's projector
}


@dataclass
class VisionArgs:
    """A ViT tower as LLaVA runs it. kind "clip": a class token, a LayerNorm before the blocks, a patch
    conv without bias; "siglip": no class token, no pre-norm, a patch conv with bias. n_layers: the
    layers built, the ones up to the feature layer LLaVA reads. select "default" drops the first
    token of the features (CLIP's class token), "full" keeps every token (Hugging Face's
    vision_feature_select_strategy)."""

    kind: str = "clip"
    image_size: int = 336
    patch_size: int = 14
    num_channels: int = 3
    dim: int = 1024
    n_layers: int = 23
    n_heads: int = 16
    ffn_dim: int = 4096
    norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    select: str = "default"

    def __post_init__(self) -> None:
        for name, value, known in (("kind", self.kind, TOWERS), ("select", self.select, SELECT_STRATEGIES),
                                   ("hidden_act", self.hidden_act, tuple(ACTIVATIONS))):
            if value not in known:
                raise ValueError(f"vision.{name} is {value!r}; expected one of {', '.join(known)}")
        if self.image_size % self.patch_size:
            raise ValueError(f"vision.image_size {self.image_size} is not a multiple of vision.patch_size "
                             f"{self.patch_size}")
        if self.dim % self.n_heads:
            raise ValueError(f"vision.dim {self.dim} is not divisible by vision.n_heads {self.n_heads}")

    @property
    def class_token(self) -> bool:
        return self.kind == "clip"

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_positions(self) -> int:
        return self.num_patches + int(self.class_token)

    @property
    def tokens_per_image(self) -> int:
        """Features one image gives the text: every position, less the first under "default"."""
        return self.num_positions - int(self.select == "default")

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        d = self.dim
        patch = self.num_channels * self.patch_size**2 * d + (d if self.kind == "siglip" else 0)
        class_token_and_pre_norm = 3 * d if self.class_token else 0
        ends = patch + class_token_and_pre_norm
        positions = 0 if exclude_embedding else self.num_positions * d
        block = 4 * d * d + 4 * d + 2 * d * self.ffn_dim + self.ffn_dim + d + 4 * d
        return ends + positions + self.n_layers * block


@dataclass
class LlavaArgs(BaseModelArgs):
    """The tower, the projector and the language model. language_model: the registered family of the
    decoder; text: its args (that family's args class; a dict from a checkpoint sidecar is read as
    one). image_token_id: the `<image>` placeholder the image features replace."""

    vision: VisionArgs = dataclasses.field(default_factory=VisionArgs)
    language_model: str = "llama3"
    text: Any = None
    image_token_id: int = 32000
    projector_act: str = "gelu"
    projector_bias: bool = True
    # Parts left untrained (requires_grad off), of PARTS: LLaVA's stage 1 trains the projector only.
    frozen: tuple[str, ...] = ()
    # Images the tower encodes per sample: the job's llava.max_images (every sample carries that many,
    # missing ones as zeros). The FLOPs and the pipeline stages' balance count them.
    images_per_sample: int = 1

    def __post_init__(self) -> None:
        from titanlike.models.registry import get_model_spec

        self.frozen = tuple(self.frozen)
        unknown = [name for name in self.frozen if name not in PARTS]
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not a part of llava; its parts: {', '.join(PARTS)}")
        if set(self.frozen) == set(PARTS):
            raise ValueError(f"every part of llava is frozen ({', '.join(PARTS)}): nothing would train")

        if isinstance(self.vision, dict):
            self.vision = VisionArgs(**self.vision)
        try:
            spec = get_model_spec(self.language_model)
        except KeyError as e:
            raise ValueError(f"language_model: {e.args[0]}") from None
        if "embeddings" not in _forward_keywords(spec.model_cls):
            raise ValueError(f"language_model {self.language_model!r} cannot take image features: its forward has "
                             "no `embeddings` input (a decoder family built on models/common/decoder.py has one)")
        if isinstance(self.text, dict):
            self.text = spec.args_cls.from_dict(self.text)
        if not isinstance(self.text, spec.args_cls):
            raise ValueError(f"text must be {self.language_model}'s args ({spec.args_cls.__name__}), "
                             f"got {type(self.text).__name__}")
        if self.projector_act not in ACTIVATIONS:
            raise ValueError(f"projector_act is {self.projector_act!r}; expected one of {', '.join(ACTIVATIONS)}")

    def with_overrides(self, overrides, *, option: str = "model.args") -> LlavaArgs:
        """[model.args]: `text.<key>` keys go to the language model's args (its own names and aliases:
        text.hidden_size, text.num_layers, ...), the others (vision.dim, image_token_id, ...) are ours."""
        text = {k.split(".", 1)[1]: v for k, v in overrides.items() if k.startswith("text.")}
        own = {k: v for k, v in overrides.items() if not k.startswith("text.")}
        args = super().with_overrides(own, option=option) if own else self
        if not text:
            return args
        return dataclasses.replace(args, text=args.text.with_overrides(text, option=f"{option}.text"))

    # The job's sizes go to the language model; the tower's are its own.
    def update_from_config(self, *, vocab_size: int, seq_len: int, decoder_seq_len: int | None = None) -> LlavaArgs:
        return dataclasses.replace(self, text=self.text.update_from_config(vocab_size=vocab_size, seq_len=seq_len))

    @property
    def context_len(self) -> int:
        return self.text.context_len

    def with_context_len(self, context_len: int) -> LlavaArgs:
        return dataclasses.replace(self, text=self.text.with_context_len(context_len))

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size

    @property
    def num_layers(self) -> int:
        return self.text.num_layers

    @property
    def total_layers(self) -> int:
        return self.text.total_layers

    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    def reported_losses(self) -> tuple[str, ...]:
        return self.text.reported_losses()

    def projector_params(self) -> int:
        t, v = self.text.hidden_size, self.vision.dim
        return v * t + t * t + (2 * t if self.projector_bias else 0)

    def num_params(self, *, exclude_embedding: bool = False, active: bool = False) -> int:
        return (self.vision.num_params(exclude_embedding=exclude_embedding) + self.projector_params()
                + self.text.num_params(exclude_embedding=exclude_embedding, active=active))

    def moe_args(self):
        return self.text.moe_args()

    def with_moe_args(self, moe) -> LlavaArgs:
        return dataclasses.replace(self, text=self.text.with_moe_args(moe))

    def image_flops(self) -> int:
        """Training FLOPs of one image through the tower and the projector, in the decoders' count
        (6 per parameter and position, 12 L d P per position for attention over its P positions,
        bidirectional)."""
        v = self.vision
        positions = v.num_positions
        tower = positions * (6 * v.num_params(exclude_embedding=True) + 12 * v.n_layers * v.dim * positions)
        return tower + 6 * self.projector_params() * v.tokens_per_image

    def flops_per_token(self, seq_len: int) -> int:
        # The language model's, plus the images' of a sample of seq_len tokens.
        return self.text.flops_per_token(seq_len) + self.images_per_sample * self.image_flops() // seq_len

    def layer_costs(self, seq_len: int) -> list[float]:
        """Forward FLOPs per token of each language-model layer (its own family's layer_costs, or its
        FLOPs less the output projection's, spread evenly), the first layer's plus the images' tower
        and projector: they run on the first pipeline stage, which that layer always joins, so the
        balanced split gives that stage fewer layers when the images weigh."""
        text, n = self.text, self.text.num_layers
        costs = text.layer_costs(seq_len)
        if costs is None:
            per_layer = (text.flops_per_token(seq_len) / 3 - 2 * text.vocab_size * text.hidden_size) / n
            costs = [max(per_layer, 0.0)] * n
        costs = list(costs)
        costs[0] += self.images_per_sample * self.image_flops() / (3 * seq_len)
        return costs

    def attention_shape(self) -> AttentionShape | None:
        return self.text.attention_shape()

    def validate(self, dims: LayoutDegrees, *, seq_len: int) -> None:
        # Context parallelism splits the text only (the objective hands each rank its placeholders'
        # image rows, models/common/image_tokens.py image_index); every cp rank encodes the images whole.
        self.text.validate(dims, seq_len=seq_len)
        if dims.tp > 1:
            from titanlike.models.registry import get_model_spec

            if get_model_spec(self.language_model).shard is None:
                raise ValueError(f"language_model {self.language_model} has no tensor-parallel plan, so "
                                 "parallelism.tensor_parallel_degree must be 1")
            v = self.vision
            for name, value in (("n_heads", v.n_heads), ("ffn_dim", v.ffn_dim)):
                if value % dims.tp:
                    raise ValueError(f"the vision tower's {name} {value} must be divisible by "
                                     f"parallelism.tensor_parallel_degree {dims.tp} (its heads and MLP are split)")
        if dims.pp > 1:
            from titanlike.models.registry import get_model_spec

            ends = get_model_spec(self.language_model).pipeline_ends
            if ends is None or (ends.inputs, ends.outputs) != TEXT_ENDS:
                raise ValueError(f"llava splits its language model into pipeline stages at {TEXT_ENDS[0][0]} and "
                                 f"{'/'.join(TEXT_ENDS[1])}, which {self.language_model} does not end with; set "
                                 "parallelism.pipeline_parallel_degree 1")
        if self.image_token_id >= self.text.vocab_size:
            raise ValueError(f"the image token id {self.image_token_id} is outside the vocabulary of "
                             f"{self.text.vocab_size} tokens")


def _forward_keywords(cls: type) -> set[str]:
    import inspect

    return set(inspect.signature(cls.forward).parameters)


class VisionMLP(GeluMLP):
    """fc1, activation, fc2 with biases (w1, w2 as every MLP here): CLIP's quick GELU or SigLIP's tanh GELU."""

    def __init__(self, dim: int, hidden_dim: int, act: str):
        super().__init__(dim, hidden_dim, bias=True)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(ACTIVATIONS[self.act](self.w1(x)))


class VisionAttention(Attention):
    """The tower's bidirectional attention over one image's positions (wq, wk, wv, wo with biases,
    split by heads under tensor parallelism as every attention's). It carries no `core_attention`
    hook (models/protocol.py): context parallelism splits the text, never the patches, which every
    cp rank encodes whole, so it must not switch this attention to its cross-rank kernel."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__(dim, n_heads, n_heads, dim // n_heads, bias=True, causal=False)
        del self.core_attention

    def forward(self, x: torch.Tensor, rope: torch.Tensor | None = None,
                mask: DocumentMask | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism this rank holds only its local heads.
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = core_attention(q, k, v, None, causal=False)  # every position sees every position
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class VisionTower(nn.Module):
    """pixel values (images, channels, height, width) -> features (images, positions, dim) of the last
    layer built; no final norm (LLaVA reads the blocks' output)."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        d = args.dim
        self.patch_embedding = nn.Conv2d(args.num_channels, d, args.patch_size, stride=args.patch_size,
                                         bias=args.kind == "siglip")
        self.class_embedding = nn.Parameter(torch.empty(d)) if args.class_token else None
        self.position_embedding = nn.Embedding(args.num_positions, d)
        self.pre_norm = nn.LayerNorm(d, eps=args.norm_eps) if args.class_token else None
        init = LinearInit(std=0.02, out_std=0.02 / math.sqrt(2 * max(args.n_layers, 1)))
        self.layers = nn.ModuleDict({str(i): TransformerBlock(
            i, attention=VisionAttention(d, args.n_heads),
            feed_forward=VisionMLP(d, args.ffn_dim, args.hidden_act),
            attention_norm=nn.LayerNorm(d, eps=args.norm_eps), ffn_norm=nn.LayerNorm(d, eps=args.norm_eps),
            init=init) for i in range(args.n_layers)})

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        a = self.args
        if pixel_values.shape[-3:] != (a.num_channels, a.image_size, a.image_size):
            raise ValueError(f"images are {tuple(pixel_values.shape[-3:])} (channels, height, width), but the vision "
                             f"tower takes {(a.num_channels, a.image_size, a.image_size)}")
        weight = self.patch_embedding.weight
        h = self.patch_embedding(pixel_values.to(weight.dtype)).flatten(2).transpose(1, 2)
        if self.class_embedding is not None:
            h = torch.cat([self.class_embedding.to(h.dtype).expand(h.shape[0], 1, -1), h], dim=1)
        h = h + self.position_embedding.weight
        if self.pre_norm is not None:
            h = self.pre_norm(h)
        for layer in self.layers.values():
            h = layer(h, None)
        return h

    @torch.no_grad()
    def init_weights(self, *, seed: int, prefix: str) -> None:
        d = self.args.dim
        # The patch conv is a linear map of patch_size^2 * channels inputs: its std scales as such.
        fan_in = self.args.num_channels * self.args.patch_size**2
        trunc_normal_(self.patch_embedding.weight, std=fan_in**-0.5, a=-2 * fan_in**-0.5, b=2 * fan_in**-0.5,
                      seed=seed, fqn=f"{prefix}patch_embedding.weight")
        if self.patch_embedding.bias is not None:
            zeros_(self.patch_embedding.bias)
        if self.class_embedding is not None:
            normal_(self.class_embedding, std=d**-0.5, seed=seed, fqn=f"{prefix}class_embedding")
        normal_(self.position_embedding.weight, std=0.02, seed=seed, fqn=f"{prefix}position_embedding.weight")
        if self.pre_norm is not None:
            init_norm(self.pre_norm)
        for key, layer in self.layers.items():
            layer.init_weights(seed=seed, prefix=f"{prefix}layers.{key}.")


class Projector(nn.Module):
    """LLaVA's two-layer MLP from the tower's width to the language model's."""

    def __init__(self, vision_dim: int, text_dim: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(vision_dim, text_dim, bias=bias)
        self.linear_2 = nn.Linear(text_dim, text_dim, bias=bias)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(ACTIVATIONS[self.act](self.linear_1(x)))

    @torch.no_grad()
    def init_weights(self, *, seed: int, prefix: str) -> None:
        for name in ("linear_1", "linear_2"):
            linear = getattr(self, name)
            std = linear.in_features**-0.5
            trunc_normal_(linear.weight, std=std, a=-2 * std, b=2 * std, seed=seed, fqn=f"{prefix}{name}.weight")
            if linear.bias is not None:
                zeros_(linear.bias)


class ImageSplice(nn.Module):
    """Every `<image>` placeholder's embedding replaced by its image-feature row: (embeddings (batch,
    seq, dim), index (batch, seq), the row each token takes of `features` (rows, dim) or -1 for a
    text token) -> embeddings. A module of its own (without parameters) so that tensor parallelism
    can hand it the index of this rank's slice of the sequence (models/llava/sharding.py)."""

    def forward(self, h: torch.Tensor, index: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        rows = features.to(h.dtype)[index.clamp(0, features.shape[0] - 1)]
        return torch.where((index >= 0)[..., None], rows, h)


class Llava(nn.Module):
    """tokens (batch, seq) with `<image>` placeholders and pixel values -> logits (batch, seq, vocab).

    `layers` (the unit of per-block wrapping) are the language model's. It generates through the
    language model's cache: the prefill splices the images into the prompt's embeddings, and the
    decode steps, text only, are the language model's own.
    """

    def __init__(self, args: LlavaArgs):
        super().__init__()
        from titanlike.models.registry import get_model_spec

        self.model_args = args
        self.vision_tower = VisionTower(args.vision)
        self.projector = Projector(args.vision.dim, args.text.hidden_size, args.projector_act, args.projector_bias)
        self.splice = ImageSplice()
        self.language_model = get_model_spec(args.language_model).model_cls(args.text)
        # The language model's tied names, under its prefix here.
        self.tied_weights = {f"language_model.{alias}": f"language_model.{owner}"
                             for alias, owner in protocol.tied_weights(self.language_model).items()}
        # The optimizer takes only parameters that require grad; to_empty and FSDP keep the flag.
        for name in args.frozen:
            getattr(self, name).requires_grad_(False)

    @property
    def layers(self) -> nn.ModuleDict:
        return self.language_model.layers

    @property
    def extra_layers(self) -> tuple[nn.ModuleDict, ...]:
        # The tower's blocks: checkpointed, compiled and FSDP-sharded block by block like the language model's.
        return (self.vision_tower.layers,) if self.vision_tower is not None else ()

    def tie_weights(self) -> None:
        protocol.retie_weights(self.language_model)

    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """(images, channels, height, width) -> what replaces each image's placeholders, (images,
        tokens_per_image, text dim)."""
        features = self.vision_tower(pixel_values)
        if self.model_args.vision.select == "default":
            features = features[:, 1:]
        return self.projector(features)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                mask: DocumentMask | None = None, *, pixel_values: torch.Tensor | None = None,
                image_index: torch.Tensor | None = None) -> torch.Tensor:
        """pixel_values: None (text only), (images, C, H, W) taken in the order their placeholders
        appear in the batch (Hugging Face's layout), or (batch, images, C, H, W): each sample's
        placeholders take its own images in order (images it has no placeholders for are unused,
        padding). Each image fills vision.tokens_per_image consecutive placeholders.
        image_index (batch, seq), with (batch, images, C, H, W) pixel values: which of its sample's
        image-feature rows each token takes, -1 for text (models/common/image_tokens.py image_index),
        when the tokens are a slice of the sequence (context parallelism) that cannot count the
        placeholders before it; None: counted from the tokens."""
        lm = self.language_model
        if lm.tok_embeddings is None:  # a later pipeline stage: `tokens` are the hidden states
            return lm(tokens, positions, mask)
        h = lm.embed(tokens, positions)
        if pixel_values is not None:
            h = self._splice(tokens, h, pixel_values, image_index)
        return lm(tokens, positions, mask, embeddings=h)

    def _splice(self, tokens: torch.Tensor, h: torch.Tensor, pixel_values: torch.Tensor,
                image_index: torch.Tensor | None = None) -> torch.Tensor:
        if pixel_values.dim() == 5:
            batch, count = pixel_values.shape[:2]
            if batch != tokens.shape[0]:
                raise ValueError(f"pixel_values hold images for {batch} samples, but the batch has {tokens.shape[0]}")
            features = self.image_features(pixel_values.flatten(0, 1))
            rows = count * features.shape[1]
            if image_index is None:
                image_index = placeholder_index(tokens, self.model_args.image_token_id)
                # Each sample's placeholders fill whole images, no more than it has.
                placeholders = (image_index >= 0).sum(1)
                fits = ((placeholders <= rows) & (placeholders % features.shape[1] == 0)).all()
            else:  # a slice of the sequence: the objective checked the whole (image_index)
                fits = (image_index < rows).all()
            # Row j of sample b's images is row b * rows + j of them all; -1 (text) stays -1.
            offset = torch.arange(batch, device=tokens.device)[:, None] * rows
            index = torch.where(image_index >= 0, image_index + offset, -1)
        elif pixel_values.dim() == 4:
            if image_index is not None:
                raise ValueError("image_index goes with pixel_values of (batch, images, C, H, W): its rows are "
                                 "counted within each sample's images")
            features = self.image_features(pixel_values)
            is_image = tokens == self.model_args.image_token_id
            index = torch.where(is_image, is_image.flatten().cumsum(0).view_as(tokens) - 1, -1)
            fits = is_image.sum() == features.shape[0] * features.shape[1]
        else:
            raise ValueError(f"pixel_values must be (images, C, H, W) or (batch, images, C, H, W), got "
                             f"{tuple(pixel_values.shape)}")
        # A device assertion, not a host sync: the trainer's step reads nothing back.
        torch._assert_async(fits, "the <image> placeholders do not match the images: each image takes "
                                  f"{features.shape[1]} placeholders, in order")
        return self.splice(h, index, features.flatten(0, 1))

    # Generation (models/protocol.py) ------------------------------------------------------------

    def init_cache(self, batch_size: int, capacity: int, *, device: torch.device | str, dtype: torch.dtype):
        return self.language_model.init_cache(batch_size, capacity, device=device, dtype=dtype)

    @torch.no_grad()
    def prefill(self, tokens: torch.Tensor, lengths: torch.Tensor, cache, *, start_id: int | None = None,
                pixel_values: torch.Tensor | None = None) -> torch.Tensor:
        """The language model's prefill on the prompts' embeddings with the images spliced in
        (pixel_values (batch, images, C, H, W), each row's own images, or (images, C, H, W) in the
        order of their placeholders, as forward takes them)."""
        lm = self.language_model
        h = lm.embed(tokens, None)
        if pixel_values is not None:
            h = self._splice(tokens, h, pixel_values)
        cache.begin_prefill(lengths, tokens.shape[1])
        logits = lm(tokens, cache=cache, embeddings=h)
        cache.end_prefill()
        return logits[:, -1]

    @torch.no_grad()
    def decode_step(self, tokens: torch.Tensor, cache) -> torch.Tensor:
        return self.language_model.decode_step(tokens, cache)

    @torch.no_grad()
    def init_weights(self, seed: int = 0, buffer_device: torch.device | str | None = None) -> None:
        for name in ("vision_tower", "projector"):  # None on a pipeline stage other than the first
            if getattr(self, name) is not None:
                getattr(self, name).init_weights(seed=seed, prefix=f"{name}.")
        self.language_model.init_weights(seed=seed, buffer_device=buffer_device)


__all__ = ["PARTS", "TEXT_ENDS", "ImageSplice", "Llava", "LlavaArgs", "Projector", "VisionArgs", "VisionAttention",
           "VisionTower"]
