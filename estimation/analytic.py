"""Closed-form memory per rank for any model family built from the common blocks, under any layout.

What the model is, is read from the family's own meta model (built once per job, see
`model_shape`), never from its args' field names: the parameters and buffers with their shapes,
how the family's own `shard` places them, its pipeline ends and tied weights, and the building
blocks of its transformer block, recognized by module type and by the hooks of
titanlike/models/protocol.py.

Bytes per parameter. Parameters are fp32 masters sharded by FSDP over dp_shard x cp
(HSDP replicas hold the same shard); TP first splits them as the family's shard function
places them: read once per model by applying ModelSpec.shard to a meta copy over a fake 2-rank TP
mesh (no data, no communication) and taking each parameter's DTensor placement. A colwise linear
is split on dim 0 (weight and bias), a rowwise linear on dim 1 of the weight (the bias stays
whole), the vocabulary-split embedding and output projection on dim 0, with ceil division
(uneven vocabulary shards: TP rank 0 holds the larger one); everything replicated stays whole:
norms, a learned position table, MLA's down projections and latent norms, multi-token
prediction's input norms and projection.
Tied weights count once on a stage that holds both ends; a tied table copied to the last pipeline
stage (multi-token prediction's embedding of the lookahead tokens) counts there again, gradient
and AdamW state included. Buffers (a RoPE table)
count their meta-model bytes on every stage that holds them. Gradients take 4 bytes per local
parameter (the reduce dtype is fp32), AdamW 8 (exp_avg and exp_avg_sq). Compute copies: FSDP
all-gathers bf16 (or fp32) copies of the blocks it runs: the root (embedding, final
norm, output) stays gathered through the step, and about two blocks (the current one
and the prefetched next) are gathered at any time; with reshard_after_forward never,
and always under pipeline parallelism, all of them. Without FSDP, bf16 autocast
keeps a bf16 copy of every weight from its forward use to its backward.
Under pipeline parallelism with FSDP, torch's stages accumulate unsharded fp32
gradients across microbatches and reduce them once at the end of the step.
Under TP, torch's DTensor gives the vocabulary-sharded embedding a Replicate
gradient (measured with real tensors: placements (Replicate(),) for a Shard(0)
weight), so the rank holding the embedding briefly holds the whole table's gradient.
float16 compute (training.mixed_precision_param float16, loss-scaled) takes the same bytes as
bfloat16: fp32 masters, 2-byte gathered copies and activations; the loss scale is a scalar.
FSDP CPU offload (training.enable_cpu_offload) moves the sharded fp32 parameters, their
gradients and the AdamW state to host memory, and the optimizer step with them: the device keeps
buffers, the gathered copies, activations and the unsharded gradients of the block being reduced
(under pipeline parallelism, the unsharded accumulators until the end of the step); what moved is
reported as host bytes. A batch ramp-up (training.rampup_batch_size) is estimated at its final
batch, global_batch_size: microbatches only add steps of accumulation, and the full batch holds
accumulated gradients at least as long as any smaller one.

Activations, after Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models"), who count the tensors each layer saves for backward.
Their 34 s b h + 5 a s^2 b bytes per GPT layer assumes dropout and materialized attention
scores; the count is redone for the ops of the common blocks (checked tensor by tensor with
saved-tensor hooks on one Llama block and one GELU/LayerNorm/bias block, ac none, tp 1:
exact to the byte in fp32, bf16 and fp32 under bf16 autocast; tests/unit/test_estimation.py).
Per token of a layer, with e bytes per compute element, r bytes per residual-stream element,
h = hidden size, f = MLP hidden, qd/kvd = query/key-value widths, n = heads, t = TP degree:

    RMSNorm, each (fp32 input, fp32 normalized, fp32 rstd)    (8h + 4) / t
    LayerNorm, each (its input, mean and rstd)                (r h + 2 x 4) / t   (CUDA keeps the
                                                              statistics in fp32; torch's CPU kernel
                                                              in the input dtype: r h + 2 r)
    norm outputs, all-gathered by sequence parallelism        e h per norm   (not / t; under autocast
                                                              once per linear that reads it: 3 for
                                                              attention's wq, wk, wv, 2 for SwiGLU, 1
                                                              for the GELU MLP)
    q, k, v (after RoPE if any), attention output             e (2 qd + 2 kvd) / t
    flash-attention log-sum-exp (fp32)                        4 n / t
    SwiGLU: w1 x, silu(w1 x), w3 x, their product             4 e f / t
    GELU MLP: w1 x + b (gelu's input), gelu(w1 x + b)         2 e f / t

Biases add no saved tensor (addmm keeps its input and weight). Flash attention never stores the
s x s scores, so the a s^2 term is gone. The all-gathered norm outputs are what DTensor's
sequence parallelism saves for the column-parallel matmuls (Megatron saves the shard and gathers
again in backward), so that term does not shrink with TP. Context parallelism divides the
sequence by cp, but all-gather attention saves the gathered keys and values (full length).
A block made of anything else (another block class, another mixer or MLP) is refused with a
ValueError: use the traced estimate for it. Blocks may differ from layer to layer (dense and MoE
layers): every layer is counted with its own shape.

Mixture of experts (a block holding the common MoE module; sizes from its MoEArgs, the contract).
Parameters by placement (`Sharding`, as parallel/expert_parallel.py and parallel/fsdp.py place
them): routed experts split over ep on the expert dimension, then FSDP over efsdp = dp_shard x cp
x tp / ep (on dim 1 when the local experts do not split evenly); the router and shared experts,
whole on every TP rank, FSDP over dp_shard x cp x tp; HSDP replicas hold the same shards. FSDP
gathers a block's experts as one unit: this rank's ep share of them, in the compute dtype.
Activations (`moe_saved_bytes`, checked tensor by tensor like the dense block): the MoE routes the
TP rank's slice of the sequence, tokens = microbatch x seq / (cp x tp); per token the router's fp32
input copy and scores (4 h + 4 E), per routed row (top_k per token; all-to-all brings a rank as many
as it sends on average; dropless routing varies, so a rank whose experts get more holds more) the
row, the experts' SwiGLU (4 e F) and the expert output and gated product (2 e h). Backward adds
the gradients through the experts and, under EP, the all-to-all buffers (`moe_transient_bytes`).

Multi-head latent attention (an attention declaring the latent_attention hook: DeepSeek-V2/V3's
MLA; widths read from the module: heads
H, per-head query/key width qk = nope + rope, value width v, latent ranks c (kv) and r (q, 0 without
the low-rank query); checked tensor by tensor like the other blocks, with and without the low-rank
query, dense and MoE). Per token:

    kv latent norm and its output (kept by wkv_b); q's when low-rank   8c + 4 + e c (+ 8r + 4 + e r)
        (computed whole on every TP rank: not / t)
    q and k as the kernel reads them (the shared RoPE key expanded)    2 e H qk / t
    the kv up-projection's output, held whole through v (a view of it) e H (nope + v) / t
    attention output (wo's input), log-sum-exp                         e H v / t + 4 H / t

RoPE saves nothing (its angles are a buffer); under autocast the attention norm's output is cast
for its three readers (wq or wq_a, wkv_a, wk_pe). Context parallelism's all-gather saves the
gathered k and v (e H (qk + v) / t x cp) instead of the local ones. torch's CPU SDPA has no fused
kernel for q/k and v of different widths: its math kernel keeps fp32 copies of q, k, v and the
probabilities (4 (2 H qk + H v + H s)) and no log-sum-exp (device "cpu", for measurements here);
CUDA runs a fused kernel (memory-efficient or cuDNN), which is what the estimate counts.

Multi-token prediction (the MTPBlock module: enorm, hnorm, eh_proj, a block, head_norm; on the
last pipeline stage after the trunk, args.total_layers): the block as above plus its three norms
and the concatenated pair eh_proj keeps (2 e h), on this rank's slice of the sequence; full
checkpointing keeps its two inputs (the previous hidden state and the embedded lookahead tokens).
Under autocast its residual stream is eh_proj's bf16 output, so its norms' outputs are not cast
again. The output end adds, per depth, head_norm's output kept (gathered) by the shared output head
(e h) and the fp32 log-softmax of the depth's own logits (4 V / t; its cross-entropy runs in the
forward, which frees the logits), and the lookahead ids (batch, seq, depth, 2) int64.

Encoders and encoder-decoders (BERT, T5), through small declarative hooks on the family's modules
rather than their classes (checked tensor by tensor like the other blocks: BERT post- and pre-norm,
T5 encoder and decoder blocks with either MLP, fp32, bf16 and fp32 under autocast):
- A TransformerBlock with its own forward that declares `norm_order` "post" (BERT: h = norm1(x +
  attn(x)); out = norm2(h + mlp(h))) saves what the pre-norm block saves: wq/wk/wv keep the block
  input where attention_norm kept it, norm1 keeps x + attn(x) as ffn_norm kept h, w1 keeps norm1's
  output as it kept ffn_norm's, and norm2's output is the next block's input. Under autocast the
  same four bf16 casts (the input for wq, wk, wv; norm1's output for w1). BERT's LayerNorms, replicated
  under TP, run on the sequence slice like the decoders' sequence-parallel norms (parameters whole).
- A block that declares `sublayers`, its pre-norm (norm, mixer) pairs (T5): self-attention, then
  maybe cross-attention (an attention whose `sequence_inputs` is 2), then the MLP. An MLP that
  declares `activation` with w1, w2 (and w3: gated) saves like SwiGLU when gated (4 e f), like the
  GELU MLP ungated (2 e f), and ReLU only its output, which w2 keeps (e f).
- An attention that declares `score_bias` (T5: no scaling, a float bias on the scores computed once
  per stack): on CUDA the memory-efficient kernel keeps q, k, v, the output and the log-sum-exp, as
  above, and the bias, once per stack: (microbatch, n/t, s, s) for the encoder (it includes the
  padding mask), (1, n/t, D, D) for the causal decoder, in the compute dtype, with the int64 (s, s)
  bucket ids of the table lookup (8 s^2); under autocast each layer keeps a bf16 cast of the bias
  (e n s / t per token). On CPU the bias needs a gradient, so SDPA runs the math kernel (fp32 q, k,
  v and probabilities, 4 (qd + 2 kvd + n s) / t per token, as for MLA above) and keeps no bias.
- Cross-attention in a decoder block, per decoder token: its norm (and its output, read by wq), q,
  the output and the log-sum-exp, e 2 qd / t + 4 n / t (no bias gradient: a fused kernel on CPU
  too); per encoder token: k and v, e 2 kvd / t, and the encoder output as wk and wv read it: two
  bf16 casts under autocast (2 e h, plus a cast of the (batch, 1, 1, s) padding bias), the
  all-gathered copy under TP (r h), otherwise the encoder's own output, counted once (r h). Decoder
  blocks and the output end (logits, final norm) run on span_corruption.decoder_seq_len tokens D; the
  encoder's final norm (an output-end norm not named "norm") on the encoder's s.
- Ends: input-end norms (BERT's embedding LayerNorm) and the int64 per-token sample fields the
  model indexes (the objective's token_fields: BERT's token types, 8 bytes per token); an encoder-
  decoder's decoder token ids too. An output-end module that declares `per_token_ops` (BERT's MLM
  transform: dense, gelu, norm) keeps each op's input (e h / t per linear and activation, the norm's
  bytes); one that declares `per_sequence` (the binary head, position 0 only) keeps nothing per
  token, except under TP the all-gathered final hidden states its pooler's input is a view of (e h).
- Not counted: a dense (batch, 1, s, s) padding or document mask, which torch's CPU SDPA converts to
  a float mask per layer (e batch s^2; the trainer's CUDA default is a FlexAttention block mask);
  the gradient of a stack's score bias, built during the encoder's backward after the decoder's
  activations are freed.

Activation checkpointing: full keeps only each block's input (r h / t per token)
and recomputes one block at a time in backward; "selective N" does that for every
N-th block; "op" keeps the outputs of matmuls and attention (row-parallel ones whole, before
their reduce-scatter) and recomputes the elementwise rest. The output end keeps the final norm,
its gathered output, the logits (held by the training step) and the fp32 log-softmax; the first
backward step of the loss adds two fp32 vocab-sized gradients.

Pipeline parallelism multiplies one microbatch's stage activations by the
microbatches in flight, from the schedule's warm-up depth (see `in_flight_chunks`,
which tests check against torch's own schedule tables), and adds the gradients of
the stages that have already run a backward (`backward_moments`): at the first
backward, which holds the most, there are none yet. With several stages per rank the chunks
are counted per stage (`in_flight_by_stage`, also checked against torch's tables): the last
rank's warm-up holds its earlier stages' chunks and one of the last stage, whose chunk holds the
logits (with multi-token prediction, several vocabulary-sized tensors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.nn as nn

from estimation.memory import Breakdown, RankEstimate
from estimation.options import PreparedJob

_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round(nbytes: int, granularity: int) -> int:
    return _ceil_div(nbytes, granularity) * granularity if nbytes else 0


def _prod(dims) -> int:
    out = 1
    for d in dims:
        out *= d
    return out


@dataclass(frozen=True)
class StageShape:
    """What one model part holds: some transformer layers (their indices in the model), maybe the
    input and output ends."""

    layers: tuple[int, ...]
    first: bool
    last: bool

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def stage_layout(prep: PreparedJob) -> tuple[list[list[int]], list[StageShape]]:
    """(stage indices held by each pp rank, shape of every stage), as the trainer splits the model:
    the trunk (args.num_layers) cut into stages, the layers after it (args.total_layers: multi-token
    prediction) with the output end on the last stage."""
    args = prep.model_args
    trailing = tuple(range(args.num_layers, args.total_layers))
    layout = prep.plan.pipeline
    if layout is None:
        return [[0]], [StageShape(tuple(range(args.num_layers)) + trailing, True, True)]
    last = layout.num_stages - 1
    shapes = [StageShape(tuple(layout.layer_indices(s)) + (trailing if s == last else ()), s == 0, s == last)
              for s in range(layout.num_stages)]
    return [layout.stages_of_rank(r) for r in range(prep.dims.pp)], shapes


def in_flight_chunks(schedule: str, pp: int, pp_rank: int, n_microbatches: int, stages_per_rank: int) -> int:
    """Most (stage, microbatch) forwards whose activations a pipeline rank holds at once.

    From the warm-up depth of torch's schedules: GPipe runs every forward first; 1F1B
    starts with pp - rank forwards; the interleaved schedules with
    (v - 1) * microbatches_per_round + 2 (pp - 1 - rank) before their first backward (v
    stages per rank), and one more forward before it; LoopedBFS runs every forward of
    every local stage first; the V schedules hold about 2 pp chunks (half a rank's layers
    each) on every rank.
    """
    v, n = stages_per_rank, n_microbatches
    total = v * n
    if schedule == "GPipe" or schedule == "LoopedBFS":
        return total
    if schedule == "1F1B":
        return min(n, pp - pp_rank)
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n // pp)
        per_round = n // rounds
        warmup = (v - 1) * per_round + 2 * (pp - 1 - pp_rank)
        return min(warmup + 1, total)
    # ZBVZeroBubble, DualPipeV.
    return min(2 * pp, total)


def backward_moments(schedule: str, pp: int, pp_rank: int, n_microbatches: int,
                     stages_per_rank: int) -> list[tuple[int, int]]:
    """(chunks in flight, local stages that already have gradients) at the start of each backward.

    The schedule runs W = `in_flight_chunks` forwards, then one forward per backward while
    forwards remain (W stay in flight), then drains: backward j starts with min(W, total - j)
    chunks. A stage's gradients appear with its first backward, and backward reaches a rank's
    later stages first, one round of microbatches per stage (the interleaved schedules: n / rounds;
    LoopedBFS: all n). For the V schedules every stage is taken to have gradients after the first
    backward, which errs high. Tests check the pairs against torch's own tables for GPipe,
    1F1B, Interleaved1F1B and LoopedBFS.
    """
    v, n = stages_per_rank, n_microbatches
    total = v * n
    w = in_flight_chunks(schedule, pp, pp_rank, n, v)
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        per_round = n // max(1, n // pp)
    elif schedule == "LoopedBFS":
        per_round = n
    else:
        per_round = 1
    return [(min(w, total - j), min(v, _ceil_div(j, per_round))) for j in range(total)]


def in_flight_by_stage(schedule: str, pp: int, pp_rank: int, n_microbatches: int,
                       stages_per_rank: int) -> list[tuple[int, ...]] | None:
    """At the start of each backward, the chunks in flight of each of the rank's stages (its first
    stage first); None for the V schedules, whose order is not modeled (their chunks are taken as
    spread evenly over the rank's stages).

    The same W forwards, then one forward per backward, as `backward_moments`, with torch's stage
    order: forwards run one round of microbatches per stage, cycling from the rank's first stage
    (the interleaved schedules: n / rounds microbatches per round; LoopedBFS: all n), backwards the
    same rounds from its last stage. What matters is which stages the held chunks belong to: on the
    last pipeline rank, whose last stage holds the logits, the warm-up is all earlier stages' chunks
    and one of the last. Tests check the counts against torch's own tables."""
    v, n = stages_per_rank, n_microbatches
    total = v * n
    if schedule in ("ZBVZeroBubble", "DualPipeV"):
        return None
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        per_round = n // max(1, n // pp)
    elif schedule == "LoopedBFS":
        per_round = n
    else:
        per_round = max(n, 1)
    w = in_flight_chunks(schedule, pp, pp_rank, n, v)
    forward_stage = [(i // per_round) % v for i in range(total)]
    backward_stage = [v - 1 - (j // per_round) % v for j in range(total)]
    counts = [0] * v
    issued = 0
    out = []
    for j in range(total):
        while issued < min(w + j, total):
            counts[forward_stage[issued]] += 1
            issued += 1
        out.append(tuple(counts))
        counts[backward_stage[j]] -= 1
    return out


@dataclass
class AnalyticDetail:
    """The intermediate quantities, for explanations and the planner."""

    params_local: int = 0          # parameters this rank stores (after TP and FSDP), elements
    params_tp_local: int = 0       # parameters of this rank's stages after TP only, elements
    expert_params_local: int = 0   # of those, routed experts after EP, elements
    layer_activation_bytes: int = 0
    stored_per_microbatch: int = 0
    in_flight: int = 1
    host_bytes: int = 0            # offloaded to host memory (training.enable_cpu_offload), not in the peak
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# The model, read from the family's meta model.


# The norms the activation count knows, by module type.
_NORMS = {nn.RMSNorm: "rmsnorm", nn.LayerNorm: "layernorm"}


class UnknownBlockError(ValueError):
    """The analytic model does not know a part of this model; the traced estimate does."""


@dataclass(frozen=True)
class Sharding:
    """How one rank's parameters are split, by placement (see ParamShape.placement).

    dense: TP as the family's shard function places them, then FSDP over dp_shard x cp (1 without FSDP); token (an MoE
    layer's router and shared experts, whole on every TP rank, which routes its own tokens): FSDP
    over dp_shard x cp x tp; expert (routed experts): split over ep on the expert dimension, then
    FSDP over efsdp = dp_shard x cp x tp / ep. HSDP replicas hold the same shards."""

    tp: int = 1
    ep: int = 1
    dense: int = 1
    token: int = 1
    expert: int = 1

    @classmethod
    def of(cls, dims, *, fsdp: bool = True) -> Sharding:
        """The job's sharding; fsdp False: model parallelism only (what FSDP gathers)."""
        if not fsdp:
            return cls(tp=dims.tp, ep=dims.ep)
        # parallel/fsdp.py shards an MoE layer's parts over their own meshes even without data
        # parallelism (token_fsdp and expert_fsdp exist whenever dp_shard x cp x tp > 1).
        return cls(tp=dims.tp, ep=dims.ep, dense=dims.dp_shard * dims.cp if dims.fsdp_enabled else 1,
                   token=dims.dp_shard * dims.cp * dims.tp, expert=dims.efsdp)


@dataclass(frozen=True)
class ParamShape:
    """One parameter of the meta model."""

    name: str                       # full name
    shape: tuple[int, ...]
    tp_dim: int | None              # the dim tensor parallelism splits (None: whole on every TP rank)
    group: str                      # "block", "inputs" (first stage), "outputs" (last stage) or "always"
    tied_to: str | None = None      # an alias of a tied weight: the group of its owner
    placement: str = "dense"        # "dense", "token" (MoE router, shared experts) or "expert" (routed experts)
    vocab_table: bool = False       # an end's embedding table split by vocabulary (its gradient is whole under TP)

    def local(self, tp: int) -> tuple[int, int]:
        """(dim 0, product of the other dims) of this rank's piece after tensor parallelism."""
        dims = list(self.shape) or [1]
        if tp > 1 and self.placement == "dense" and self.tp_dim is not None:
            dims[self.tp_dim] = _ceil_div(dims[self.tp_dim], tp)
        return dims[0], _prod(dims[1:])

    def pieces(self, sh: Sharding) -> tuple[int, int]:
        """(elements after model parallelism (TP, or EP for experts), elements this rank stores)."""
        d0, rest = self.local(sh.tp)
        dims = [d0, rest]
        if self.placement == "expert":
            dims[0] = _ceil_div(d0, sh.ep)
        model_local = dims[0] * dims[1]
        shard = {"dense": sh.dense, "token": sh.token, "expert": sh.expert}[self.placement]
        if shard == 1:
            return model_local, model_local
        if self.placement != "dense" and len(self.shape) >= 2 and dims[0] % shard:
            # parallel/fsdp.py shards an MoE part on dim 1 when dim 0 does not split evenly (an
            # expert group with fewer experts than FSDP ranks).
            d1, tail = self.shape[1], _prod(self.shape[2:])
            return model_local, dims[0] * _ceil_div(d1, shard) * tail
        return model_local, _ceil_div(dims[0], shard) * dims[1]  # FSDP pads dim 0 to the shard count


@dataclass(frozen=True)
class NormShape:
    kind: str      # "rmsnorm" | "layernorm"
    readers: int   # linears reading its output (autocast casts it once for each)


@dataclass(frozen=True)
class MoEShape:
    """An MoE layer's sizes for the activation count (from its MoEArgs, the contract)."""

    experts: int
    top_k: int
    hidden: int              # each routed expert's SwiGLU hidden size
    shared_hidden: int       # the shared experts' SwiGLU hidden size (0: none)
    capacity_factor: float | None
    pad_to_capacity: bool
    z_loss: bool
    aux_loss: bool = True        # the per-micro-batch balancing loss (its expert counts are saved)
    seq_aux_loss: bool = False   # DeepSeek-V3's sequence-wise balancing loss (counts per sequence)
    sigmoid: bool = False        # sigmoid scores (a balancing loss renormalizes them: their sum is saved)


@dataclass(frozen=True)
class MLAShape:
    """Multi-head latent attention's widths (an attention declaring latent_attention, models/protocol.py),
    read from the module: the latent ranks and each head's query/key (nope + rope) and value features."""

    q_lora: int      # the low-rank query's width (0: one query projection)
    kv_lora: int     # the key/value latent's width
    nope: int        # each head's features without rotary positions (of q and k, and of the kv up-projection)
    rope: int        # each head's rotary features (the RoPE key is one for all heads)
    v_head: int      # each head's value features


@dataclass(frozen=True)
class BlockShape:
    """The widths of one block's building blocks, for the activation count."""

    hidden: int
    norms: tuple[NormShape, ...]
    q_dim: int
    kv_dim: int
    heads: int
    attention_inputs: int   # output features of the head-split linears reading the attention's input
                            # (q + 2 kv; MLA: the up projections' q and kv)
    mlp_saved: int          # MLP elements saved per token, before TP (SwiGLU 4 f, GELU 2 f; 0 for MoE)
    mlp_inputs: int         # output features of the MLP's input linears (SwiGLU 2 f, GELU f; 0 for MoE)
    mlp_hidden: int         # input features of the MLP's output linear (f; 0 for MoE)
    rowwise_outputs: int    # linears writing back into the residual stream (attention's wo, the MLP's w2)
    kv_heads: int = 0
    qk_norm: bool = False   # RMSNorms over each head's q and k (Qwen3)
    moe: MoEShape | None = None
    mla: MLAShape | None = None      # the attention is multi-head latent attention
    mtp: tuple[str, ...] = ()        # a multi-token-prediction block: norm kinds of enorm, hnorm, head_norm
    score_bias: bool = False         # self-attention adds a float bias to the scores (T5's relative positions)
    cross_attention: bool = False    # a decoder block: cross-attention over the encoder's output

    @property
    def out_dim(self) -> int:
        """Width of the attention kernel's output (the input of wo)."""
        return self.heads * self.mla.v_head if self.mla is not None else self.q_dim


@dataclass
class ModelShape:
    """What the analytic estimate needs of a model, read once from its meta instance."""

    model: object                    # the meta model itself (float8's linear filter runs on it)
    hidden: int
    layer_params: list[list[ParamShape]]  # per layer, in model order (identical layers share one list)
    end_params: list[ParamShape]
    layer_buffer_bytes: list[int]
    end_buffer_bytes: dict[str, int]  # group -> bytes
    total_params: int                 # tied weights once
    vocab_table: tuple[int, ...] | None   # shape of the vocabulary-split table (its gradient is whole under TP)
    vocab_tied: bool                  # that table is tied to the output projection
    output_vocab: int                 # columns of the logits
    output_norms: tuple[str, ...]     # norm kinds of the output end
    blocks: list[BlockShape] | None   # per layer, in model order
    unknown: str | None               # why the activation model does not apply, or None
    input_norms: tuple[str, ...] = ()  # norm kinds of the input end (BERT's embedding LayerNorm)
    # An encoder-decoder's output-end norms other than the final one (named "norm" in every family):
    # they normalize the encoder's output (T5's encoder_norm), over the encoder's tokens.
    encoder_norms: tuple[str, ...] = ()
    output_linears: int = 0           # linears of the output end before the projection (MLM transform)
    output_activations: int = 0       # elementwise activations there (each keeps its input)
    gathers_output: bool = False      # a per-sequence head all-gathers the final hidden states under TP

    @property
    def block(self) -> BlockShape | None:
        """The first block (a dense one when there is one: formulas about matmul inputs use it)."""
        if not self.blocks:
            return None
        return next((b for b in self.blocks if b.moe is None), self.blocks[0])

    @property
    def has_experts(self) -> bool:
        return any(p.placement == "expert" for params in self.layer_params for p in params)

    def require_known(self) -> list[BlockShape]:
        if self.blocks is None:
            raise UnknownBlockError(f"the analytic memory model does not know {self.unknown}; "
                                    "use the traced estimate (--estimate.mode traced)")
        return self.blocks


_SHAPES: dict[tuple[str, str, bool], ModelShape] = {}


def model_shape(prep: PreparedJob, *, placements: bool = True) -> ModelShape:
    """The job's model as the analytic estimate sees it; built on meta once per (family, args), and
    once more with the TP placements for a TP layout (placements=False: the blocks are all the
    caller reads, e.g. inside the traced estimate's own fake process group)."""
    from titanlike.models.registry import get_model_spec

    tensor_parallel = placements and prep.dims.tp > 1
    key = (prep.cfg.model.name, repr(prep.model_args), tensor_parallel)
    shape = _SHAPES.get(key)
    if shape is None:
        if len(_SHAPES) >= 8:
            _SHAPES.pop(next(iter(_SHAPES)))
        shape = _SHAPES[key] = read_model(get_model_spec(prep.cfg.model.name), prep.model_args,
                                          tensor_parallel=tensor_parallel)
    return shape


def tensor_parallel_dims(spec, args) -> dict[str, int]:
    """{parameter name: the dim the family's shard function splits it on} (aliases of tied weights
    included; parameters it leaves whole are absent), read from the DTensor placements of a meta
    model sharded over a fake 2-rank TP mesh: what the trainer's apply_tensor_parallel does, without
    data or communication. UnknownBlockError where a process group already exists."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from estimation.traced import fake_world
    from titanlike.parallel.tensor_parallel import apply_tensor_parallel

    if spec.shard is None:
        return {}
    if dist.is_initialized():
        raise UnknownBlockError("the analytic estimate reads the tensor-parallel placements in a fake process "
                                "group of its own, and this process already has one")
    with fake_world(2):
        with torch.device("meta"):
            model = spec.model_cls(args)
        apply_tensor_parallel(model, init_device_mesh("cpu", (2,)), spec.shard, loss_parallel=True)
        dims = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            placement = param.placements[0] if isinstance(param, DTensor) else None
            if isinstance(placement, Shard):
                dims[name] = placement.dim % param.ndim
    return dims


def _placements(block: nn.Module) -> dict[str, str]:
    """Submodule name (relative to the block) -> placement of the parameters it holds directly:
    an MoE layer's routed experts "expert", the rest of it (router, shared experts) "token"."""
    from titanlike.models.common.moe import MoE, GroupedExperts

    moes = [name for name, m in block.named_modules() if isinstance(m, MoE)]
    out: dict[str, str] = {}
    for name, module in block.named_modules():
        if isinstance(module, GroupedExperts):
            out[name] = "expert"
        elif any(name == m or name.startswith(m + ".") for m in moes):
            out[name] = "token"
    return out


def read_model(spec, args, *, tensor_parallel: bool = False) -> ModelShape:
    """Build spec.model_cls(args) on meta and read its parameters, buffers and blocks;
    tensor_parallel: also how the family's shard function splits each parameter (tp_dim)."""
    import torch

    from titanlike.models import protocol

    with torch.device("meta"):
        model = spec.model_cls(args)
    tp_dims = tensor_parallel_dims(spec, args) if tensor_parallel else {}
    ends = spec.pipeline_ends
    inputs = set(ends.inputs) if ends is not None else set()
    outputs = set(ends.outputs) if ends is not None else set()

    def group_of(name: str) -> str:
        head = name.split(".", 1)[0]
        if head == "layers":
            return "block"
        return "inputs" if head in inputs else "outputs" if head in outputs else "always"

    tied = protocol.tied_weights(model)
    # Blocks: every layer, but identical layers (most of them) share one parameter list.
    layer_params: list[list[ParamShape]] = []
    layer_buffers: list[int] = []
    seen: dict[tuple, tuple[list[ParamShape], int]] = {}
    for key, block in model.layers.items():
        signature = _block_signature(block)
        if signature not in seen:
            prefix = f"layers.{key}."
            placements = _placements(block)
            params = []
            for name, p in block.named_parameters():
                module = name.rpartition(".")[0]
                params.append(ParamShape(prefix + name, tuple(p.shape), tp_dims.get(prefix + name), "block",
                                         placement=placements.get(module, "dense")))
            buffers = sum(b.numel() * b.element_size() for b in block.buffers())
            seen[signature] = (params, buffers)
        layer_params.append(seen[signature][0])
        layer_buffers.append(seen[signature][1])
    end_params = []
    for name, p in model.named_parameters(remove_duplicate=False):
        group = group_of(name)
        if group == "block":
            continue
        owner = tied.get(name)
        end_params.append(ParamShape(name, tuple(p.shape), tp_dims.get(name), group,
                                     tied_to=group_of(owner) if owner is not None else None,
                                     vocab_table=tp_dims.get(name) == 0 and _is_embedding(model, name)))
    end_buffers: dict[str, int] = {}
    for name, b in model.named_buffers():
        group = group_of(name)
        if group != "block":
            end_buffers[group] = end_buffers.get(group, 0) + b.numel() * b.element_size()
    total = sum(p.numel() for p in model.parameters())
    hidden = args.hidden_size
    vocab = next((p for p in end_params if p.vocab_table), None)
    vocab_table = vocab.shape if vocab is not None else None
    # The table is the output projection's weight too (not only another embedding's, as multi-token
    # prediction's copy of it is).
    vocab_tied = vocab is not None and any(
        owner == vocab.name and isinstance(_submodule(model, alias.rpartition(".")[0]), nn.Linear)
        for alias, owner in tied.items())
    blocks, unknown = _read_blocks(model, hidden)
    if ends is None:
        # No pipeline split: the top-level embeddings are the input end, the top-level norms and
        # linears (final norm, output projection) the output end.
        top = dict(model.named_children())
        inputs = {name for name, m in top.items() if isinstance(m, nn.Embedding)}
        outputs = {name for name, m in top.items() if type(m) in _NORMS or isinstance(m, nn.Linear)}
    output_vocab, output_norms, encoder_norms = 0, [], []
    transform = {"linear": 0, "activation": 0}
    gathers_output = False
    for name in sorted(outputs):
        module = _submodule(model, name)
        if isinstance(module, nn.Linear):
            output_vocab = module.out_features
        elif type(module) in _NORMS and name != "norm" and blocks and any(b.cross_attention for b in blocks):
            encoder_norms.append(_NORMS[type(module)])  # an encoder-decoder's norm of the encoder output
        elif type(module) in _NORMS:
            output_norms.append(_NORMS[type(module)])
        elif isinstance(module, nn.Embedding):
            pass  # a table the output end reads too (multi-token prediction's lookahead tokens)
        elif protocol.per_token_ops(module) and _per_token_ops(module, transform, output_norms):
            pass  # a per-token transform before the projection (BERT's MLM head)
        elif protocol.per_sequence(module):
            # Reads one token per sequence: nothing per token, except that under TP (with sequence
            # parallelism) it all-gathers the final hidden states, which the token it keeps (a view) holds.
            gathers_output = True
        elif module is not None and unknown is None:
            blocks, unknown = None, f"the output end {name} of {type(model).__name__} ({type(module).__name__})"
    input_norms = []
    for name in sorted(inputs):
        module = _submodule(model, name)
        if type(module) in _NORMS:
            input_norms.append(_NORMS[type(module)])  # BERT's embedding LayerNorm
        elif module is not None and not isinstance(module, nn.Embedding) and unknown is None:
            blocks, unknown = None, f"the input end {name} of {type(model).__name__} ({type(module).__name__})"
    if not output_vocab and unknown is None:
        blocks, unknown = None, f"the output projection of {type(model).__name__} (no pipeline end or plan names it)"
    return ModelShape(model=model, hidden=hidden, layer_params=layer_params, end_params=end_params,
                      layer_buffer_bytes=layer_buffers, end_buffer_bytes=end_buffers, total_params=total,
                      vocab_table=vocab_table, vocab_tied=vocab_tied,
                      output_vocab=output_vocab, output_norms=tuple(output_norms), blocks=blocks, unknown=unknown,
                      input_norms=tuple(input_norms), encoder_norms=tuple(encoder_norms),
                      output_linears=transform["linear"], output_activations=transform["activation"],
                      gathers_output=gathers_output)


# Elementwise activations a module's `per_token_ops` may name between its children.
_ACTIVATIONS = ("gelu", "relu", "silu", "tanh")


def _is_embedding(model, param_name: str) -> bool:
    return isinstance(_submodule(model, param_name.rpartition(".")[0]), nn.Embedding)


def _per_token_ops(module, counts: dict[str, int], norms: list[str]) -> bool:
    """Count a module that declares `per_token_ops` (its children and elementwise activations, in
    order, each applied token by token): every nn.Linear and activation keeps its input (counted in
    `counts`), every norm its statistics (appended to `norms`). False when a name is not one of those."""
    found = {"linear": 0, "activation": 0}
    kinds = []
    from titanlike.models import protocol

    for op in protocol.per_token_ops(module):
        child = getattr(module, op, None) if op not in _ACTIVATIONS else None
        if op in _ACTIVATIONS:
            found["activation"] += 1
        elif type(child) is nn.Linear:
            found["linear"] += 1
        elif type(child) in _NORMS:
            kinds.append(_NORMS[type(child)])
        else:
            return False
    for key, n in found.items():
        counts[key] += n
    norms.extend(kinds)
    return True


def _submodule(model, name: str):
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _read_blocks(model, hidden: int) -> tuple[list[BlockShape] | None, str | None]:
    """BlockShape of every layer (identical layers read once); (None, what is unknown) otherwise."""
    shapes: dict[tuple, BlockShape] = {}
    out = []
    for block in model.layers.values():
        signature = _block_signature(block)
        if signature not in shapes:
            shape, unknown = _read_block(model, block, hidden)
            if shape is None:
                return None, unknown
            shapes[signature] = shape
        out.append(shapes[signature])
    return out, None


def _mtp_block_type():
    try:
        from titanlike.models.common.mtp import MTPBlock
    except ImportError:  # an older tree: no multi-token prediction
        return None
    return MTPBlock


def _read_block(model, block, hidden: int) -> tuple[BlockShape | None, str | None]:
    """The common building blocks of one block, by module type; (None, what is unknown) otherwise.

    Known: TransformerBlock and MTPBlock (multi-token prediction: a TransformerBlock with enorm,
    hnorm, eh_proj and head_norm around it), with the common Attention or a latent attention (the
    `latent_attention` hook: MLA), and FeedForward, GeluMLP or MoE."""
    from titanlike.models import protocol
    from titanlike.models.common.attention import Attention, core_attention
    from titanlike.models.common.block import TransformerBlock
    from titanlike.models.common.feed_forward import FeedForward, GeluMLP
    from titanlike.models.common.moe import MoE

    what = f"the blocks of {type(model).__name__} ({type(block).__name__})"
    mtp_type = _mtp_block_type()
    is_mtp = mtp_type is not None and type(block) is mtp_type
    if not isinstance(block, TransformerBlock) and protocol.sublayers(block):
        return _read_sublayer_block(block, hidden, what)
    # A TransformerBlock whose forward is its own declares where its norms sit (BERT: post-norm);
    # either order saves the same tensors (see the module docstring).
    declared_order = protocol.norm_order(block) in ("pre", "post")
    if not isinstance(block, TransformerBlock) or (type(block).forward is not TransformerBlock.forward
                                                   and not is_mtp and not declared_order):
        return None, what
    children = dict(block.named_children())
    mlp_name = "moe" if block.moe is not None else "feed_forward"
    expected = {"attention_norm", "attention", "ffn_norm", mlp_name}
    if is_mtp:
        expected |= {"enorm", "hnorm", "eh_proj", "head_norm"}
    if set(children) != expected or any(True for _ in block.named_parameters(recurse=False)):
        return None, f"{what}: children {', '.join(children)}"
    attention, mlp = block.attention, children[mlp_name]
    parts = {"attention_norm": block.attention_norm, "ffn_norm": block.ffn_norm, "attention": attention,
             mlp_name: mlp}
    if is_mtp:
        parts.update(enorm=block.enorm, hnorm=block.hnorm, head_norm=block.head_norm)
        if type(block.eh_proj) is not nn.Linear or block.eh_proj.bias is not None:
            return None, f"{what}: eh_proj is a {type(block.eh_proj).__name__}"
    for name, module in parts.items():
        if name == "attention":
            known = type(module) is Attention or protocol.latent_attention(module)
        else:
            known = type(module) in (_NORMS if name.endswith("norm") else (MoE,) if name == "moe"
                                     else (FeedForward, GeluMLP))
        if not known:
            return None, f"{what}: {name} is a {type(module).__name__}"
    if attention.core_attention is not core_attention:
        return None, f"{what}: its attention runs {getattr(attention.core_attention, '__name__', 'another kernel')}"
    if type(attention) is Attention:
        qk_norms = [getattr(attention, n, None) for n in ("q_norm", "k_norm")]
        if any(n is not None and type(n) is not nn.RMSNorm for n in qk_norms):
            return None, f"{what}: its attention's q/k norms are not RMSNorm"
        q_dim, kv_dim = attention.wq.out_features, attention.wk.out_features
        heads = q_dim // attention.head_dim
        common = dict(hidden=hidden, q_dim=q_dim, kv_dim=kv_dim, heads=heads, kv_heads=kv_dim // attention.head_dim,
                      attention_inputs=q_dim + 2 * kv_dim, qk_norm=qk_norms[0] is not None)
        attention_readers = 3  # wq, wk, wv
    else:
        latent_norms = [n for n in (attention.q_norm, attention.kv_norm) if n is not None]
        if any(type(n) is not nn.RMSNorm for n in latent_norms):
            return None, f"{what}: its attention's latent norms are not RMSNorm"
        mla = MLAShape(q_lora=attention.wq_a.out_features if attention.wq is None else 0,
                       kv_lora=attention.wkv_a.out_features, nope=attention.qk_nope_head_dim,
                       rope=attention.qk_rope_head_dim, v_head=attention.v_head_dim)
        heads = attention.wkv_b.out_features // (mla.nope + mla.v_head)
        q_dim = heads * (mla.nope + mla.rope)  # q and k, as the kernel sees them
        common = dict(hidden=hidden, q_dim=q_dim, kv_dim=q_dim, heads=heads, kv_heads=heads,
                      attention_inputs=q_dim + heads * (mla.nope + mla.v_head), mla=mla)
        attention_readers = 3  # wq (or wq_a), wkv_a, wk_pe
    if is_mtp:
        common["mtp"] = tuple(_NORMS[type(n)] for n in (block.enorm, block.hnorm, block.head_norm))
    if isinstance(mlp, MoE):
        a = mlp.args  # MoEArgs: the contract
        moe = MoEShape(experts=a.num_experts, top_k=a.top_k, hidden=a.hidden_dim,
                       shared_hidden=a.shared_dim if mlp.shared_experts is not None else 0,
                       capacity_factor=a.capacity_factor, pad_to_capacity=a.pad_to_capacity,
                       z_loss=a.z_loss_coeff > 0, aux_loss=a.aux_loss_coeff > 0,
                       seq_aux_loss=a.seq_aux_loss_coeff > 0,
                       sigmoid=a.score_before_topk and a.score_func == "sigmoid")
        # The MoE reads its norm's output locally (no all-gather, no autocast copy of its own).
        norms = (NormShape(_NORMS[type(block.attention_norm)], attention_readers),
                 NormShape(_NORMS[type(block.ffn_norm)], 1))
        return BlockShape(norms=norms, mlp_saved=0, mlp_inputs=0, mlp_hidden=0, rowwise_outputs=1, moe=moe,
                          **common), None
    mlp_saved, mlp_inputs, mlp_readers = _mlp_shape(mlp)
    norms = (NormShape(_NORMS[type(block.attention_norm)], attention_readers),
             NormShape(_NORMS[type(block.ffn_norm)], mlp_readers))
    return BlockShape(norms=norms, mlp_saved=mlp_saved, mlp_inputs=mlp_inputs, mlp_hidden=mlp.w2.in_features,
                      rowwise_outputs=2, **common), None


def _mlp_shape(mlp) -> tuple[int, int, int] | None:
    """(elements saved per token, output features of the input linears, linears reading the norm's
    output) of a dense MLP: the common FeedForward (SwiGLU) and GeluMLP, or a module with w1 (w3
    when gated) and w2 linears that declares its `activation`; None for anything else."""
    from titanlike.models.common.feed_forward import FeedForward, GeluMLP

    f = mlp.w1.out_features
    if isinstance(mlp, FeedForward):  # SwiGLU saves w1 x, silu(w1 x), w3 x and their product
        return 4 * f, f + mlp.w3.out_features, 2
    if isinstance(mlp, GeluMLP):  # GELU saves its input (w1 x + b) and its output
        return 2 * f, f, 1
    from titanlike.models import protocol

    activation = protocol.activation(mlp)
    if activation not in ("gelu", "relu", "silu") or any(
            type(getattr(mlp, n, None)) is not nn.Linear for n in ("w1", "w2")):
        return None
    w3 = getattr(mlp, "w3", None)
    if w3 is not None:  # gated: act(w1 x) * w3 x saves w1 x, act(w1 x), w3 x and the product
        return 4 * f, f + w3.out_features, 2
    # ReLU's backward reads its output, the same tensor w2 keeps; GELU and SiLU keep their input too.
    return (f if activation == "relu" else 2 * f), f, 1


def _read_sublayer_block(block, hidden: int, what: str) -> tuple[BlockShape | None, str | None]:
    """A block that declares `sublayers`, its pre-norm residual (norm, mixer) pairs in order (T5):
    self-attention first (the common Attention, or one that declares `score_bias`: scores plus a
    float bias its caller passes), maybe a cross-attention (an attention whose `sequence_inputs` is 2:
    its keys and values read the encoder's output), a dense MLP last."""
    from titanlike.models import protocol
    from titanlike.models.common.attention import Attention

    declared = protocol.sublayers(block)
    pairs = [(getattr(block, n, None), getattr(block, m, None)) for n, m in declared]
    present = [(n, m) for (n, m), (norm, mixer) in zip(declared, pairs) if mixer is not None]
    children = dict(block.named_children())
    if (set(children) != {x for pair in present for x in pair} or len(present) not in (2, 3)
            or any(True for _ in block.named_parameters(recurse=False))):
        return None, f"{what}: children {', '.join(children)}"
    norms, mixers = [children[n] for n, _ in present], [children[m] for _, m in present]
    if any(type(n) not in _NORMS for n in norms):
        return None, f"{what}: a norm is not RMSNorm or LayerNorm"

    def attention_kind(module) -> str | None:
        if type(module) is Attention and getattr(module, "q_norm", None) is None:
            return "plain"
        linears = all(type(getattr(module, n, None)) is nn.Linear for n in ("wq", "wk", "wv", "wo"))
        if linears and protocol.score_bias(module) and isinstance(getattr(module, "head_dim", None), int):
            return "cross" if protocol.sequence_inputs(module) == 2 else "biased"
        return None

    kinds = [attention_kind(m) for m in mixers[:-1]]
    if kinds[0] not in ("plain", "biased") or (len(kinds) == 2 and kinds[1] != "cross"):
        return None, f"{what}: its attention is a {type(mixers[0]).__name__}"
    mlp = _mlp_shape(mixers[-1])
    if mlp is None:
        return None, f"{what}: its MLP is a {type(mixers[-1]).__name__}"
    attention = mixers[0]
    q_dim, kv_dim = attention.wq.out_features, attention.wk.out_features
    heads = q_dim // attention.head_dim
    if len(kinds) == 2:
        cross = mixers[1]
        if (cross.wq.out_features, cross.wk.out_features) != (q_dim, kv_dim):
            return None, f"{what}: its cross-attention's widths differ from its self-attention's"
    mlp_saved, mlp_inputs, mlp_readers = mlp
    readers = [3] + ([1] if len(kinds) == 2 else []) + [mlp_readers]  # cross-attention's norm: wq only
    return BlockShape(hidden=hidden, norms=tuple(NormShape(_NORMS[type(n)], r) for n, r in zip(norms, readers)),
                      q_dim=q_dim, kv_dim=kv_dim, heads=heads, kv_heads=kv_dim // attention.head_dim,
                      attention_inputs=q_dim + 2 * kv_dim, mlp_saved=mlp_saved, mlp_inputs=mlp_inputs,
                      mlp_hidden=mixers[-1].w2.in_features, rowwise_outputs=len(mixers),
                      score_bias=kinds[0] == "biased", cross_attention=len(kinds) == 2), None


def _block_signature(block) -> tuple:
    return (tuple((name, type(m).__name__) for name, m in block.named_modules()),
            tuple((name, tuple(p.shape)) for name, p in block.named_parameters()))


def norm_bytes(kind: str, hidden: int, e_in: int, device: str = "cuda") -> int:
    """Bytes one norm saves per token (before sequence parallelism), for input elements of e_in bytes."""
    if kind == "rmsnorm":
        return 8 * hidden + 4
    stats = 4 if device == "cuda" or e_in == 4 else e_in
    return e_in * hidden + 2 * stats


def _stage_end_params(ms: ModelShape, stage: StageShape) -> list[ParamShape]:
    """The parameters of the model's ends (not its blocks) a stage holds (tied weights once)."""
    groups = {"always"} | ({"inputs"} if stage.first else set()) | ({"outputs"} if stage.last else set())
    return [p for p in ms.end_params if p.group in groups and p.tied_to not in groups]


def _stage_params(ms: ModelShape, stage: StageShape) -> list[ParamShape]:
    """Every parameter a stage holds (tied weights once)."""
    return [p for i in stage.layers for p in ms.layer_params[i]] + _stage_end_params(ms, stage)


def _stage_buffer_bytes(ms: ModelShape, stage: StageShape) -> int:
    groups = {"always"} | ({"inputs"} if stage.first else set()) | ({"outputs"} if stage.last else set())
    return (sum(ms.layer_buffer_bytes[i] for i in stage.layers)
            + sum(n for g, n in ms.end_buffer_bytes.items() if g in groups))


@dataclass
class StageParams:
    """A stage's parameters on one rank."""

    sharded_bytes: int      # fp32 shards this rank stores (each tensor rounded to the allocator's granularity)
    sharded: int            # elements this rank stores
    model_local: int        # elements after model parallelism (TP, EP) only: what FSDP gathers
    largest_block: int      # model_local elements of the stage's largest block
    blocks: int             # model_local elements of all its blocks
    tensors: int            # parameter tensors
    expert_local: int = 0   # model_local elements of routed experts
    token_local: int = 0    # model_local elements of MoE routers and shared experts


def _stage_param_bytes(ms: ModelShape, stage: StageShape, sh: Sharding, granularity: int) -> StageParams:
    out = StageParams(0, 0, 0, 0, 0, 0)
    for p in _stage_params(ms, stage):
        local, stored = p.pieces(sh)
        out.sharded_bytes += _round(stored * 4, granularity)
        out.sharded += stored
        out.model_local += local
        out.tensors += 1
        if p.placement == "expert":
            out.expert_local += local
        elif p.placement == "token":
            out.token_local += local
    for i in stage.layers:
        block = sum(p.pieces(sh)[0] for p in ms.layer_params[i])
        out.blocks += block
        out.largest_block = max(out.largest_block, block)
    return out


def moe_rows(moe: MoEShape, tokens: int, *, microbatch: int, seq_full: int) -> int:
    """Routed rows (token copies) an MoE layer's experts on one rank process per microbatch, for
    `tokens` routed on that rank. Dropless routing varies from rank to rank; this is the average
    (tokens x top_k: all-to-all brings a rank as many rows as it sends, on average). A capacity
    drops some routes (fewer rows); pad_to_capacity pads every expert to its per-sequence capacity,
    computed on the whole sequence even when the rank holds a slice of it (static shapes)."""
    e, k = moe.experts, moe.top_k
    if moe.pad_to_capacity and moe.capacity_factor is not None:
        capacity = min(math.ceil(moe.capacity_factor * seq_full * k / e), seq_full * k)
        return e * microbatch * capacity
    return tokens * k


def moe_saved_bytes(moe: MoEShape, h: int, tokens: int, rows: int, *, e: int, ep: int,
                    microbatch: int = 1) -> tuple[int, int]:
    """(bytes an MoE layer saves for backward, bytes it keeps under op-level checkpointing) for
    `tokens` routed tokens and `rows` routed rows on this rank, compute elements of e bytes.

    Per token: the router's fp32 copy of its input (4 h; the input itself when e is 4) and the
    input kept by the shared experts (e h), the fp32 scores (4 E), the top-k ids, gate values and
    their sum (8 k + 4 k + 4), with the z-loss the logits and their log-sum-exp (4 E + 8), and the
    shared experts' SwiGLU (4 e shared_hidden). Per routed row: the row itself (e h), the experts'
    SwiGLU (4 e hidden), the expert output and its gated product (2 e h: the multiply keeps
    the first, the index_add combine the second), the gate value (e) and two int64 index vectors
    (16: the route ids and the token each route came from), plus two more (16) to reorder rows that
    arrived by all-to-all. Sigmoid scores that a balancing loss reads are renormalized: their sum per
    token (4) is saved too. Per layer, the router's fp32 copy of a bf16 gate weight (4 E h), the
    grouped matmuls' int32 offsets (4 E) and the balancing losses' fp32 expert counts (4 E per
    micro-batch, 4 E per sequence for the sequence-wise loss). Group-limited routing (DeepSeek's
    node limit) saves nothing that lives to backward: its top-k and masks only choose the experts.
    Checked tensor by tensor with saved-tensor hooks, counting what is still held when the forward
    ends (tests/unit/test_estimation.py). Op-level checkpointing keeps the matmul (mm) outputs: the
    router's logits and the shared experts' three projections; grouped matmuls are recomputed."""
    shared = moe.shared_hidden
    per_token = 4 * h + (e * h if shared and e != 4 else 0) + 4 * moe.experts + 12 * moe.top_k + 4
    if moe.sigmoid and (moe.aux_loss or moe.seq_aux_loss):
        per_token += 4
    if moe.z_loss:
        per_token += 4 * moe.experts + 8
    per_token += 4 * e * shared
    per_row = e * h + 4 * e * moe.hidden + 2 * e * h + e + 16 + (16 if ep > 1 else 0)
    counts = 4 * moe.experts * ((1 if moe.aux_loss else 0) + (microbatch if moe.seq_aux_loss else 0))
    full = (tokens * per_token + rows * per_row + (4 * moe.experts * h if e != 4 else 0) + 4 * moe.experts
            + counts)
    op = tokens * (4 * moe.experts + (e * (2 * shared + h) if shared else 0))
    return full, op


def moe_transient_bytes(moe: MoEShape, h: int, tokens: int, rows: int, *, e: int, ep: int, microbatch: int,
                        seq_full: int) -> int:
    """Temporaries of an MoE layer beyond what it saves: in backward the gradients through the
    experts (the gradient of the gated output, those of the SwiGLU pieces and of the rows),
    with expert parallelism the send and receive buffers of the all-to-all; in forward, with a
    capacity, the (sequence x top_k, experts) one-hot (int64, then bool) and scores that choose
    the routes each expert keeps, for whole sequences."""
    backward = rows * (e * h + 2 * e * h + 3 * e * moe.hidden)
    if ep > 1:
        backward += 2 * rows * e * h
    capacity = 0
    if moe.capacity_factor is not None:
        capacity = microbatch * seq_full * moe.top_k * moe.experts * 13
    return max(backward, capacity)


def layer_activation_bytes(block: BlockShape, tokens: int, *, tp: int, cp: int, e: int, e_res: int, ac: str,
                           rotate_method: str = "allgather", seq_local: int = 0,
                           autocast: bool = False, device: str = "cuda", ep: int = 1,
                           microbatch: int = 1, memory_tokens: int = 0) -> tuple[int, int]:
    """(bytes one layer keeps for backward, bytes recomputed at once in its backward) for
    `tokens` = microbatch x local sequence tokens, before sequence parallelism. device "cpu"
    counts what torch's CPU kernels keep where they differ from CUDA's (LayerNorm statistics in the
    input dtype; MLA's attention, whose q/k and v widths differ, and attention with a float score
    bias that needs a gradient, on the math kernel), for measurements here. memory_tokens: the
    encoder tokens a decoder block's cross-attention reads (microbatch x encoder length)."""
    h, n = block.hidden, block.heads
    qd, kvd, mla = block.q_dim, block.kv_dim, block.mla
    out_w = block.out_dim
    if mla is None:
        k_w = v_w = v_kept = kvd
    else:
        k_w, v_w = qd, n * mla.v_head
        # v is a view of the kv up-projection's output (each head's [k_nope | v]): the kernel keeps
        # that whole tensor alive.
        v_kept = n * (mla.nope + mla.v_head)
    attention = e * (qd + out_w) / tp + 4 * n / tp  # q, the output (wo's input), the log-sum-exp
    if cp > 1 and rotate_method == "allgather":
        # Gathered keys and values are saved at full length, with a bool mask per layer.
        attention += e * (k_w + v_w) / tp * cp + seq_local * seq_local * cp / max(tokens, 1)
    elif cp > 1:
        # Ring: fp32 copies of q and of every hop's k/v and scores blocks (approximate).
        attention += 4 * qd / tp + cp * (4 * (k_w + v_w) / tp + 3 * 4 * n / tp * seq_local + 3 * 4 * out_w / tp)
    elif device == "cpu" and ((mla is not None and qd != n * mla.v_head) or block.score_bias):
        # torch's CPU SDPA has no fused kernel for q/k and v of different widths, nor for a float mask
        # that needs a gradient (T5's relative position bias): the math kernel keeps fp32 copies of
        # q, k and v and the probabilities (heads x keys per query), no log-sum-exp.
        keys = seq_local or tokens
        attention = 4 * (qd + k_w + v_w + n * keys) / tp + e * out_w / tp
    else:
        attention += e * (k_w + v_kept) / tp
        if block.score_bias and autocast:
            # The memory-efficient kernel keeps its bias; under autocast each layer casts the fp32 bias
            # (batch, heads, queries, keys) to bf16 (a decoder's unbatched one errs high by the batch).
            attention += e * n * (seq_local or tokens) / tp
    cross = 0
    if block.cross_attention:
        # Per decoder token q, the output and the log-sum-exp (no bias gradient: a fused kernel on
        # CPU too); per encoder token k and v, and the encoder output as wk and wv read it: under
        # autocast two bf16 casts, under TP the all-gathered copy (sequence parallelism), otherwise the
        # encoder's output itself, counted once for the model.
        cross = tokens * (e * 2 * qd / tp + 4 * n / tp)
        reads = 2 * e * h if autocast else e_res * h if tp > 1 else 0
        # Under autocast the kernel keeps a bf16 cast of the (batch, 1, 1, keys) padding bias too.
        cross += memory_tokens * (e * 2 * kvd / tp + reads + (e if autocast else 0))
    if block.qk_norm:
        # RMSNorm over each head of q and of k: fp32 input and normalized copies, a rstd per head.
        attention += (8 * qd + 4 * n + 8 * kvd + 4 * block.kv_heads) / tp
    if mla is not None:
        # The latent norms (kv, and q's when it is low-rank) with their outputs, which the up
        # projections keep; computed whole on every TP rank (replicated).
        attention += norm_bytes("rmsnorm", mla.kv_lora, e) + e * mla.kv_lora
        if mla.q_lora:
            attention += norm_bytes("rmsnorm", mla.q_lora, e) + e * mla.q_lora
    # Autocast casts a norm's fp32 output to bf16 once per matmul that reads it (Llama: wq, wk, wv;
    # w1, w3: five saved copies instead of two).
    # A multi-token-prediction block's residual stream is eh_proj's output, already bf16 under
    # autocast: its norms' outputs are bf16 too, one copy for all readers. The MLP's norm comes last.
    casts = autocast and not block.mtp
    norm_outputs = sum(norm.readers if casts else 1 for norm in block.norms[:-1])
    mlp_norm = block.norms[-1]
    norms = sum(norm_bytes(norm.kind, h, e_res, device) for norm in block.norms)
    inputs = 1
    if block.mtp:
        # Multi-token prediction, on this rank's slice of the sequence: enorm, hnorm and head_norm, and
        # the concatenated normalized pair that eh_proj keeps. Its two inputs (the previous hidden
        # state and the embedded lookahead tokens) are what full checkpointing keeps.
        norms += sum(norm_bytes(kind, h, e_res, device) for kind in block.mtp) + 2 * e * h
        inputs = 2
    if block.moe is None:
        norm_outputs += mlp_norm.readers if casts else 1
        mlp, moe_full, moe_op = e * block.mlp_saved / tp, 0, 0
        rowwise, mlp_inputs = block.rowwise_outputs, block.mlp_inputs
    else:
        # The MoE routes this rank's slice of the sequence (no all-gather): tokens / tp of them.
        # Under autocast its inputs stay fp32 (grouped matmuls are not autocast).
        local = tokens // tp
        rows = moe_rows(block.moe, local, microbatch=microbatch, seq_full=seq_local * cp)
        moe_full, moe_op = moe_saved_bytes(block.moe, h, local, rows, e=4 if autocast else e, ep=ep,
                                           microbatch=microbatch)
        mlp, rowwise, mlp_inputs = 0, 1, 0
    full = tokens * (norms / tp + norm_outputs * e * h + attention + mlp) + moe_full + cross
    block_input = inputs * tokens * e_res * h / tp
    if ac == "none":
        return int(full), 0
    if ac == "full":
        return int(block_input), int(full)
    # Op-level: matmul and attention outputs (row-parallel ones before their reduce-scatter; MLA's
    # replicated down projections whole).
    whole = (mla.q_lora + mla.kv_lora + mla.rope) if mla is not None else 0
    mtp = e * h / tp if block.mtp else 0  # eh_proj's output
    op = tokens * (inputs * e_res * h / tp + e * block.attention_inputs / tp + e * whole + e * out_w / tp
                   + 4 * n / tp + rowwise * e * h + e * mlp_inputs / tp + mtp) + moe_op
    if block.cross_attention:  # cross-attention's q, output and log-sum-exp; its k and v
        op += tokens * (e * 2 * qd / tp + 4 * n / tp) + memory_tokens * e * 2 * kvd / tp
    return int(op), int(full)


def weight_grad_share(prep: PreparedJob) -> float | None:
    """Share of a layer's saved activations that are matmul inputs (what a split backward's W step
    still needs after I); None when the analytic model does not know the block."""
    block = model_shape(prep, placements=False).block
    if block is None:
        return None
    e = _BYTES[prep.cfg.training.mixed_precision_param]
    tp, h = prep.dims.tp, block.hidden
    matmul_inputs = len(block.norms) * e * h + e * block.out_dim / tp + e * block.mlp_hidden / tp
    if block.mla is not None:
        matmul_inputs += e * (block.mla.q_lora + block.mla.kv_lora)  # the latent norms' outputs
    tokens = 4096
    total, _ = layer_activation_bytes(block, tokens, tp=tp, cp=1, e=e, e_res=e, ac="none")
    return matmul_inputs * tokens / total


def _ac_mode(cfg) -> tuple[str, int]:
    """('none' | 'full' | 'op', checkpoint every N-th block) from the config."""
    ac = cfg.activation_checkpoint
    if ac.mode in ("none", "memory_budget"):  # the compiler's choice keeps at most what no AC keeps
        return "none", 1
    if ac.mode == "full":
        return "full", 1
    if ac.selective_ac_option == "op":
        return "op", 1
    return "full", int(ac.selective_ac_option)


def estimate_analytic(prep: PreparedJob, granularity: int = 512,
                      device: str = "cuda") -> tuple[list[RankEstimate], list[AnalyticDetail]]:
    """Peak bytes and breakdown for every pipeline rank (all other ranks are alike).

    The peak is the largest of three moments: the start of backward (every activation
    stored, the loss gradients just created), the end of backward (all gradients, the
    root's reduction) and the optimizer step. device "cpu" counts activations as torch's CPU
    kernels keep them (see layer_activation_bytes), to compare with runs measured here.
    """
    dims, cfg = prep.dims, prep.cfg
    ms = model_shape(prep)
    blocks = ms.require_known()
    if len(blocks) != prep.model_args.total_layers:
        raise UnknownBlockError(f"the model holds {len(blocks)} layers but its args count total_layers "
                                f"{prep.model_args.total_layers}")
    h = ms.hidden
    t, p, o = cfg.training, cfg.parallelism, cfg.optimizer
    tp, cp = dims.tp, dims.cp
    fsdp_on = dims.fsdp_enabled
    sharding = Sharding.of(dims)
    half = t.mixed_precision_param in ("bfloat16", "float16")
    e = _BYTES[t.mixed_precision_param]
    # Without FSDP, autocast leaves the residual stream (block inputs, norms) in fp32.
    e_res = e if fsdp_on or not half else 4
    autocast = half and not fsdp_on
    offload = t.enable_cpu_offload and fsdp_on
    seq_local = t.seq_len // cp
    mode, every = _ac_mode(cfg)
    reshard = p.fsdp_reshard_after_forward
    if dims.pp_enabled and reshard == "default":
        reshard = "never"
    grad_accum = prep.plan.batch.grad_accum_steps

    per_rank, shapes = stage_layout(prep)
    microbatch = p.pipeline_parallel_microbatch_size if dims.pp_enabled else t.local_batch_size
    n_microbatches = t.local_batch_size // microbatch if dims.pp_enabled else 1
    tokens = microbatch * seq_local
    vocab_local = _ceil_div(ms.output_vocab, tp)
    # torch's DTensor gives the vocabulary-sharded embedding a Replicate gradient: every TP rank
    # materializes the whole table's gradient before FSDP (or nothing) shards it again.
    embedding_grad_full = embedding_local = 0
    if tp > 1 and ms.vocab_table is not None:
        table_rows, rest = ms.vocab_table[0], _prod(ms.vocab_table[1:])
        embedding_grad_full, embedding_local = table_rows * rest, _ceil_div(table_rows, tp) * rest
    # The output end's norm(s), on this rank's slice of the sequence.
    output_norms = sum(norm_bytes(kind, h, e_res, device) for kind in ms.output_norms)
    encoder_norms = sum(norm_bytes(kind, h, e_res, device) for kind in ms.encoder_norms)
    # An encoder-decoder (blocks with cross-attention): decoder blocks and the output end run the
    # decoder tokens its objective adds (span_corruption.decoder_seq_len); cross-attention reads the
    # encoder's tokens.
    encoder_decoder = any(b.cross_attention for b in blocks)
    dec_seq = prep.objective.model_lengths()["decoder_seq_len"] if encoder_decoder else seq_local
    # Per-token int64 sample fields the model indexes besides the token ids (BERT's token types).
    token_fields = len(prep.objective.token_fields)
    dec_tokens = microbatch * dec_seq
    out_tokens = dec_tokens if encoder_decoder else tokens

    def stage_acts(stage: StageShape) -> tuple[int, int, int]:
        """(stored bytes per microbatch, backward transient, one layer's full activations)."""
        stored, transient, full_layer = 0, 0, 0
        layer_args = dict(tp=tp, cp=cp, e=e, e_res=e_res, rotate_method=p.context_parallel_rotate_method,
                          autocast=autocast, ep=dims.ep, microbatch=microbatch, device=device)
        for i, layer in enumerate(stage.layers):  # i: the index activation checkpointing counts
            block = blocks[layer]
            if block.cross_attention:
                run = dict(layer_args, tokens=dec_tokens, seq_local=dec_seq, memory_tokens=tokens)
            else:
                run = dict(layer_args, tokens=tokens, seq_local=seq_local)
            full, _ = layer_activation_bytes(block, ac="none", **run)
            full_layer = max(full_layer, full)
            layer_mode = mode if (mode != "full" or i % every == 0) else "none"
            kept, recompute = layer_activation_bytes(block, ac=layer_mode, **run)
            stored += kept
            if block.moe is not None:
                local = tokens // tp
                rows = moe_rows(block.moe, local, microbatch=microbatch, seq_full=seq_local * cp)
                recompute += moe_transient_bytes(block.moe, h, local, rows, e=4 if autocast else e, ep=dims.ep,
                                                 microbatch=microbatch, seq_full=seq_local * cp)
            transient = max(transient, recompute)
        if stage.first:
            # The token ids, kept by the embedding's backward (an encoder-decoder's decoder ids too), and
            # the per-token int64 sample fields the model indexes (BERT's token types); an input-end
            # norm (BERT's embedding LayerNorm) on this rank's slice of the sequence.
            stored += (tokens + (dec_tokens if encoder_decoder else 0)) * 8 + tokens * 8 * token_fields
            stored += tokens * sum(norm_bytes(kind, h, e_res, device) for kind in ms.input_norms) // tp
        else:
            stored += tokens * e_res * h // tp  # the stage input received from the previous stage
        if stage.last:
            # Final norm and its gathered output; an encoder-decoder's norm of the encoder output.
            stored += out_tokens * (output_norms // tp + e * h) + tokens * encoder_norms // tp
            # A per-token transform before the projection (BERT's MLM head: dense, GELU, LayerNorm):
            # its linears and activations keep their inputs, on this rank's slice of the sequence.
            stored += tokens * (ms.output_linears + ms.output_activations) * e * h // tp
            if ms.gathers_output and tp > 1:
                stored += tokens * e * h  # a per-sequence head's all-gathered hidden states
            # The logits (held by the step) and the fp32 log-softmax (the fp32 copy of bf16 logits is freed).
            stored += out_tokens * vocab_local * (e + 4)
            depths = sum(1 for layer in stage.layers if blocks[layer].mtp)
            if depths:
                # Multi-token prediction: every depth's head_norm output, kept (gathered) by the shared
                # output head, and the fp32 log-softmax of its own logits (its cross-entropy runs in the
                # forward, which frees the logits); the lookahead ids (batch, seq, depth, 2) int64.
                stored += depths * tokens * (e * h + 4 * vocab_local) + tokens * 16 * depths
            # Backward starts with two fp32 vocab-sized gradients (of the log-softmax output and input);
            # a block's recompute comes later, so the larger of the two counts.
            transient = max(transient, out_tokens * vocab_local * 8)
        else:
            stored += tokens * e_res * h // tp  # the stage output, kept until its gradient arrives
        if encoder_decoder and stage.first and ((not autocast and tp == 1) or mode == "full"):
            # The encoder's output, which every decoder block's cross-attention keeps (wk and wv read
            # it; under autocast they keep bf16 casts of it, under TP gathered copies, per block), or
            # the decoder blocks' checkpoints keep as their input.
            stored += tokens * e_res * h // tp
        stored += score_bias_bytes(stage)
        # The gradient flowing back through the residual stream, plus the one being computed (an
        # encoder-decoder's backward starts in the decoder, whose tokens are the output's).
        transient += 2 * (out_tokens if stage.last else tokens) * e * h
        return stored, transient, full_layer

    def score_bias_bytes(stage: StageShape) -> int:
        """A float score bias (T5's relative positions) is computed once per stack and kept by every
        block's attention kernel: (batch, heads, s, s) for an encoder, whose bias includes the padding
        mask, (1, heads, s, s) for a causal decoder, in the parameters' compute dtype, with the int64
        (s, s) bucket ids its table lookup keeps."""
        out = 0
        for decoder, length in ((False, seq_local), (True, dec_seq)):
            if any(blocks[i].score_bias and blocks[i].cross_attention == decoder for i in stage.layers):
                heads = next(blocks[i].heads for i in stage.layers if blocks[i].score_bias)
                rows = 1 if decoder else microbatch
                out += 8 * length * length
                if device != "cpu":  # torch's CPU math kernel keeps its probabilities, not the bias
                    out += rows * heads // tp * length * length * (e if fsdp_on else 4)
        return out

    estimates, details = [], []
    for pp_rank, stage_ids in enumerate(per_rank):
        d = AnalyticDetail()
        static = opt_state = grads = gathered = gathered_root = accumulated = 0
        largest_block = root_local = 0
        # Stages holding a vocabulary-split table: the first, and the last when it keeps its own copy of a
        # tied table (multi-token prediction's embedding of the lookahead tokens).
        table_stages = [s for s in stage_ids for p in _stage_end_params(ms, shapes[s]) if p.vocab_table]
        holds_embedding = bool(table_stages)
        stage_grads: dict[int, int] = {}  # what each stage holds as gradients during a pipeline schedule
        for s in stage_ids:
            sp = _stage_param_bytes(ms, shapes[s], sharding, granularity)
            sharded_bytes, tp_local = sp.sharded_bytes, sp.model_local
            d.params_local += sp.sharded
            d.params_tp_local += tp_local
            d.expert_params_local += sp.expert_local
            static += sharded_bytes
            # exp_avg and exp_avg_sq, plus a scalar step counter per parameter (on the host for foreach and
            # for-loop on GPU, but counted: the trace cannot tell, and it is at most 512 bytes each).
            opt_state += 2 * sharded_bytes + sp.tensors * _round(4, granularity)
            grads += sharded_bytes
            largest_block = max(largest_block, sp.largest_block)
            ends = tp_local - sp.blocks
            root_local += ends
            if fsdp_on:
                if reshard == "never":
                    gathered += tp_local * e
                else:
                    # The root stays gathered unless "always"; about two blocks are gathered at a time
                    # (an MoE block's experts, router and shared experts are FSDP units of their own,
                    # gathered inside it: its routed experts gather this rank's ep share of them).
                    root = 0 if reshard == "always" else ends * e
                    gathered += root + min(shapes[s].num_layers, 2) * sp.largest_block * e
                    gathered_root += root
                if dims.pp_enabled:
                    # No gradient sync between microbatches: fp32 unsharded accumulators until the end.
                    accumulated += tp_local * 4
            elif half:
                gathered += tp_local * 2  # autocast's half-precision weight copies, saved for backward
            stage_grads[s] = tp_local * 4 if fsdp_on else sharded_bytes
        if not fsdp_on:
            gathered_root = gathered
        if offload:
            # Sharded parameters, their gradients and the optimizer state live in host memory.
            d.host_bytes, static, grads, opt_state = static + grads + opt_state, 0, 0, 0
        static += sum(_stage_buffer_bytes(ms, shapes[s]) for s in stage_ids)  # buffers (a RoPE table)
        embed_extra = whole_briefly = 0
        # A table tied to the output projection of the same stage has one gradient, the projection's
        # sharded one: the embedding's whole gradient is added into it and freed.
        tied_here = ms.vocab_tied and any(shapes[s].first and shapes[s].last for s in stage_ids)
        if holds_embedding and embedding_grad_full:
            embed_extra = embedding_grad_full - embedding_local
            if dims.pp_enabled and fsdp_on:
                accumulated += len(table_stages) * embed_extra * 4
            elif not fsdp_on and tied_here:
                whole_briefly = embed_extra * 4
            elif not fsdp_on:
                grads += len(table_stages) * embed_extra * 4  # the Replicate gradient stays whole until the step
            if dims.pp_enabled:
                for s in table_stages:
                    stage_grads[s] += embed_extra * 4

        acts = [stage_acts(shapes[s]) for s in stage_ids]
        # In-flight chunks spread over the rank's stages (interleaved warm-up runs them round-robin).
        stored_chunk = sum(a[0] for a in acts) // len(acts)
        transient = max(a[1] for a in acts)
        d.layer_activation_bytes = max(a[2] for a in acts)
        if dims.pp_enabled:
            d.in_flight = in_flight_chunks(p.pipeline_parallel_schedule, dims.pp, pp_rank, n_microbatches,
                                           len(stage_ids))
        stored = stored_chunk * d.in_flight
        d.stored_per_microbatch = stored_chunk

        moments: list[tuple[Breakdown, str]] = []
        if dims.pp_enabled:
            # The start of every backward: the chunks then in flight, and the gradients (accumulators
            # under FSDP) of the stages that have already run a backward; keep the largest. The first
            # backward holds the most chunks but no gradients yet (zero_grad freed them); when the
            # warm-up covers every microbatch, no backward holds both.
            if holds_embedding and embedding_grad_full and fsdp_on:
                transient = max(transient, embedding_grad_full * e)
            later_first = sorted(stage_ids, reverse=True)
            total_chunks = len(stage_ids) * n_microbatches
            best: tuple[Breakdown, str] | None = None
            starts = backward_moments(p.pipeline_parallel_schedule, dims.pp, pp_rank, n_microbatches, len(stage_ids))
            # Which of the rank's stages the chunks in flight belong to (their activations differ: the
            # last stage's include the logits); the V schedules' chunks are spread evenly.
            by_stage = in_flight_by_stage(p.pipeline_parallel_schedule, dims.pp, pp_rank, n_microbatches,
                                          len(stage_ids))
            # Distinct (chunks, stages with gradients) -> first backward index: the planner calls this a lot.
            first_of: dict[tuple, int] = {}
            for j, pair in enumerate(starts):
                first_of.setdefault((pair, by_stage[j] if by_stage is not None else None), j)
            for ((chunks, with_grads), per_stage), j in first_of.items():
                held = later_first if grad_accum > 1 else later_first[:with_grads]
                stored_now = (stored_chunk * chunks if per_stage is None
                              else sum(c * a[0] for c, a in zip(per_stage, acts)))
                b = Breakdown(parameters=static, gathered_parameters=gathered,
                              gradients=sum(stage_grads[s] for s in held), optimizer_state=opt_state,
                              activations=stored_now, transient=transient)
                if best is None or b.total > best[0].total:
                    best = (b, f"start of backward {j + 1} of {total_chunks} in the schedule")
            moments.append(best)
        else:
            # Unsharded gradients of the block being reduced (param dtype, then the fp32 reduce-scatter input).
            if fsdp_on:
                transient += largest_block * (e + 4)
            moments.append((Breakdown(parameters=static, gathered_parameters=gathered,
                                      gradients=grads if grad_accum > 1 else 0, optimizer_state=opt_state,
                                      activations=stored, transient=transient), "start of backward"))
            # The root (embedding, norm, output) is reduced last; the embedding's gradient is whole first.
            end = root_local * (e + 4) if fsdp_on else 0
            end += embedding_grad_full * e if fsdp_on else whole_briefly
            moments.append((Breakdown(parameters=static, gathered_parameters=gathered_root, gradients=grads,
                                      optimizer_state=opt_state, transient=end), "end of backward"))
        # Optimizer step: foreach AdamW materializes one state-sized intermediate (sqrt(exp_avg_sq)).
        opt_tmp = {"foreach": grads, "fused": 0}.get(o.implementation, largest_block * 4)
        if offload:
            opt_tmp = 0  # the optimizer steps on the host
        moments.append((Breakdown(parameters=static, gradients=grads, optimizer_state=opt_state,
                                  transient=opt_tmp), "optimizer step"))
        peak, phase = max(moments, key=lambda m: m[0].total)
        if prep.float8 is not None and prep.float8.fsdp_float8_all_gather and fsdp_on:
            peak = peak - Breakdown(gathered_parameters=int(peak.gathered_parameters * float8_share(prep) / 2))
        rank = pp_rank * (dims.world_size // dims.pp)
        estimates.append(RankEstimate(rank=rank, pp_rank=pp_rank, stages=list(stage_ids), peak=peak, peak_phase=phase,
                                      phases={name: b for b, name in moments}))
        details.append(d)
    return estimates, details


def float8_share(prep: PreparedJob) -> float:
    """Fraction of the model's parameters in the linears float8 converts: the trainer's own filter
    (nn.Linear, not named by float8.filter_fqns, features multiples of 16) over the meta model."""
    from titanlike.models.converters import LinearSelection, linear_filter

    ms = model_shape(prep)
    keep = linear_filter(prep.float8.filter_fqns, LinearSelection())
    linear = sum(m.weight.numel() for name, m in ms.model.named_modules() if keep(m, name))
    return linear / ms.total_params


def model_parameter_count(args, *, active: bool = False) -> int:
    """Parameters of the whole model, tied weights once (the family's own count); active: those one
    token uses (of a mixture of experts' routed experts only top_k)."""
    return args.num_params(active=active)


def bytes_per_parameter(prep: PreparedJob) -> dict[str, float]:
    """The textbook per-parameter figures of this layout (bytes per model parameter per rank); for
    a mixture of experts also per routed-expert parameter ("experts"), split over ep x efsdp."""
    dims, cfg = prep.dims, prep.cfg
    shard = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
    per = 1 / (shard * dims.tp * dims.pp)
    e = _BYTES[cfg.training.mixed_precision_param]
    out = {"parameters": 4 * per, "gradients": 4 * per, "optimizer_state": 8 * per,
           "gathered_copy": e / (dims.tp * dims.pp),
           # training.enable_cpu_offload: parameters, gradients and optimizer state are in host memory.
           "host_memory": bool(cfg.training.enable_cpu_offload and dims.fsdp_enabled)}
    if prep.model_args.moe_args() is not None:
        sh = Sharding.of(dims)
        per_expert = 1 / (sh.ep * sh.expert * dims.pp)
        out["experts"] = {"parameters": 4 * per_expert, "gradients": 4 * per_expert,
                          "optimizer_state": 8 * per_expert, "gathered_copy": e / (sh.ep * dims.pp)}
    return out


__all__ = ["AnalyticDetail", "BlockShape", "MLAShape", "MoEShape", "ModelShape", "Sharding", "StageShape",
           "UnknownBlockError", "backward_moments", "bytes_per_parameter", "estimate_analytic", "float8_share",
           "in_flight_by_stage", "in_flight_chunks",
           "layer_activation_bytes", "model_parameter_count", "model_shape", "moe_rows", "moe_saved_bytes",
           "moe_transient_bytes", "norm_bytes", "read_model", "stage_layout", "weight_grad_share"]
