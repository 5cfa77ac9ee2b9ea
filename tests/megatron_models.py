"""Tiny megatron-core GPTModels on CPU and the checkpoints Megatron-LM writes of them, for the from-megatron tests.

megatron-core 0.16.1 runs on CPU in this process (world size 1, gloo over an in-memory store) with
transformer_impl "local" and its fusions off, except for three places that name CUDA whatever the device
(`reference_logits` stands in for them): RotaryEmbedding.get_emb moves its frequencies to
torch.cuda.current_device(), the unfused softmax builds its default causal mask on "cuda" (an explicit
mask avoids it), and DotProductAttention forks the CUDA RNG tracker around its dropout (0 here). An MoE
layer's router moves its weight to torch.cuda.current_device() too, and computes its logits with Transformer
Engine's GEMM (router_gating_linear), replaced by the same product in torch; the allgather token dispatcher
needs no CUDA stream (alltoall's does). Multi-head latent attention (MLASelfAttention) builds its core attention
with Transformer Engine's arguments (k_channels, v_channels, softmax_scale), which the local
DotProductAttention does not take: `MLACoreAttention` stands in for it (the softmax of the scaled scores under
the causal mask; the projections, norms and RoPE around it are megatron-core's own).

The legacy GroupedMLP (`--moe-grouped-gemm` without Transformer Engine) needs the grouped_gemm package, which
does not run on CPU: `save_torch(grouped_mlp=True)` writes SequentialMLP's experts in GroupedMLP's layout as its
forward and sharded_state_dict define it (megatron/core/transformer/moe/experts.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import warnings
from unittest import mock

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": the local path is meant
    warnings.simplefilter("ignore")
    from megatron.core import parallel_state
    from megatron.core import tensor_parallel as mcore_tp
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.transformer.moe import router as moe_router
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

# The families' flavors the tests convert into (titanlike/models/llama3 debugmodel_tiny, gpt2 debugmodel),
# as megatron-core TransformerConfig fields.
FAMILIES = {
    "llama3": dict(flavor="debugmodel_tiny", num_layers=8, hidden_size=64, num_attention_heads=4,
                   num_query_groups=2, ffn_hidden_size=192, normalization="RMSNorm", gated_linear_unit=True,
                   activation_func=F.silu, add_bias_linear=False, rope=True, tied=False, max_seq=2048),
    "gpt2": dict(flavor="debugmodel", num_layers=4, hidden_size=256, num_attention_heads=8,
                 num_query_groups=8, ffn_hidden_size=1024, normalization="LayerNorm", gated_linear_unit=False,
                 activation_func=lambda x: F.gelu(x, approximate="tanh"), openai_gelu=True,  # --openai-gelu
                 add_bias_linear=True, rope=False, tied=True, max_seq=1024),
    # Mixtral's debugmodel with 2 of its 8 layers (converted with --model.args num_layers=2): 8 experts, top 2.
    "mixtral": dict(flavor="debugmodel", model_args="num_layers=2", num_layers=2, hidden_size=256,
                    num_attention_heads=16, num_query_groups=8, ffn_hidden_size=256, normalization="RMSNorm",
                    gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, rope=True, tied=False,
                    max_seq=2048, rotary_base=1000000, rope_scaling=False,
                    moe=dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=256, moe_grouped_gemm=False,
                             moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="aux_loss",
                             moe_aux_loss_coeff=0.02)),
    # Qwen3's debugmodel_moe with 2 of its 8 layers: QK-norm, layer 0 dense, layer 1 MoE (8 experts, top 2).
    "qwen3": dict(flavor="debugmodel_moe", model_args="num_layers=2", num_layers=2, hidden_size=256,
                  num_attention_heads=16, num_query_groups=8, ffn_hidden_size=768, normalization="RMSNorm",
                  gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, rope=True, tied=False,
                  max_seq=2048, rotary_base=1000000, rope_scaling=False, eps=1e-6, qk_layernorm=True,
                  moe=dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128, moe_grouped_gemm=False,
                           moe_token_dispatcher_type="allgather", moe_router_load_balancing_type="aux_loss",
                           moe_aux_loss_coeff=0.01, moe_layer_freq=[0, 1])),
    # DeepSeek-V3's debugmodel with 2 of its 4 layers, no multi-token prediction and no expert groups (see
    # deepseek_v3/megatron_adapter.py): MLA with the low-rank query, layer 0 dense, layer 1 sigmoid-routed experts
    # with the expert bias and a shared expert.
    "deepseek_v3": dict(flavor="debugmodel",
                        model_args="num_layers=2,mtp_num_layers=0,moe.n_groups=1,moe.topk_groups=1",
                        num_layers=2, hidden_size=256, num_attention_heads=8, num_query_groups=8, ffn_hidden_size=768,
                        normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                        rope=True, tied=False, max_seq=2048, rotary_base=10000, rope_scaling=False, eps=1e-6,
                        qk_layernorm=True,
                        mla=dict(q_lora_rank=128, kv_lora_rank=64, qk_head_dim=32, qk_pos_emb_head_dim=16,
                                 v_head_dim=32, rope_type="rope", rotary_base=10000, rotary_scaling_factor=1.0),
                        moe=dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=128, moe_grouped_gemm=False,
                                 moe_token_dispatcher_type="allgather", moe_router_score_function="sigmoid",
                                 moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=2.5,
                                 moe_shared_expert_intermediate_size=128, moe_router_load_balancing_type="seq_aux_loss",
                                 moe_aux_loss_coeff=1e-4, moe_layer_freq=[0, 1])),
}


def convert_options(family: str) -> list[str]:
    """from-megatron's options naming the family's test flavor (and the sizes that differ from it)."""
    f = FAMILIES[family]
    return ["--model.name", family, "--model.flavor", f["flavor"],
            *(["--model.args", f["model_args"]] if "model_args" in f else [])]


@contextlib.contextmanager
def megatron_world():
    """megatron-core's parallel state for one CPU process (tensor and pipeline parallel 1), torn down after."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        if owned:
            dist.destroy_process_group()


class MLACoreAttention(torch.nn.Module):
    """Causal attention of (seq, batch, heads, features) q, k, v with megatron-core's softmax scale, in place
    of Transformer Engine's DotProductAttention that MLASelfAttention's layer spec names."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **unused):
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, q, k, v, attention_mask, **unused):
        seq = q.shape[0]
        scores = torch.einsum("sbnd,tbnd->bnst", q, k) * self.softmax_scale
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
        return torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v).flatten(2)


def build_model(family: str, *, vocab_size: int, seed: int = 0, **sizes) -> GPTModel:
    """A megatron-core GPTModel of the family's test flavor (changed by `sizes`: FAMILIES' keys), fp32 on
    CPU, with random weights (norms too)."""
    f = {**FAMILIES[family], **sizes}
    torch.manual_seed(seed)
    with warnings.catch_warnings():  # megatron-core's deprecation notes about arguments it defaults itself
        warnings.simplefilter("ignore")
        config = (MLATransformerConfig if "mla" in f else TransformerConfig)(
            num_layers=f["num_layers"], hidden_size=f["hidden_size"], num_attention_heads=f["num_attention_heads"],
            num_query_groups=f["num_query_groups"], ffn_hidden_size=f["ffn_hidden_size"],
            normalization=f["normalization"], gated_linear_unit=f["gated_linear_unit"],
            activation_func=f["activation_func"], add_bias_linear=f["add_bias_linear"],
            layernorm_epsilon=f.get("eps", 1e-5), qk_layernorm=f.get("qk_layernorm", False),
            hidden_dropout=0.0, attention_dropout=0.0, params_dtype=torch.float32, use_cpu_initialization=True,
            gradient_accumulation_fusion=False, persist_layer_norm=False, bias_activation_fusion=False,
            masked_softmax_fusion=False, apply_rope_fusion=False, bias_dropout_fusion=False,
            rotary_interleaved=f.get("rotary_interleaved", False), **f.get("moe", {}), **f.get("mla", {}),
        )
        if "moe" in f:  # dense and MoE layers as config.moe_layer_freq says
            layer_spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False,
                                                    normalization=f["normalization"])
        else:
            layer_spec = get_gpt_layer_local_spec(normalization=f["normalization"])
        for spec in getattr(layer_spec, "layer_specs", ()):
            if "mla" in f:
                spec.submodules.self_attention.submodules.core_attention = MLACoreAttention
        # HAVE_TE: MLA asks whether its linear_proj is Transformer Engine's, which the import it guards left None.
        with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"), \
                mock.patch.object(multi_latent_attention, "HAVE_TE", False):
            model = GPTModel(
                config, layer_spec, vocab_size=vocab_size, max_sequence_length=f["max_seq"],
                position_embedding_type="rope" if f["rope"] else "learned_absolute",
                share_embeddings_and_output_weights=f["tied"], rotary_base=f.get("rotary_base", 500000),
                # Llama 3.1's RoPE scaling (megatron-core's defaults: factor 8, low 1, high 4, original 8192).
                rope_scaling=f.get("rope_scaling", f["rope"]), rope_scaling_factor=8.0,
            )
    with torch.no_grad():  # norms start at 1 and biases at 0: draw them so that a swapped name shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):  # the aux-loss-free balancing bias moves the routing only
                b.add_(0.1 * torch.randn_like(b))
    return model.eval()


def reference_logits(model: GPTModel, tokens: torch.Tensor) -> torch.Tensor:
    """megatron-core's logits (batch, seq, vocab) for int64 tokens (batch, seq)."""
    seq = tokens.shape[1]
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]

    class NoRngTracker:  # the dropout it would fork the CUDA RNG for has probability 0
        def fork(self, *args, **kwargs):
            return contextlib.nullcontext()

    def router_gating_linear(inp, weight, bias, dtype):
        return F.linear(inp.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))

    with mock.patch.object(torch.cuda, "current_device", lambda: "cpu"), \
            mock.patch.object(mcore_tp, "get_cuda_rng_tracker", lambda *a, **k: NoRngTracker()), \
            mock.patch.object(moe_router, "router_gating_linear", router_gating_linear), \
            warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # tp_group defaults, deprecated
        return model(tokens, torch.arange(seq)[None].expand_as(tokens), attention_mask=mask)


def megatron_args(family: str, *, tp: int = 1, pp: int = 1) -> argparse.Namespace:
    """A few of the args Megatron-LM pickles into every model_optim_rng.pt, with the kinds of values it
    holds: a torch dtype, a megatron-core enum, strings, numbers, lists."""
    f = FAMILIES[family]
    args = argparse.Namespace(
        num_layers=f["num_layers"], hidden_size=f["hidden_size"], num_attention_heads=f["num_attention_heads"],
        norm_epsilon=f.get("eps", 1e-5), rotary_base=f.get("rotary_base", 500000 if f["rope"] else 10000),
        use_rope_scaling=f.get("rope_scaling", f["rope"]), rope_scaling_factor=8.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, params_dtype=torch.float32,
        attention_backend=AttnBackend.auto, ckpt_format="torch", transformer_impl="local",
        tokenizer_type="GPT2BPETokenizer", lr=3e-4, data_path=["data/x_text_document"], iteration=10,
        openai_gelu=f.get("openai_gelu", False))
    for key, value in {**f.get("moe", {}), **f.get("mla", {})}.items():  # Megatron-LM's args of the same names
        if isinstance(value, (int, float, str, list)):
            vars(args).setdefault(key, value)
    return args


def save_torch(model: GPTModel, save: str, family: str, *, iteration: int = 10, tp: int = 1, pp: int = 1,
               te: bool = False, grouped_mlp: bool = False, **settings) -> str:
    """Megatron-LM's --ckpt-format torch checkpoint of `model` under `save` (as its save_checkpoint writes:
    the tracker file, iter_XXXXXXX/mp_rank_TT[_PPP]/model_optim_rng.pt holding args, checkpoint_version,
    iteration, model, optimizer, opt_param_scheduler and rng_state), the weights split over tp x pp ranks as
    megatron-core partitions them. te: as Transformer Engine's layer spec names and partitions them: the
    experts as its grouped MLP (`mlp.experts.linear_fc1.weightE`) rather than SequentialMLP's, MLA's latent norms
    fused into the up projections (`linear_q_up_proj.layer_norm_weight`) and its down projections whole on every
    rank (TELinear, duplicated). grouped_mlp: the experts in the legacy GroupedMLP's two matrices. settings:
    args to record otherwise than megatron_args does. Returns the iteration folder."""
    folder = os.path.join(save, f"iter_{iteration:07d}")
    full = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    if te:
        full = {re.sub(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)", r"mlp.experts.\2\1", k): v
                for k, v in full.items()}
        full = {re.sub(r"self_attention\.(q|kv)_layernorm\.weight$",
                       r"self_attention.linear_\1_up_proj.layer_norm_weight", k): v for k, v in full.items()}
    n_layers = FAMILIES[family]["num_layers"]
    per_stage = n_layers // pp
    for p in range(pp):
        stage = {}
        for key, value in full.items():
            if key.startswith("decoder.layers."):
                layer, inner = key[len("decoder.layers."):].split(".", 1)
                if int(layer) // per_stage == p:
                    stage[f"decoder.layers.{int(layer) - p * per_stage}.{inner}"] = value
            elif key.startswith("embedding.") and p == 0:
                stage[key] = value
            elif not key.startswith(("embedding.", "decoder.layers.")) and p == pp - 1:
                stage[key] = value
        if FAMILIES[family]["tied"] and pp > 1 and p == pp - 1:
            stage["output_layer.weight"] = full["embedding.word_embeddings.weight"]  # the last stage's copy
        for t in range(tp):
            shard = {k: _tp_shard(k, v, t, tp, family, te=te) for k, v in stage.items()}
            if grouped_mlp:
                shard = _grouped_mlp(shard)
            # Extra state as the local layers (None) and Transformer Engine's (FP8 metadata serialized into a
            # uint8 tensor) hold it.
            shard.update({k.replace("weight", "_extra_state"): None for k in shard if k.endswith("linear_qkv.weight")})
            shard.update({k.replace("weight", "_extra_state"): torch.zeros(16, dtype=torch.uint8) for k in shard
                          if k.endswith("linear_proj.weight")})
            rank_dir = os.path.join(folder, f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
            os.makedirs(rank_dir, exist_ok=True)
            torch.save({
                "args": argparse.Namespace(**{**vars(megatron_args(family, tp=tp, pp=pp)), **settings}),
                "checkpoint_version": 3.0,
                "iteration": iteration,
                "model": shard,
                "optimizer": {"optimizer": {"state": {0: {"exp_avg": torch.zeros(3)}},
                                            "param_groups": [{"lr": 3e-4, "params": [0]}]},
                              "fp32_from_fp16_params": []},
                "opt_param_scheduler": {"max_lr": 3e-4, "num_steps": iteration * 8},
                "rng_state": [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
                               "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
                               "rng_tracker_states": {}}],
            }, os.path.join(rank_dir, "model_optim_rng.pt"))
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return folder


def _grouped_mlp(shard: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One rank's SequentialMLP experts as the legacy GroupedMLP holds them: weight1 (hidden, experts x fc1 rows)
    with memory (experts, hidden, fc1 rows), weight2 (experts x fc2 columns, hidden) with memory (experts, fc2
    columns, hidden), as GroupedMLP.forward views them (megatron/core/transformer/moe/experts.py)."""
    out, experts = {}, {}
    for key, value in shard.items():
        m = re.fullmatch(r"(decoder\.layers\.\d+\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12])\.weight", key)
        if m:
            experts.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = value
        else:
            out[key] = value
    for (prefix, kind), by_index in experts.items():
        stacked = torch.stack([by_index[e].t() for e in range(len(by_index))])
        hidden = stacked.shape[1] if kind == "linear_fc1" else stacked.shape[2]
        out[prefix + ("weight1" if kind == "linear_fc1" else "weight2")] = (
            stacked.reshape(hidden, -1) if kind == "linear_fc1" else stacked.reshape(-1, hidden))
    return out


def _tp_shard(key: str, value: torch.Tensor, rank: int, tp: int, family: str, *, te: bool = False) -> torch.Tensor:
    """Rank `rank`'s part of a full megatron-core parameter: ColumnParallelLinear keeps a slice of the output
    features (of each half of a gated linear_fc1: megatron-core splits gate and up alike and stacks its two
    slices), RowParallelLinear a slice of the input features (its bias whole), VocabParallelEmbedding a slice
    of the rows; the rest is whole on every rank. MLA's down projections are column-parallel in the local
    layer spec, whole on every rank in Transformer Engine's (te)."""
    if tp == 1 or (te and key.endswith(("linear_q_down_proj.weight", "linear_kv_down_proj.weight"))):
        return value.clone()
    key = re.sub(r"(weight|bias)\d+$", r"\1", key)  # a grouped expert's weightE partitions as weight
    if key.endswith(("linear_fc1.weight", "linear_fc1.bias")) and FAMILIES[family]["gated_linear_unit"]:
        gate, up = value.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]]).clone()
    if key.endswith(("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias",
                     "word_embeddings.weight", "output_layer.weight", "linear_q_proj.weight", "linear_q_up_proj.weight",
                     "linear_kv_up_proj.weight", "linear_q_down_proj.weight", "linear_kv_down_proj.weight")):
        return value.chunk(tp, dim=0)[rank].clone()
    if key.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return value.chunk(tp, dim=1)[rank].clone()
    return value.clone()


def save_torch_dist(model: GPTModel, save: str, family: str, *, iteration: int = 10) -> str:
    """Megatron-LM's --ckpt-format torch_dist checkpoint of `model` under `save`: the model's sharded state
    dict through megatron.core.dist_checkpointing.save into iter_XXXXXXX/, and the tracker file. Its writer
    forks a process to write the files and starts a multiprocessing manager. Returns the iteration folder."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    folder = os.path.join(save, f"iter_{iteration:07d}")
    os.makedirs(folder, exist_ok=True)
    # The writer synchronizes CUDA after staging the tensors on the host, and all-reduces its verdict on
    # torch.cuda.current_device(), whatever the tensors' device.
    with mock.patch.object(torch.cuda, "synchronize", lambda *a: None), \
            mock.patch.object(torch.cuda, "current_device", lambda: "cpu"):
        dist_checkpointing.save({
            "model": model.sharded_state_dict(),
            "args": megatron_args(family), "checkpoint_version": 3.0, "iteration": iteration,  # into common.pt
            "rng_state": ShardedObject("rng_state", [{"torch_rng_state": torch.get_rng_state()}], (1,), (0,)),
        }, folder)
    with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return folder
