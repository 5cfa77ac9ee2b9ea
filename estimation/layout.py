"""Lay a probe (estimation/probe.py) out along the real model and its layout: every pipeline rank's
peak memory, and what the CUDA caching allocator reserves for it.

Static memory. A rank holds, for every layer of its stages, what one probed block of that layer's
kind holds (parameter shards as parallelized, their gradients' shapes, the optimizer's state
tensors), plus the ends its stages carry: the input end on the first stage, the output end on the
last (a tied embedding counted again there, as the pipeline split copies it), and what every stage
keeps (a RoPE table).

The step. Each layer contributes the windows of its kind measured by the probe (the forward window
of a block of its kind followed by the next layer's kind, the backward window of a block of its kind
preceded by the previous layer's), the first and last layers the probed windows of the model's
ends. Without pipeline parallelism a rank runs forward then backward of each of its microbatches
(gradient accumulation), then the update. With pipeline parallelism it runs the actions of torch's
own schedule for its rank (`Probe.actions`): a forward of stage s adds the windows of s's layers, a
backward takes them back; the first forward and backward of each stage use the probe's first
microbatch (gathering FSDP's weights, making its unsharded gradient accumulators), later ones the
second. A non-first stage keeps the hidden state it received until its backward. A split backward
(the zero-bubble schedules' I then W) is taken as a full backward at I whose `weight_share` of the
activations it frees stays until W (an assumption, stated in the notes). The stage's gradient
reduction and the update follow, their windows scaled from the probe by the rank's gradient and
parameter bytes (foreach AdamW makes its temporaries for all parameters at once). The peak is the
highest point of that walk; the breakdown splits it into what stays between steps, what the step
holds when the peak's window begins, and the window's rise. Under FSDP CPU offload the parameter
shards, their gradients and the optimizer state (and its step) are host memory, reported apart; the
gradients a backward makes are counted on the device until its end (FSDP copies them out as it goes).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from estimation.probe import Probe, Static, Window

# Share of a microbatch's activations a split backward (I) keeps for its weight-gradient step (W): an
# assumption (the inputs of the matmuls, about half of what a block saves), not a measurement.
WEIGHT_SHARE = 0.5


@dataclass
class Breakdown:
    """Bytes by category at one moment (the peak). The buckets sum to the total."""

    parameters: int = 0
    optimizer_state: int = 0
    gradients: int = 0
    activations: int = 0
    transient: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass
class RankEstimate:
    """The estimate for one representative rank (one per pipeline rank; every other coordinate of the
    mesh holds the same shapes). peak: tensors alive at the busiest moment; reserved: what the CUDA
    caching allocator holds then (`reserved_bytes`)."""

    rank: int
    pp_rank: int
    stages: list[int]
    peak: Breakdown
    peak_phase: str = ""
    reserved: int = 0
    host: int = 0  # bytes in host memory (FSDP CPU offload)

    @property
    def peak_bytes(self) -> int:
        return self.peak.total

    def as_dict(self) -> dict:
        return {"rank": self.rank, "pp_rank": self.pp_rank, "stages": self.stages, "peak_bytes": self.peak_bytes,
                "reserved_bytes": self.reserved, "host_bytes": self.host, "peak_phase": self.peak_phase, "breakdown": self.peak.as_dict()}


@dataclass
class _Stage:
    index: int
    layers: list[int]
    first: bool
    last: bool


def stages_of(plan, probe: Probe) -> tuple[list[list[int]], dict[int, _Stage]]:
    """(stage indices each pipeline rank holds, every stage), as the trainer splits the model
    (PipelineLayout.stage_layers)."""
    n = len(probe.kinds)
    layout = plan.pipeline
    if layout is None:
        return [[0]], {0: _Stage(0, list(range(n)), True, True)}
    stages = {s: _Stage(s, layout.stage_layers(s, n), s == 0, s == layout.num_stages - 1)
              for s in range(layout.num_stages)}
    return [layout.stages_of_rank(r) for r in range(layout.pp)], stages


def stage_static(probe: Probe, stage: _Stage) -> Static:
    s = probe.static
    out = Static()
    for i in stage.layers:
        out = out + s[probe.kinds[i]]
    out = out + s["shared"] + (s["input"] if stage.first else Static()) + (s["output"] if stage.last else Static())
    return out + (s["tied"] * -1 if stage.first and stage.last else Static())


def _find(windows: dict, key: tuple) -> Window:
    """The window of a block of kind key[0] next to one of kind key[1]; any of its kind if that pair
    was not probed in that order."""
    return windows.get(key) or next(w for k, w in windows.items() if isinstance(k, tuple) and k[0] == key[0])


def stage_windows(probe: Probe, stage: _Stage, p: int) -> tuple[list[Window], list[Window]]:
    """(forward windows, backward windows) of one microbatch through `stage`, pass p of the probe."""
    fw, bw, kinds, n = probe.forward[p], probe.backward[p], probe.kinds, len(probe.kinds)
    received = Window(probe.stage_input, probe.stage_input)
    forward = [fw["input"] if stage.first else received]
    forward += [fw["tail"] if i == n - 1 else fw["first"] if i == 0 else _find(fw, (kinds[i], kinds[i + 1]))
                for i in stage.layers]
    backward = [bw["output"]] if stage.last else []
    backward += [bw["head"] if i == 0 else bw["last"] if i == n - 1 else _find(bw, (kinds[i], kinds[i - 1]))
                 for i in reversed(stage.layers)]
    if not stage.first:
        backward.append(Window(-probe.stage_input, 0))
    if stage.last:
        backward.append(bw["release"])
    return forward, backward


class _Walk:
    """The live bytes of one rank through its step, and the highest point reached."""

    def __init__(self, static: Static, offload: bool):
        # FSDP CPU offload: parameter shards, their gradients and the optimizer state live in host memory.
        self.offload = offload
        self.base = Breakdown(parameters=0 if offload else static.params,
                              optimizer_state=0 if offload else static.optimizer)
        self.level = self.grads = 0
        self.peak, self.where = Breakdown(**vars(self.base)), "start"

    def window(self, w: Window, what: str) -> None:
        b = Breakdown(self.base.parameters, self.base.optimizer_state, self.grads, self.level, max(w.over, 0))
        if b.total > self.peak.total:
            self.peak, self.where = b, what
        self.level += w.keep

    def windows(self, ws: list[Window], what: str) -> None:
        for w in ws:
            self.window(w, what)

    def gradients_done(self, grads: int) -> None:
        """The reduced gradients now exist: file them as gradients rather than as held by the step."""
        moved = max(0, min(self.level, grads - self.grads))
        self.level -= moved
        self.grads += 0 if self.offload else moved


def estimate(plan, probe: Probe) -> list[RankEstimate]:
    """One estimate per pipeline rank (the ranks that hold the first stage of each pipeline rank)."""
    per_rank, stages = stages_of(plan, probe)
    accum = plan.batch.grad_accum_steps
    passes = len(probe.forward)
    out = []
    for pp_rank, held in enumerate(per_rank):
        static = Static()
        for s in held:
            static = static + stage_static(probe, stages[s])
        offload = plan.parallelize.cpu_offload and plan.dims.fsdp_enabled
        # The objective's frozen copies of the model (DPO's reference), parallelized like it: its
        # parameter shards again (offloaded with it), no gradients, no optimizer state.
        frozen = 0 if offload else static.params * plan.objective.frozen_copies
        walk = _Walk(static, offload)
        walk.base.parameters += frozen
        walk.peak.parameters += frozen
        done = {s: [0, 0] for s in held}  # forwards, backwards run per stage

        def forward(s: int, mb: int) -> None:
            what = f"forward {done[s][0] + 1} of stage {s}" if plan.pipeline else f"forward of microbatch {mb + 1}"
            walk.windows(stage_windows(probe, stages[s], min(done[s][0], passes - 1))[0], what)
            done[s][0] += 1

        def backward(s: int, mb: int, keep_share: float = 0.0) -> int:
            ws = stage_windows(probe, stages[s], min(done[s][1], passes - 1))[1]
            before = walk.level
            walk.windows(ws, f"backward {done[s][1] + 1} of stage {s}" if plan.pipeline
                         else f"backward of microbatch {mb + 1}")
            done[s][1] += 1
            kept = int(max(0, before - walk.level) * keep_share)
            walk.level += kept
            return kept

        for rep in range(accum):
            if plan.pipeline is None:
                forward(0, rep)
                backward(0, rep)
                walk.gradients_done(static.grads)
                continue
            waiting: dict[tuple[int, int], int] = {}
            for kind, s, mb in probe.actions.get(pp_rank, []):
                if s not in stages or s not in held:
                    continue
                if kind == "FORWARD":
                    forward(s, mb)
                elif kind == "FULL_BACKWARD":
                    backward(s, mb)
                elif kind == "BACKWARD_INPUT":
                    waiting[(s, mb)] = backward(s, mb, WEIGHT_SHARE)
                elif kind == "BACKWARD_WEIGHT":
                    walk.level -= waiting.pop((s, mb), 0)
            share = static.grads / max(probe.probed_grads, 1)
            walk.window(Window(int(probe.reduce.keep * share) if rep == 0 else 0, probe.reduce.over),
                        "gradient reduction")
            walk.gradients_done(static.grads)
        scale = static.params / max(probe.probed_params, 1)
        walk.window(Window(0, 0 if offload else int(probe.update.over * scale)), "optimizer step")
        rank = pp_rank * (plan.dims.world_size // plan.dims.pp)
        out.append(RankEstimate(rank=rank, pp_rank=pp_rank, stages=list(held), peak=walk.peak, peak_phase=walk.where,
                                reserved=reserved_bytes(walk.peak.total, probe),
                                host=static.params + static.grads + static.optimizer if offload else 0))
    return out


def reserved_bytes(peak: int, probe: Probe) -> int:
    """What the CUDA caching allocator holds at the peak: the tensors' bytes (each rounded up to its
    512-byte block by the probe), plus the pools of the streams FSDP's collectives allocate on, which
    the default stream cannot reuse: per collective, its largest buffer and its second largest (an
    all-gather prefetched while one is in use; FSDP keeps a reduce-scatter's buffer until the next
    one is issued). An upper bound on those pools: at the peak some of those buffers are alive and
    counted among the tensors too. Not modeled: holes inside a pool (free blocks too small for the
    next request), which expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as
    torchtitan's launcher sets) keep small; memory outside the allocator (CUDA context, NCCL's own
    buffers, cuBLAS workspaces) is not reserved memory: the verdict adds it (estimate.reserved_gib)."""
    return peak + sum(sum(sizes) for sizes in probe.pools.values())
