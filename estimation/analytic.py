"""Closed-form memory per rank for the Llama 3 family under any layout.

Bytes per parameter. Parameters are fp32 masters sharded by FSDP over dp_shard x cp
(HSDP replicas hold the same shard); TP first splits the matrices (and the vocabulary)
by the tensor-parallel degree. Gradients take 4 bytes per local parameter (the
reduce dtype is fp32), AdamW 8 (exp_avg and exp_avg_sq). Compute copies: FSDP
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
Their 34 s b h + 5 a s^2 b bytes per GPT layer assumes GELU, dropout, LayerNorm and
materialized attention scores; this model differs, so the count is redone for its
ops (checked tensor by tensor with saved-tensor hooks on one block: exact to the
byte in fp32 and bf16). Per token of a layer, with e bytes per compute element,
h = dim, f = ffn hidden, qd/kvd = query/key-value widths, n = heads, t = TP degree:

    RMSNorm x2 (fp32 input, fp32 normalized, fp32 rstd)   2 (8h + 4) / t
    norm outputs, all-gathered by sequence parallelism    2 e h          (not / t; 5 e h under
                                                          autocast, which casts once per matmul)
    q, k, v after RoPE, attention output                  e (2 qd + 2 kvd) / t
    flash-attention log-sum-exp (fp32)                    4 n / t
    SwiGLU: w1 x, silu(w1 x), w3 x, their product         4 e f / t

Flash attention never stores the s x s scores, so the a s^2 term is gone. The
all-gathered norm outputs are what DTensor's sequence parallelism saves for the
column-parallel matmuls (Megatron saves the shard and gathers again in backward),
so that term does not shrink with TP. Context parallelism divides the sequence by
cp, but all-gather attention saves the gathered keys and values (full length).

Activation checkpointing: full keeps only each block's input (e h / t per token)
and recomputes one block at a time in backward; "selective N" does that for every
N-th block; "op" keeps the outputs of matmuls and attention and recomputes the
elementwise rest. The output end keeps the final norm, its gathered output, the
logits (held by the training step) and the fp32 log-softmax; the first backward
step of the loss adds two fp32 vocab-sized gradients.

Pipeline parallelism multiplies one microbatch's stage activations by the
microbatches in flight, from the schedule's warm-up depth (see `in_flight_chunks`,
which tests check against torch's own schedule tables), and adds the gradients of
the stages that have already run a backward (`backward_moments`): at the first
backward, which holds the most, there are none yet.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from estimation.memory import Breakdown, RankEstimate
from estimation.options import PreparedJob

_BYTES = {"bfloat16": 2, "float32": 4}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round(nbytes: int, granularity: int) -> int:
    return _ceil_div(nbytes, granularity) * granularity if nbytes else 0


@dataclass(frozen=True)
class StageShape:
    """What one model part holds: some transformer layers, maybe the input and output ends."""

    n_layers: int
    first: bool
    last: bool


def stage_layout(prep: PreparedJob) -> tuple[list[list[int]], list[StageShape]]:
    """(stage indices held by each pp rank, shape of every stage)."""
    args, dims, p = prep.model_args, prep.dims, prep.cfg.parallelism
    if not dims.pp_enabled:
        return [[0]], [StageShape(args.n_layers, True, True)]
    from titanlike.parallel.pipeline import plan_layout

    layout = plan_layout(args.n_layers, dims.pp, p.pipeline_parallel_schedule, p.pipeline_parallel_layers_per_stage)
    shapes = [StageShape(n, s == 0, s == layout.num_stages - 1) for s, n in enumerate(layout.layers)]
    return [layout.stages_of_rank(r) for r in range(dims.pp)], shapes


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


def _param_shapes(args, stage: StageShape, tp: int) -> list[tuple[int, int]]:
    """(dim0, rest) of every parameter of a stage after tensor parallelism."""
    h, f = args.dim, args.ffn_hidden_dim
    qd, kvd = args.n_heads * args.head_dim, args.num_kv_heads * args.head_dim
    block = [(h, 1), (qd // tp, h), (kvd // tp, h), (kvd // tp, h), (h, qd // tp),
             (h, 1), (f // tp, h), (h, f // tp), (f // tp, h)]
    shapes = block * stage.n_layers
    vocab = _ceil_div(args.vocab_size, tp)  # uneven vocab shards: rank 0 holds the larger one
    if stage.first:
        shapes.append((vocab, h))
    if stage.last:
        shapes.append((h, 1))
        if not (args.tie_word_embeddings and stage.first):
            shapes.append((vocab, h))
    return shapes


def _stage_param_bytes(args, stage: StageShape, tp: int, fsdp: int, granularity: int) -> tuple[int, int, int, int]:
    """(sharded fp32 bytes, sharded elements, TP-local elements, largest TP-local block elements)."""
    shapes = _param_shapes(args, stage, tp)
    sharded = sum(_round(_ceil_div(d0, fsdp) * rest * 4, granularity) for d0, rest in shapes)
    elements = sum(_ceil_div(d0, fsdp) * rest for d0, rest in shapes)
    tp_local = sum(d0 * rest for d0, rest in shapes)
    block = sum(d0 * rest for d0, rest in _param_shapes(args, StageShape(1, False, False), tp))
    return sharded, elements, tp_local, block


def layer_activation_bytes(args, tokens: int, *, tp: int, cp: int, e: int, e_res: int, ac: str,
                           rotate_method: str = "allgather", seq_local: int = 0,
                           autocast: bool = False) -> tuple[int, int]:
    """(bytes one layer keeps for backward, bytes recomputed at once in its backward) for
    `tokens` = microbatch x local sequence tokens, before sequence parallelism."""
    h, f, n = args.dim, args.ffn_hidden_dim, args.n_heads
    qd, kvd = n * args.head_dim, args.num_kv_heads * args.head_dim
    attention = e * 2 * qd / tp + 4 * n / tp
    if cp > 1 and rotate_method == "allgather":
        # Gathered keys and values are saved at full length, with a bool mask per layer.
        attention += e * 2 * kvd / tp * cp + seq_local * seq_local * cp / max(tokens, 1)
    elif cp > 1:
        # Ring: fp32 copies of q and of every hop's k/v and scores blocks (approximate).
        attention += 4 * qd / tp + cp * (8 * kvd / tp + 3 * 4 * n / tp * seq_local + 3 * 4 * qd / tp)
    else:
        attention += e * 2 * kvd / tp
    # Autocast casts a norm's fp32 output to bf16 once per matmul that reads it (wq, wk, wv; w1, w3):
    # five saved copies instead of two.
    norm_outputs = 5 if autocast else 2
    full = tokens * (2 * (8 * h + 4) / tp + norm_outputs * e * h + attention + 4 * e * f / tp)
    block_input = tokens * e_res * h / tp
    if ac == "none":
        return int(full), 0
    if ac == "full":
        return int(block_input), int(full)
    # Op-level: matmul and attention outputs (row-parallel ones before their reduce-scatter).
    op = tokens * (e_res * h / tp + e * (qd + 2 * kvd) / tp + e * qd / tp + 4 * n / tp
                   + 2 * e * h + 2 * e * f / tp)
    return int(op), int(full)


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
    args, dims, cfg = prep.model_args, prep.dims, prep.cfg
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
    vocab_local = _ceil_div(args.vocab_size, tp)
    # torch's DTensor gives the vocabulary-sharded embedding a Replicate gradient: every TP rank
    # materializes the whole table's gradient before FSDP (or nothing) shards it again.
    embedding_grad_full = args.vocab_size * args.dim if tp > 1 else 0

    def stage_acts(stage: StageShape) -> tuple[int, int, int]:
        """(stored bytes per microbatch, backward transient, one layer's full activations)."""
        stored, transient = 0, 0
        full_layer, _ = layer_activation_bytes(args, tokens, tp=tp, cp=cp, e=e, e_res=e_res, ac="none",
                                               rotate_method=p.context_parallel_rotate_method, seq_local=seq_local,
                                               autocast=autocast)
        for i in range(stage.n_layers):
            layer_mode = mode if (mode != "full" or i % every == 0) else "none"
            kept, recompute = layer_activation_bytes(
                args, tokens, tp=tp, cp=cp, e=e, e_res=e_res, ac=layer_mode,
                rotate_method=p.context_parallel_rotate_method, seq_local=seq_local, autocast=autocast)
            stored += kept
            transient = max(transient, recompute)
        if stage.first:
            stored += tokens * 8  # the token ids, kept by the embedding's backward
        else:
            stored += tokens * e_res * args.dim // tp  # the stage input received from the previous stage
        if stage.last:
            stored += tokens * ((8 * args.dim + 4) // tp + e * args.dim)  # final norm and its gathered output
            # The logits (held by the step) and the fp32 log-softmax (the fp32 copy of bf16 logits is freed).
            stored += tokens * vocab_local * (e + 4)
            # Backward starts with two fp32 vocab-sized gradients (of the log-softmax output and input);
            # a block's recompute comes later, so the larger of the two counts.
            transient = max(transient, tokens * vocab_local * 8)
        else:
            stored += tokens * e_res * args.dim // tp  # the stage output, kept until its gradient arrives
        # The gradient flowing back through the residual stream, plus the one being computed.
        transient += 2 * tokens * e * args.dim
        return stored, transient, full_layer

    estimates, details = [], []
    for pp_rank, stage_ids in enumerate(per_rank):
        d = AnalyticDetail()
        static = opt_state = grads = gathered = gathered_root = accumulated = 0
        largest_block = root_local = 0
        holds_embedding = any(shapes[s].first for s in stage_ids)
        stage_grads: dict[int, int] = {}  # what each stage holds as gradients during a pipeline schedule
        for s in stage_ids:
            sharded_bytes, elements, tp_local, block = _stage_param_bytes(args, shapes[s], tp, shard, granularity)
            d.params_local += elements
            d.params_tp_local += tp_local
            static += sharded_bytes
            # exp_avg and exp_avg_sq, plus a scalar step counter per parameter (on the host for foreach and
            # for-loop on GPU, but counted: the trace cannot tell, and it is at most 512 bytes each).
            n_tensors = len(_param_shapes(args, shapes[s], tp))
            opt_state += 2 * sharded_bytes + n_tensors * _round(4, granularity)
            grads += sharded_bytes
            largest_block = max(largest_block, block)
            ends = tp_local - shapes[s].n_layers * block
            root_local += ends
            if fsdp_on:
                if reshard == "never":
                    gathered += tp_local * e
                else:
                    # The root stays gathered unless "always"; about two blocks are gathered at a time.
                    root = 0 if reshard == "always" else ends * e
                    gathered += root + min(shapes[s].n_layers, 2) * block * e
                    gathered_root += root
                if dims.pp_enabled:
                    # No gradient sync between microbatches: fp32 unsharded accumulators until the end.
                    accumulated += tp_local * 4
            elif bf16:
                gathered += tp_local * 2  # autocast's bf16 weight copies, saved for backward
            stage_grads[s] = tp_local * 4 if fsdp_on else sharded_bytes
        if not fsdp_on:
            gathered_root = gathered
        static += 4 * args.max_seq_len * args.head_dim * len(stage_ids)  # the RoPE table buffer
        embed_extra = 0
        if holds_embedding and embedding_grad_full:
            embed_extra = embedding_grad_full - vocab_local * args.dim
            if dims.pp_enabled and fsdp_on:
                accumulated += embed_extra * 4
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
            end += embedding_grad_full * e if fsdp_on else 0
            moments.append((Breakdown(parameters=static, gathered_parameters=gathered_root, gradients=grads,
                                      optimizer_state=opt_state, transient=end), "end of backward"))
        # Optimizer step: foreach AdamW materializes one state-sized intermediate (sqrt(exp_avg_sq)).
        opt_tmp = {"foreach": grads, "fused": 0}.get(o.implementation, largest_block * 4)
        moments.append((Breakdown(parameters=static, gradients=grads, optimizer_state=opt_state,
                                  transient=opt_tmp), "optimizer step"))
        peak, phase = max(moments, key=lambda m: m[0].total)
        if prep.float8 is not None and prep.float8.fsdp_float8_all_gather and fsdp_on:
            peak = peak - Breakdown(gathered_parameters=int(peak.gathered_parameters * _float8_share(args, prep) / 2))
        rank = pp_rank * (dims.world_size // dims.pp)
        estimates.append(RankEstimate(rank=rank, pp_rank=pp_rank, stages=list(stage_ids), peak=peak, peak_phase=phase,
                                      phases={name: b for b, name in moments}))
        details.append(d)
    return estimates, details


def _float8_share(args, prep: PreparedJob) -> float:
    """Fraction of parameters in linears that float8 converts (all but the filtered ones)."""
    h, f = args.dim, args.ffn_hidden_dim
    qd, kvd = args.n_heads * args.head_dim, args.num_kv_heads * args.head_dim
    linear = args.n_layers * (2 * h * qd + 2 * h * kvd + 3 * h * f)
    output = args.vocab_size * h
    if "output" not in prep.float8.filter_fqns:
        linear += output
    total = linear + args.vocab_size * h + output + (2 * args.n_layers + 1) * h
    return linear / total


def model_parameter_count(args) -> int:
    return sum(d0 * rest for d0, rest in _param_shapes(args, StageShape(args.n_layers, True, True), 1))


def bytes_per_parameter(prep: PreparedJob) -> dict[str, float]:
    """The textbook per-parameter figures of this layout (bytes per model parameter per rank)."""
    dims, cfg = prep.dims, prep.cfg
    shard = dims.dp_shard * dims.cp if dims.fsdp_enabled else 1
    per = 1 / (shard * dims.tp * dims.pp)
    e = _BYTES[cfg.training.mixed_precision_param]
    return {"parameters": 4 * per, "gradients": 4 * per, "optimizer_state": 8 * per,
            "gathered_copy": e / (dims.tp * dims.pp)}


__all__ = ["StageShape", "backward_moments", "estimate_analytic", "in_flight_chunks", "layer_activation_bytes",
           "stage_layout", "bytes_per_parameter", "model_parameter_count", "AnalyticDetail"]
