"""Closed-form memory per rank for any model family built from the common blocks, under any layout.

What the model is, is read from the family's own meta model (built once per job, see
`model_shape`), never from its args' field names: the parameters and buffers with their shapes,
the family's tensor-parallel plan, its pipeline ends and tied weights, and the building blocks
of its transformer block, recognized by module type.

Bytes per parameter. Parameters are fp32 masters sharded by FSDP over dp_shard x cp
(HSDP replicas hold the same shard); TP first splits them as the plan says: a parameter of a
colwise linear on dim 0 (weight and bias), of a rowwise linear on dim 1 of the weight (the bias
stays whole), the vocab_embedding and vocab_output tables on dim 0 with ceil division (uneven
vocabulary shards: TP rank 0 holds the larger one), everything else (norms, a learned position
table) whole. Tied weights count once on a stage that holds both ends. Buffers (a RoPE table)
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
A block made of anything else (another block class, another mixer or MLP, blocks that differ
from each other) is refused with a ValueError: use the traced estimate for it.

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
backward, which holds the most, there are none yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

from estimation.memory import Breakdown, RankEstimate
from estimation.options import PreparedJob

_BYTES = {"bfloat16": 2, "float32": 4}


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
    """What one model part holds: some transformer layers, maybe the input and output ends."""

    num_layers: int
    first: bool
    last: bool


def stage_layout(prep: PreparedJob) -> tuple[list[list[int]], list[StageShape]]:
    """(stage indices held by each pp rank, shape of every stage), as the trainer splits the model."""
    from titanlike.train.model_parts import pipeline_layout

    layout = pipeline_layout(prep.cfg, prep.dims, prep.model_args)
    if layout is None:
        return [[0]], [StageShape(prep.model_args.num_layers, True, True)]
    shapes = [StageShape(n, s == 0, s == layout.num_stages - 1) for s, n in enumerate(layout.layers)]
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


@dataclass
class AnalyticDetail:
    """The intermediate quantities, for explanations and the planner."""

    params_local: int = 0          # parameters this rank stores (after TP and FSDP), elements
    params_tp_local: int = 0       # parameters of this rank's stages after TP only, elements
    layer_activation_bytes: int = 0
    stored_per_microbatch: int = 0
    in_flight: int = 1
    notes: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# The model, read from the family's meta model.


# The norms the activation count knows, by module type.
_NORMS = {nn.RMSNorm: "rmsnorm", nn.LayerNorm: "layernorm"}


class UnknownBlockError(ValueError):
    """The analytic model does not know a part of this model; the traced estimate does."""


@dataclass(frozen=True)
class ParamShape:
    """One parameter of the meta model."""

    name: str                       # full name; block parameters are those of the first block
    shape: tuple[int, ...]
    style: str | None               # tensor-parallel style of the module holding it (None: not in the plan)
    group: str                      # "block", "inputs" (first stage), "outputs" (last stage) or "always"
    tied_to: str | None = None      # an alias of a tied weight: the group of its owner

    def local(self, tp: int) -> tuple[int, int]:
        """(dim 0, product of the other dims) of this rank's piece after tensor parallelism."""
        dims = list(self.shape) or [1]
        if tp > 1:
            if self.style in ("colwise", "vocab_embedding", "vocab_output"):
                dims[0] = _ceil_div(dims[0], tp)
            elif self.style == "rowwise" and len(dims) > 1:  # a rowwise bias stays whole
                dims[1] = _ceil_div(dims[1], tp)
        return dims[0], _prod(dims[1:])


@dataclass(frozen=True)
class NormShape:
    kind: str      # "rmsnorm" | "layernorm"
    readers: int   # linears reading its output (autocast casts it once for each)


@dataclass(frozen=True)
class BlockShape:
    """The widths of one block's building blocks, for the activation count."""

    hidden: int
    norms: tuple[NormShape, ...]
    q_dim: int
    kv_dim: int
    heads: int
    attention_inputs: int   # output features of the linears reading the attention's input (q + 2 kv)
    mlp_saved: int          # MLP elements saved per token, before TP (SwiGLU 4 f, GELU 2 f)
    mlp_inputs: int         # output features of the MLP's input linears (SwiGLU 2 f, GELU f)
    mlp_hidden: int         # input features of the MLP's output linear (f)
    rowwise_outputs: int    # linears writing back into the residual stream (attention's wo, the MLP's w2)


@dataclass
class ModelShape:
    """What the analytic estimate needs of a model, read once from its meta instance."""

    model: object                    # the meta model itself (float8's linear filter runs on it)
    hidden: int
    block_params: list[ParamShape]
    end_params: list[ParamShape]
    block_buffer_bytes: int
    end_buffer_bytes: dict[str, int]  # group -> bytes
    total_params: int                 # tied weights once
    vocab_table: tuple[int, ...] | None   # shape of the vocab_embedding table (its gradient is whole under TP)
    vocab_tied: bool                  # that table is tied to another parameter (the output projection)
    output_vocab: int                 # columns of the logits
    output_norms: tuple[str, ...]     # norm kinds of the output end
    block: BlockShape | None
    unknown: str | None               # why the activation model does not apply, or None

    def require_known(self) -> BlockShape:
        if self.block is None:
            raise UnknownBlockError(f"the analytic memory model does not know {self.unknown}; "
                                    "use the traced estimate (--estimate.mode traced)")
        return self.block


_SHAPES: dict[tuple[str, str], ModelShape] = {}


def model_shape(prep: PreparedJob) -> ModelShape:
    """The job's model as the analytic estimate sees it; built on meta once per (family, args)."""
    from titanlike.models.registry import get_model_spec

    key = (prep.cfg.model.name, repr(prep.model_args))
    shape = _SHAPES.get(key)
    if shape is None:
        if len(_SHAPES) >= 8:
            _SHAPES.pop(next(iter(_SHAPES)))
        shape = _SHAPES[key] = read_model(get_model_spec(prep.cfg.model.name), prep.model_args)
    return shape


def read_model(spec, args) -> ModelShape:
    """Build spec.model_cls(args) on meta and read its parameters, buffers and blocks."""
    import torch

    with torch.device("meta"):
        model = spec.model_cls(args)
    plan = spec.tp_plan
    top_styles = dict(plan.top) if plan is not None else {}
    block_styles = dict(plan.block) if plan is not None else {}
    ends = spec.pipeline_ends
    inputs = set(ends.inputs) if ends is not None else set()
    outputs = set(ends.outputs) if ends is not None else set()

    def group_of(name: str) -> str:
        head = name.split(".", 1)[0]
        if head == "layers":
            return "block"
        return "inputs" if head in inputs else "outputs" if head in outputs else "always"

    first_key = next(iter(model.layers.keys()))
    prefix = f"layers.{first_key}."
    tied = dict(getattr(model, "tied_weights", {}) or {})
    block_params, end_params = [], []
    for name, p in model.named_parameters(remove_duplicate=False):
        group = group_of(name)
        module = name.rpartition(".")[0]
        if group == "block":
            if name.startswith(prefix):
                block_params.append(ParamShape(name, tuple(p.shape), block_styles.get(module[len(prefix):]), group))
            continue
        owner = tied.get(name)
        end_params.append(ParamShape(name, tuple(p.shape), top_styles.get(module), group,
                                     tied_to=group_of(owner) if owner is not None else None))
    block_buffers, end_buffers = 0, {}
    for name, b in model.named_buffers():
        group = group_of(name)
        if group == "block":
            block_buffers += b.numel() * b.element_size() if name.startswith(prefix) else 0
        else:
            end_buffers[group] = end_buffers.get(group, 0) + b.numel() * b.element_size()
    total = sum(p.numel() for p in model.parameters())
    hidden = args.hidden_size
    vocab = next((p for p in end_params if p.style == "vocab_embedding"), None)
    vocab_table = vocab.shape if vocab is not None else None
    vocab_tied = vocab is not None and vocab.name in tied.values()
    block, unknown = _read_block(model, hidden)
    # The ends: the pipeline's, or without a pipeline split the plan's top-level norms and projection.
    if ends is None:
        outputs = {name for name, style in top_styles.items() if style in ("sequence_norm", "vocab_output")}
        inputs = {name for name, style in top_styles.items() if style in ("vocab_embedding", "position_embedding")}
    output_vocab, output_norms = 0, []
    for name in sorted(outputs):
        module = _submodule(model, name)
        if isinstance(module, nn.Linear):
            output_vocab = module.out_features
        elif type(module) in _NORMS:
            output_norms.append(_NORMS[type(module)])
        elif module is not None and unknown is None:
            block, unknown = None, f"the output end {name} of {type(model).__name__} ({type(module).__name__})"
    for name in sorted(inputs):
        module = _submodule(model, name)
        if module is not None and not isinstance(module, nn.Embedding) and unknown is None:
            block, unknown = None, f"the input end {name} of {type(model).__name__} ({type(module).__name__})"
    if not output_vocab and unknown is None:
        block, unknown = None, f"the output projection of {type(model).__name__} (no pipeline end or plan names it)"
    return ModelShape(model=model, hidden=hidden, block_params=block_params, end_params=end_params,
                      block_buffer_bytes=block_buffers, end_buffer_bytes=end_buffers, total_params=total,
                      vocab_table=vocab_table, vocab_tied=vocab_tied,
                      output_vocab=output_vocab, output_norms=tuple(output_norms), block=block, unknown=unknown)


def _submodule(model, name: str):
    try:
        return model.get_submodule(name)
    except AttributeError:
        return None


def _read_block(model, hidden: int) -> tuple[BlockShape | None, str | None]:
    """The common building blocks of model.layers, by module type; (None, what is unknown) otherwise."""
    from titanlike.models.common.attention import Attention, core_attention
    from titanlike.models.common.block import TransformerBlock
    from titanlike.models.common.feed_forward import FeedForward, GeluMLP

    blocks = list(model.layers.values())
    block = blocks[0]
    what = f"the blocks of {type(model).__name__} ({type(block).__name__})"
    if not isinstance(block, TransformerBlock) or type(block).forward is not TransformerBlock.forward:
        return None, what
    children = dict(block.named_children())
    if set(children) != {"attention_norm", "attention", "ffn_norm", "feed_forward"} \
            or any(True for _ in block.named_parameters(recurse=False)):
        return None, f"{what}: children {', '.join(children)}"
    attention, mlp = block.attention, block.feed_forward
    parts = {"attention_norm": block.attention_norm, "ffn_norm": block.ffn_norm, "attention": attention,
             "feed_forward": mlp}
    for name, module in parts.items():
        known = _NORMS if name.endswith("norm") else (Attention,) if name == "attention" else (FeedForward, GeluMLP)
        if type(module) not in known:
            return None, f"{what}: {name} is a {type(module).__name__}"
    if attention.core_attention is not core_attention:
        return None, f"{what}: its attention runs {getattr(attention.core_attention, '__name__', 'another kernel')}"
    # Every block must be the same (the count is per layer); compare what the count reads.
    signature = _block_signature(block)
    for other in blocks[1:]:
        if _block_signature(other) != signature:
            return None, f"{what}: its blocks differ from each other"
    q_dim, kv_dim = attention.wq.out_features, attention.wk.out_features
    f = mlp.w1.out_features
    if isinstance(mlp, FeedForward):  # SwiGLU saves w1 x, silu(w1 x), w3 x and their product
        mlp_saved, mlp_inputs, mlp_readers = 4 * f, f + mlp.w3.out_features, 2
    else:  # GELU saves its input (w1 x + b) and its output
        mlp_saved, mlp_inputs, mlp_readers = 2 * f, f, 1
    norms = (NormShape(_NORMS[type(block.attention_norm)], 3), NormShape(_NORMS[type(block.ffn_norm)], mlp_readers))
    heads = q_dim // attention.head_dim
    shape = BlockShape(hidden=hidden, norms=norms, q_dim=q_dim, kv_dim=kv_dim, heads=heads,
                       attention_inputs=q_dim + 2 * kv_dim, mlp_saved=mlp_saved, mlp_inputs=mlp_inputs,
                       mlp_hidden=mlp.w2.in_features, rowwise_outputs=2)
    return shape, None


def _block_signature(block) -> tuple:
    return (tuple((name, type(m).__name__) for name, m in block.named_modules()),
            tuple((name, tuple(p.shape)) for name, p in block.named_parameters()))


def norm_bytes(kind: str, hidden: int, e_in: int, device: str = "cuda") -> int:
    """Bytes one norm saves per token (before sequence parallelism), for input elements of e_in bytes."""
    if kind == "rmsnorm":
        return 8 * hidden + 4
    stats = 4 if device == "cuda" or e_in == 4 else e_in
    return e_in * hidden + 2 * stats


def _stage_params(ms: ModelShape, stage: StageShape, tp: int) -> list[tuple[int, int]]:
    """(dim0, rest) of every parameter of a stage after tensor parallelism."""
    groups = {"always"} | ({"inputs"} if stage.first else set()) | ({"outputs"} if stage.last else set())
    shapes = [p.local(tp) for p in ms.block_params] * stage.num_layers
    shapes += [p.local(tp) for p in ms.end_params if p.group in groups and p.tied_to not in groups]
    return shapes


def _stage_buffer_bytes(ms: ModelShape, stage: StageShape) -> int:
    groups = {"always"} | ({"inputs"} if stage.first else set()) | ({"outputs"} if stage.last else set())
    return ms.block_buffer_bytes * stage.num_layers + sum(n for g, n in ms.end_buffer_bytes.items() if g in groups)


def _stage_param_bytes(ms: ModelShape, stage: StageShape, tp: int, fsdp: int,
                       granularity: int) -> tuple[int, int, int, int]:
    """(sharded fp32 bytes, sharded elements, TP-local elements, largest TP-local block elements)."""
    shapes = _stage_params(ms, stage, tp)
    sharded = sum(_round(_ceil_div(d0, fsdp) * rest * 4, granularity) for d0, rest in shapes)
    elements = sum(_ceil_div(d0, fsdp) * rest for d0, rest in shapes)
    tp_local = sum(d0 * rest for d0, rest in shapes)
    block = sum(d0 * rest for d0, rest in (p.local(tp) for p in ms.block_params))
    return sharded, elements, tp_local, block


def layer_activation_bytes(block: BlockShape, tokens: int, *, tp: int, cp: int, e: int, e_res: int, ac: str,
                           rotate_method: str = "allgather", seq_local: int = 0,
                           autocast: bool = False, device: str = "cuda") -> tuple[int, int]:
    """(bytes one layer keeps for backward, bytes recomputed at once in its backward) for
    `tokens` = microbatch x local sequence tokens, before sequence parallelism. device "cpu"
    counts LayerNorm statistics as torch's CPU kernel keeps them (for measurements here)."""
    h, n = block.hidden, block.heads
    qd, kvd = block.q_dim, block.kv_dim
    attention = e * 2 * qd / tp + 4 * n / tp
    if cp > 1 and rotate_method == "allgather":
        # Gathered keys and values are saved at full length, with a bool mask per layer.
        attention += e * 2 * kvd / tp * cp + seq_local * seq_local * cp / max(tokens, 1)
    elif cp > 1:
        # Ring: fp32 copies of q and of every hop's k/v and scores blocks (approximate).
        attention += 4 * qd / tp + cp * (8 * kvd / tp + 3 * 4 * n / tp * seq_local + 3 * 4 * qd / tp)
    else:
        attention += e * 2 * kvd / tp
    # Autocast casts a norm's fp32 output to bf16 once per matmul that reads it (Llama: wq, wk, wv;
    # w1, w3: five saved copies instead of two).
    norm_outputs = sum(norm.readers if autocast else 1 for norm in block.norms)
    norms = sum(norm_bytes(norm.kind, h, e_res, device) for norm in block.norms)
    full = tokens * (norms / tp + norm_outputs * e * h + attention + e * block.mlp_saved / tp)
    block_input = tokens * e_res * h / tp
    if ac == "none":
        return int(full), 0
    if ac == "full":
        return int(block_input), int(full)
    # Op-level: matmul and attention outputs (row-parallel ones before their reduce-scatter).
    op = tokens * (e_res * h / tp + e * block.attention_inputs / tp + e * qd / tp + 4 * n / tp
                   + block.rowwise_outputs * e * h + e * block.mlp_inputs / tp)
    return int(op), int(full)


def weight_grad_share(prep: PreparedJob) -> float | None:
    """Share of a layer's saved activations that are matmul inputs (what a split backward's W step
    still needs after I); None when the analytic model does not know the block."""
    block = model_shape(prep).block
    if block is None:
        return None
    e = 2 if prep.cfg.training.mixed_precision_param == "bfloat16" else 4
    tp, h = prep.dims.tp, block.hidden
    matmul_inputs = len(block.norms) * e * h + e * block.q_dim / tp + e * block.mlp_hidden / tp
    total = (sum(norm_bytes(norm.kind, h, e) for norm in block.norms) / tp + len(block.norms) * e * h
             + e * (2 * block.q_dim + 2 * block.kv_dim) / tp + 4 * block.heads / tp + e * block.mlp_saved / tp)
    return matmul_inputs / total


def _ac_mode(cfg) -> tuple[str, int]:
    """('none' | 'full' | 'op', checkpoint every N-th block) from the config."""
    ac = cfg.activation_checkpoint
    if ac.mode == "none":
        return "none", 1
    if ac.mode == "full":
        return "full", 1
    if ac.selective_ac_option == "op":
        return "op", 1
    return "full", int(ac.selective_ac_option)


def estimate_analytic(prep: PreparedJob, granularity: int = 512) -> tuple[list[RankEstimate], list[AnalyticDetail]]:
    """Peak bytes and breakdown for every pipeline rank (all other ranks are alike).

    The peak is the largest of three moments: the start of backward (every activation
    stored, the loss gradients just created), the end of backward (all gradients, the
    root's reduction) and the optimizer step.
    """
    dims, cfg = prep.dims, prep.cfg
    ms = model_shape(prep)
    block = ms.require_known()
    h = ms.hidden
    t, p, o = cfg.training, cfg.parallelism, cfg.optimizer
    tp, cp = dims.tp, dims.cp
    fsdp_on = dims.fsdp_enabled
    shard = dims.dp_shard * dims.cp if fsdp_on else 1
    bf16 = t.mixed_precision_param == "bfloat16"
    e = 2 if bf16 else 4
    # Without FSDP, autocast leaves the residual stream (block inputs, norms) in fp32.
    e_res = e if fsdp_on or not bf16 else 4
    autocast = bf16 and not fsdp_on
    seq_local = t.seq_len // cp
    mode, every = _ac_mode(cfg)
    reshard = p.fsdp_reshard_after_forward
    if dims.pp_enabled and reshard == "default":
        reshard = "never"
    grad_accum = 1
    if t.global_batch_size != -1:
        grad_accum = t.global_batch_size // (t.local_batch_size * dims.dp_degree)

    per_rank, shapes = stage_layout(prep)
    microbatch = p.pipeline_parallel_microbatch_size if dims.pp_enabled else t.local_batch_size
    n_microbatches = t.local_batch_size // microbatch if dims.pp_enabled else 1
    tokens = microbatch * seq_local
    vocab_local = _ceil_div(ms.output_vocab, tp)
    # torch's DTensor gives the vocabulary-sharded embedding a Replicate gradient: every TP rank
    # materializes the whole table's gradient before FSDP (or nothing) shards it again.
    embedding_grad_full = embedding_local = 0
    if tp > 1 and ms.vocab_table is not None:
        rows, rest = ms.vocab_table[0], _prod(ms.vocab_table[1:])
        embedding_grad_full, embedding_local = rows * rest, _ceil_div(rows, tp) * rest
    # The output end's norm(s), on this rank's slice of the sequence.
    output_norms = sum(norm_bytes(kind, h, e_res) for kind in ms.output_norms)

    def stage_acts(stage: StageShape) -> tuple[int, int, int]:
        """(stored bytes per microbatch, backward transient, one layer's full activations)."""
        stored, transient = 0, 0
        full_layer, _ = layer_activation_bytes(block, tokens, tp=tp, cp=cp, e=e, e_res=e_res, ac="none",
                                               rotate_method=p.context_parallel_rotate_method, seq_local=seq_local,
                                               autocast=autocast)
        for i in range(stage.num_layers):
            layer_mode = mode if (mode != "full" or i % every == 0) else "none"
            kept, recompute = layer_activation_bytes(
                block, tokens, tp=tp, cp=cp, e=e, e_res=e_res, ac=layer_mode,
                rotate_method=p.context_parallel_rotate_method, seq_local=seq_local, autocast=autocast)
            stored += kept
            transient = max(transient, recompute)
        if stage.first:
            stored += tokens * 8  # the token ids, kept by the embedding's backward
        else:
            stored += tokens * e_res * h // tp  # the stage input received from the previous stage
        if stage.last:
            stored += tokens * (output_norms // tp + e * h)  # final norm and its gathered output
            # The logits (held by the step) and the fp32 log-softmax (the fp32 copy of bf16 logits is freed).
            stored += tokens * vocab_local * (e + 4)
            # Backward starts with two fp32 vocab-sized gradients (of the log-softmax output and input);
            # a block's recompute comes later, so the larger of the two counts.
            transient = max(transient, tokens * vocab_local * 8)
        else:
            stored += tokens * e_res * h // tp  # the stage output, kept until its gradient arrives
        # The gradient flowing back through the residual stream, plus the one being computed.
        transient += 2 * tokens * e * h
        return stored, transient, full_layer

    estimates, details = [], []
    for pp_rank, stage_ids in enumerate(per_rank):
        d = AnalyticDetail()
        static = opt_state = grads = gathered = gathered_root = accumulated = 0
        largest_block = root_local = 0
        holds_embedding = any(shapes[s].first for s in stage_ids)
        stage_grads: dict[int, int] = {}  # what each stage holds as gradients during a pipeline schedule
        for s in stage_ids:
            sharded_bytes, elements, tp_local, block_elements = _stage_param_bytes(ms, shapes[s], tp, shard,
                                                                                   granularity)
            d.params_local += elements
            d.params_tp_local += tp_local
            static += sharded_bytes
            # exp_avg and exp_avg_sq, plus a scalar step counter per parameter (on the host for foreach and
            # for-loop on GPU, but counted: the trace cannot tell, and it is at most 512 bytes each).
            n_tensors = len(_stage_params(ms, shapes[s], tp))
            opt_state += 2 * sharded_bytes + n_tensors * _round(4, granularity)
            grads += sharded_bytes
            largest_block = max(largest_block, block_elements)
            ends = tp_local - shapes[s].num_layers * block_elements
            root_local += ends
            if fsdp_on:
                if reshard == "never":
                    gathered += tp_local * e
                else:
                    # The root stays gathered unless "always"; about two blocks are gathered at a time.
                    root = 0 if reshard == "always" else ends * e
                    gathered += root + min(shapes[s].num_layers, 2) * block_elements * e
                    gathered_root += root
                if dims.pp_enabled:
                    # No gradient sync between microbatches: fp32 unsharded accumulators until the end.
                    accumulated += tp_local * 4
            elif bf16:
                gathered += tp_local * 2  # autocast's bf16 weight copies, saved for backward
            stage_grads[s] = tp_local * 4 if fsdp_on else sharded_bytes
        if not fsdp_on:
            gathered_root = gathered
        static += sum(_stage_buffer_bytes(ms, shapes[s]) for s in stage_ids)  # buffers (a RoPE table)
        embed_extra = whole_briefly = 0
        # A table tied to the output projection of the same stage has one gradient, the projection's
        # sharded one: the embedding's whole gradient is added into it and freed.
        tied_here = ms.vocab_tied and any(shapes[s].first and shapes[s].last for s in stage_ids)
        if holds_embedding and embedding_grad_full:
            embed_extra = embedding_grad_full - embedding_local
            if dims.pp_enabled and fsdp_on:
                accumulated += embed_extra * 4
            elif not fsdp_on and tied_here:
                whole_briefly = embed_extra * 4
            elif not fsdp_on:
                grads += embed_extra * 4  # the Replicate gradient stays whole until the step
            if dims.pp_enabled:
                stage_grads[next(s for s in stage_ids if shapes[s].first)] += embed_extra * 4

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
            # Distinct (chunks, stages with gradients) -> first backward index: the planner calls this a lot.
            first_of: dict[tuple[int, int], int] = {}
            for j, pair in enumerate(starts):
                first_of.setdefault(pair, j)
            for (chunks, with_grads), j in first_of.items():
                held = later_first if grad_accum > 1 else later_first[:with_grads]
                b = Breakdown(parameters=static, gathered_parameters=gathered,
                              gradients=sum(stage_grads[s] for s in held), optimizer_state=opt_state,
                              activations=stored_chunk * chunks, transient=transient)
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


def model_parameter_count(args) -> int:
    """Parameters of the whole model, tied weights once (the family's own count)."""
    return args.num_params()


def bytes_per_parameter(prep: PreparedJob) -> dict[str, float]:
    """The textbook per-parameter figures of this layout (bytes per model parameter per rank)."""
    dims, cfg = prep.dims, prep.cfg
    shard = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
    per = 1 / (shard * dims.tp * dims.pp)
    e = _BYTES[cfg.training.mixed_precision_param]
    return {"parameters": 4 * per, "gradients": 4 * per, "optimizer_state": 8 * per,
            "gathered_copy": e / (dims.tp * dims.pp)}


__all__ = ["AnalyticDetail", "BlockShape", "ModelShape", "StageShape", "UnknownBlockError", "backward_moments",
           "bytes_per_parameter", "estimate_analytic", "float8_share", "in_flight_chunks", "layer_activation_bytes",
           "model_parameter_count", "model_shape", "norm_bytes", "read_model", "stage_layout", "weight_grad_share"]
