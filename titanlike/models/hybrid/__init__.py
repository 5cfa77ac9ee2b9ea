"""Hybrid family: Mamba-2 layers mixed with attention, MLP and MoE layers by Megatron's pattern string
(model.py), NVIDIA's Nemotron-H models, pure Mamba-2 models, and CPU-sized debug models.

Hyper-parameters: Nemotron-H from NVIDIA's Megatron-Bridge providers and Hugging Face configs
(nvidia/Nemotron-H-8B-Base-8K, Nemotron-H-56B-Base-8K: squared-ReLU MLPs, grouped-query
attention without position encoding, Mamba-2 with 8 groups, chunk 128); mamba2_2.7b from
state-spaces/mamba2-2.7b (64 Mamba-2 layers, one group, chunk 256, tied embeddings). vocab_size
and max_seq_len are placeholders the trainer overwrites (update_from_config); max_seq_len is the
context the model was trained at.
"""

import dataclasses
from dataclasses import dataclass

from titanlike.config.schema import opt
from titanlike.models.common.mamba2 import Mamba2Args
from titanlike.models.common.moe import MoEArgs
from titanlike.models.hybrid.hf_adapter import HybridHF
from titanlike.models.hybrid.model import HybridModel, HybridModelArgs
from titanlike.models.hybrid.sharding import hybrid_sharding
from titanlike.models.registry import ModelOptions, ModelSpec, PipelineEnds, register_model_spec

NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"
NEMOTRON_H_56B_PATTERN = ("M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-"
                          "M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-")
DEBUG_VOCAB = 2256  # the debug tokenizer's


def _nemotron_h(dim: int, pattern: str, n_heads: int, ffn: int, mamba_heads: int, state: int) -> HybridModelArgs:
    # transformers' NemotronH clamps dt at time_step_min (0.001): the same here, so exports match.
    mamba = Mamba2Args(num_heads=mamba_heads, head_dim=64, state_size=state, n_groups=8, chunk_size=128,
                       dt_limit_min=0.001)
    return HybridModelArgs(dim=dim, hybrid_layer_pattern=pattern, vocab_size=131072, max_seq_len=8192,
                           n_heads=n_heads, n_kv_heads=8, head_dim=128, ffn_hidden_dim=ffn, mamba=mamba)


hybrid_flavors: dict[str, HybridModelArgs] = {
    # CPU-sized, the width of llama3's debugmodel: 16 layers, 7 Mamba-2, 2 attention, 7 MLP.
    "debugmodel": HybridModelArgs(
        dim=256, hybrid_layer_pattern="M-M-M*-M-M-M*-M-", vocab_size=DEBUG_VOCAB, max_seq_len=2048,
        n_heads=16, n_kv_heads=8, head_dim=16, ffn_hidden_dim=1024,
        mamba=Mamba2Args(num_heads=8, head_dim=64, state_size=64, n_groups=2, chunk_size=64, dt_limit_min=0.001),
    ),
    # Tiny, for parity tests: every layer kind, two Mamba-2 groups (TP 2), short chunks (several per
    # 64-token sequence and per context-parallel piece).
    "debugmodel_tiny": HybridModelArgs(
        dim=64, hybrid_layer_pattern="M-M*M-", vocab_size=DEBUG_VOCAB, max_seq_len=2048,
        n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden_dim=128,
        mamba=Mamba2Args(num_heads=4, head_dim=32, state_size=16, n_groups=2, chunk_size=16, dt_limit_min=0.001),
    ),
    # With mixture-of-experts layers (E: our SwiGLU experts, sigmoid routing as Nemotron-H's).
    "debugmodel_moe": HybridModelArgs(
        dim=256, hybrid_layer_pattern="M-ME*-ME", vocab_size=DEBUG_VOCAB, max_seq_len=2048,
        n_heads=16, n_kv_heads=8, head_dim=16, ffn_hidden_dim=1024,
        mamba=Mamba2Args(num_heads=8, head_dim=64, state_size=64, n_groups=2, chunk_size=64, dt_limit_min=0.001),
        moe=MoEArgs(num_experts=8, top_k=2, hidden_dim=256, num_shared_experts=1, score_func="sigmoid",
                    route_norm=True, aux_loss_coeff=0.01),
    ),
    # Pure Mamba-2 at debug size (exported as Mamba2ForCausalLM), one group as the released models.
    "debugmodel_mamba2": HybridModelArgs(
        dim=256, hybrid_layer_pattern="M" * 8, vocab_size=DEBUG_VOCAB, max_seq_len=2048, tie_word_embeddings=True,
        mamba=Mamba2Args(num_heads=8, head_dim=64, state_size=64, n_groups=1, chunk_size=64),
    ),
    "nemotron_h_8b": _nemotron_h(4096, NEMOTRON_H_8B_PATTERN, n_heads=32, ffn=21504, mamba_heads=128, state=128),
    "nemotron_h_56b": _nemotron_h(8192, NEMOTRON_H_56B_PATTERN, n_heads=64, ffn=32768, mamba_heads=256, state=256),
    # state-spaces/mamba2-2.7b: d_model 2560, 64 layers, expand 2 (80 heads of 64), d_state 128,
    # one group, chunk 256, GPT-NeoX vocabulary padded to 50288, tied embeddings.
    "mamba2_2.7b": HybridModelArgs(
        dim=2560, hybrid_layer_pattern="M" * 64, vocab_size=50288, max_seq_len=2048, tie_word_embeddings=True,
        mamba=Mamba2Args(num_heads=80, head_dim=64, state_size=128, n_groups=1, chunk_size=256),
    ),
}


@dataclass
class HybridOptions:
    """[hybrid]: the job's own layer pattern."""

    layer_pattern: str = opt(
        "", "Megatron's --hybrid-layer-pattern, one character per layer (M Mamba-2, * attention, - MLP, E MoE): "
        "replaces the flavor's layer pattern; empty keeps the flavor's")


def _with_options(args: HybridModelArgs, options: HybridOptions) -> HybridModelArgs:
    if not options.layer_pattern:
        return args
    return dataclasses.replace(args, hybrid_layer_pattern=options.layer_pattern)


register_model_spec(
    ModelSpec(
        name="hybrid",
        model_cls=HybridModel,
        flavors=hybrid_flavors,
        shard=hybrid_sharding,
        pipeline_ends=PipelineEnds(inputs=("tok_embeddings",), outputs=("norm", "output")),
        hf=HybridHF(),
        options=ModelOptions("hybrid", HybridOptions, _with_options,
                             renamed={"model.hybrid_layer_pattern": "layer_pattern"}),
    )
)

__all__ = ["HybridModel", "HybridModelArgs", "HybridOptions", "NEMOTRON_H_56B_PATTERN", "NEMOTRON_H_8B_PATTERN",
           "hybrid_flavors", "hybrid_sharding"]
