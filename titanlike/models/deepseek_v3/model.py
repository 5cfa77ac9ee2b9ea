"""The DeepSeek-V3 decoder (DeepseekV3ForCausalLM; also Moonlight and DeepSeek-V2-Lite-sized models).

Pre-norm blocks (RMSNorm) with multi-head latent attention (attention.py) and, after the first
first_k_dense dense layers (SwiGLU of ffn_hidden_dim), a mixture of experts: sigmoid scores,
selection on the scores plus a per-expert bias (aux-loss-free balancing; HF's
e_score_correction_bias), limited to the best topk_groups of n_groups expert groups, the k gate
values renormalized and multiplied by routed_scaling_factor, plus always-on shared experts. RoPE
covers only each head's qk_rope_head_dim features, optionally with YaRN (DeepSeek-V3: factor 40
over a 4096-token pre-training context), whose mscale correction also enters the softmax scale.

Multi-token prediction (mtp_num_layers D, titanlike/models/common/mtp.py): D modules after the
trunk, entries n_layers .. n_layers+D-1 of `layers` as DeepSeek's checkpoints number them, each a
block of this family's kind (MLA, and an MoE where the layer index says so) behind its input
norms and projection. They embed later tokens with the model's table (`mtp_embeddings`, tied to
tok_embeddings: one Parameter in one process, a copy on the last pipeline stage kept equal by the
tied-weight sync) and predict through the shared output head. The forward runs the trunk itself
and, in training, the prediction modules after it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from titanlike.models.args import AttentionShape
from titanlike.models.common.attention import DocumentMask
from titanlike.models.common.block import TransformerBlock
from titanlike.models.common.decoder import DecoderArgs
from titanlike.models.common.init import normal_
from titanlike.models.common.kv_cache import ModelCache, last_prompt_tokens
from titanlike.models.common.moe import MoEArgs
from titanlike.models.common.moe_decoder import MoEDecoder, depth_scaled_init
from titanlike.models.common.mtp import MTP_LOSS, MTPBlock, multi_token_prediction
from titanlike.models.common.rope import YaRNScaling, precompute_rope_cache, yarn_mscale
from titanlike.models.deepseek_v3.attention import MLA


@dataclass
class DeepSeekV3ModelArgs(DecoderArgs):
    norm_eps: float = 1e-6
    ffn_hidden_dim: int = 18432  # SwiGLU hidden size of the dense layers (HF intermediate_size)
    # Multi-head latent attention.
    q_lora_rank: int = 0  # 0: one query projection (HF q_lora_rank null)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10000.0
    rope_scaling: YaRNScaling | None = None
    # How a Hugging Face checkpoint orders the RoPE rows of wq / wq_b / wkv_a (HF rope_interleave):
    # True, DeepSeek's pair-interleaved order, is ours; False (rotate-half) is permuted on import and
    # export. The model computes the same either way.
    hf_rope_interleave: bool = True
    # Multi-token prediction (HF num_nextn_predict_layers): modules after the trunk and the weight
    # of their loss.
    mtp_num_layers: int = 0
    mtp_loss_weight: float = 0.1

    def __post_init__(self) -> None:
        # DecoderArgs' own checks are grouped-query attention's (dim split into heads); MLA's heads
        # have widths of their own, so only the conversions from a sidecar dict are shared.
        if isinstance(self.moe, dict):
            self.moe = MoEArgs(**self.moe)
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = YaRNScaling(**self.rope_scaling)
        if self.n_kv_heads not in (None, self.n_heads):
            raise ValueError(f"multi-head latent attention has as many key/value heads as query heads "
                             f"({self.n_heads}), got n_kv_heads {self.n_kv_heads}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim <= 0:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even and positive for rotary "
                             "embeddings")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank < 0:
            raise ValueError(f"q_lora_rank must be >= 0 (0: no query compression), got {self.q_lora_rank}")
        if self.mtp_num_layers < 0 or self.mtp_loss_weight < 0:
            raise ValueError("mtp_num_layers and mtp_loss_weight must be >= 0")
        if self.mtp_num_layers and self.tie_word_embeddings:
            raise ValueError("multi-token prediction with tied input and output embeddings is not supported "
                             "(DeepSeek models do not tie them)")

    @property
    def total_layers(self) -> int:
        return self.n_layers + self.mtp_num_layers

    @property
    def lookahead_tokens(self) -> int:
        return self.mtp_num_layers

    def reported_losses(self) -> tuple[str, ...]:
        return (MTP_LOSS,) if self.mtp_num_layers else ()

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def head_dim(self) -> int:
        """What the attention kernel sees per head of q and k."""
        return self.qk_head_dim

    @property
    def softmax_scale_factor(self) -> float:
        """The softmax scale over qk_head_dim^-0.5: YaRN's mscale(factor, mscale_all_dim)^2 when the
        context is stretched with mscale_all_dim set (DeepSeek's and transformers' yarn_get_mscale)."""
        s = self.rope_scaling
        if s is None or not s.mscale_all_dim:
            return 1.0
        return yarn_mscale(s.factor, s.mscale_all_dim) ** 2

    # Counting ---------------------------------------------------------------------------------

    def attention_params(self, *, bias: bool = False) -> int:
        """Parameters of one MLA module (projections and the two latent norms)."""
        heads = self.n_heads
        if self.q_lora_rank:
            q = self.dim * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * self.qk_head_dim
        else:
            q = self.dim * heads * self.qk_head_dim
        kv = (self.dim * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
              + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim))
        return q + kv + heads * self.v_head_dim * self.dim

    def block_params(self, layer_id: int, *, active: bool = False) -> int:
        if self.moe is not None and self.moe.is_moe_layer(layer_id):
            mlp = self.moe.params(self.dim, active=active)
        else:
            mlp = 3 * self.dim * self.ffn_hidden_dim
        return self.attention_params() + mlp + 2 * self.dim

    def mtp_params(self, *, active: bool = False) -> int:
        """The multi-token-prediction modules: each a block plus its three norms and eh_proj (the
        embedding table and output head are the model's)."""
        return sum(self.block_params(i, active=active) + 3 * self.dim + 2 * self.dim * self.dim
                   for i in range(self.n_layers, self.total_layers))

    def num_params(self, *, exclude_embedding: bool = False, active: bool = False) -> int:
        """With the prediction modules, as DeepSeek counts them (671B + 14B of MTP = 685B)."""
        blocks = sum(self.block_params(i, active=active) for i in range(self.n_layers))
        return (blocks + self.mtp_params(active=active) + self.dim
                + self.vocab_params(exclude_embedding=exclude_embedding))

    def flops_per_token(self, seq_len: int) -> int:
        """6 N + 6 L H (qk_head_dim + v_head_dim) T: N parameters a token uses (without embeddings;
        routed experts: top_k; each prediction module's pass through the output head once more), L
        layers (trunk and prediction modules), H heads, T = seq_len. The attention term is the usual
        12 L H Q T with the scores' width (qk_head_dim) and the values' (v_head_dim) counted apart:
        per layer and token 2 H T qk_head_dim for q.k and 2 H T v_head_dim for the weighted sum,
        times 3 for forward + backward, over the full T x T scores (non-causal)."""
        n = self.num_params(exclude_embedding=True, active=True) + self.mtp_num_layers * self.vocab_size * self.dim
        return 6 * n + 6 * self.total_layers * self.n_heads * (self.qk_head_dim + self.v_head_dim) * seq_len

    def attention_shape(self) -> AttentionShape:
        return AttentionShape(self.n_heads, self.n_heads, self.qk_head_dim)


class DeepSeekV3(MoEDecoder):
    """DeepSeek-V3: tokens (batch, seq) -> logits (batch, seq, vocab_size).

    The shared MoE decoder (models/common/moe_decoder.py) supplies the RoPE table plumbing, the final
    norm, the MLPs and the embedding init; the blocks' attention (MLA) and prediction modules, the
    table's width and scaling, and the forward over the trunk are this family's.
    """

    def __init__(self, args: DeepSeekV3ModelArgs):
        super().__init__(args)
        for layer_id in range(args.n_layers, args.total_layers):
            self.layers[str(layer_id)] = self.build_block(layer_id)
        self.mtp_embeddings: nn.Embedding | None = None
        if args.mtp_num_layers:
            self.mtp_embeddings = nn.Embedding(args.vocab_size, args.dim)
            self.tied_weights["mtp_embeddings.weight"] = "tok_embeddings.weight"
            self.tie_weights()
        # The objective's weight for the prediction modules' loss (attach_loss): the step's weight
        # tensor, set once at build time; None: 1.
        self.loss_weight: torch.Tensor | None = None

    def build_block(self, layer_id: int) -> nn.Module:
        a = self.model_args
        attention = MLA(a.dim, a.n_heads, q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank,
                        qk_nope_head_dim=a.qk_nope_head_dim, qk_rope_head_dim=a.qk_rope_head_dim,
                        v_head_dim=a.v_head_dim, softmax_scale_factor=a.softmax_scale_factor)
        # Output projections scaled by depth, as torchtitan's DeepSeek-V3.
        parts = dict(attention=attention, attention_norm=self.build_norm(), ffn_norm=self.build_norm(),
                     init=depth_scaled_init(layer_id), **self.build_mlp(layer_id))
        if layer_id >= a.n_layers:
            return MTPBlock(layer_id, dim=a.dim, build_norm=self.build_norm, **parts)
        return TransformerBlock(layer_id, **parts)

    def _rope_cache(self, device) -> torch.Tensor:
        a = self.model_args
        return precompute_rope_cache(a.qk_rope_head_dim, a.max_seq_len, a.rope_theta, a.rope_scaling, device=device)

    def trunk(self) -> Iterator[nn.Module]:
        """The blocks of the main model this module holds (a pipeline stage holds some), in order;
        entries keyed n_layers and above (multi-token prediction) are not part of it."""
        return self._layers(trunk=True)

    def predictors(self) -> list[nn.Module]:
        """The multi-token-prediction modules this module holds (entries n_layers and above)."""
        return list(self._layers(trunk=False))

    def _layers(self, *, trunk: bool) -> Iterator[nn.Module]:
        n = self.model_args.n_layers
        return (layer for key, layer in self.layers.items() if (int(key) < n) == trunk)

    def init_embeddings(self, *, seed: int) -> None:
        super().init_embeddings(seed=seed)
        if self.mtp_embeddings is not None and self.tok_embeddings is None:
            # The last pipeline stage's copy of the table: drawn under the owner's name, so it
            # starts equal to the first stage's (untied output: the Decoder's table init).
            normal_(self.mtp_embeddings.weight, std=1.0, seed=seed, fqn="tok_embeddings.weight")

    def cached_layers(self):
        """Generation runs the trunk; the prediction modules keep no cache."""
        n = self.model_args.n_layers
        return [(key, layer) for key, layer in self.layers.items() if int(key) < n]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                mask: DocumentMask | None = None, lookahead: torch.Tensor | None = None, *,
                cache: ModelCache | None = None) -> torch.Tensor:
        """As Decoder.forward (positions, mask, cache: see there), over the trunk; lookahead (training
        with multi-token prediction, see objectives/causal_lm.py lookahead_targets) adds the prediction
        modules' loss to the objective."""
        h = self.embed(tokens, positions) if self.tok_embeddings is not None else tokens
        rope = self.rotary_angles(positions)
        if cache is None:
            for layer in self.trunk():
                h = layer(h, rope, mask)
        else:
            for key, layer in self.cached_layers():
                h = layer(h, rope, mask, cache=cache.layer(key))
            h = last_prompt_tokens(h, cache)
        if self.output is None:
            return self.norm(h) if self.norm is not None else h
        predictors = self.predictors()
        if predictors and lookahead is not None and self.training:
            h = multi_token_prediction(h, predictors, lookahead, embed=self.mtp_embeddings, head=self.output,
                                       rope=rope, mask=mask, weight=self.model_args.mtp_loss_weight, training=True,
                                       loss_weight=self.loss_weight)
        return self.output(self.norm(h))


__all__ = ["DeepSeekV3", "DeepSeekV3ModelArgs"]
