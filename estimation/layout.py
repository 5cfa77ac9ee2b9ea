"""Lay a probe (estimation/probe.py) out along the real model and its layout: every pipeline rank's
peak memory, and what the CUDA caching allocator reserves for it.

Static memory. A rank holds, for every layer of its stages, what one probed block of that layer's
kind holds, plus the ends its stages carry: the input end on the first stage, the output end on the
last (a tied embedding counted again there, as the pipeline split copies it), and what every stage
keeps (a RoPE table).

The step. Each layer contributes the probed windows of its kind next to its neighbours' kinds, the
first and last layers those of the model's ends. Without pipeline parallelism a rank runs forward
then backward of each of its microbatches, then the update; with it, the actions of torch's own
schedule for its rank (`Probe.actions`), the first forward and backward of each stage with the
probe's first microbatch (gathering FSDP's weights, making its unsharded gradient accumulators),
later ones with the second. A non-first stage keeps the hidden state it received until its
backward. A split backward (I then W) is a full backward at I whose WEIGHT_SHARE of the activations
it frees stays until W. The gradient reduction and the update follow, their windows scaled from the
probe by the rank's gradient and parameter bytes. The peak is the highest point of that walk, split
into what stays between steps, what the step holds when the peak's window begins, and the window's
rise. A generating companion (RL) adds the policy's whole copy it reads under FSDP or TP to what stays,
and its prefill into the generation cache as a window before the step. Under FSDP CPU offload the
parameter shards, their gradients and the optimizer state are host memory, reported apart (the
gradients a backward makes count on the device until its end).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

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
        return sum(vars(self).values())

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass
class RankEstimate:
    """The estimate for one pipeline rank (every other coordinate of the mesh holds the same shapes).
    peak: tensors alive at the busiest moment; reserved: what the CUDA caching allocator holds then."""

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
                "reserved_bytes": self.reserved, "host_bytes": self.host, "peak_phase": self.peak_phase,
                "breakdown": self.peak.as_dict()}


def stage_static(probe: Probe, layers: list[int], first: bool, last: bool) -> Static:
    s = probe.static
    out = sum((s[probe.kinds[i]] for i in layers), s["shared"])
    out = out + (s["input"] if first else Static()) + (s["output"] if last else Static())
    return out + (s["tied"] * -1 if first and last else Static())


def _find(windows: dict, key: tuple) -> Window:
    """The window of a block of kind key[0] next to one of kind key[1]; any of its kind if that pair
    was not probed in that order."""
    return windows.get(key) or next(w for k, w in windows.items() if isinstance(k, tuple) and k[0] == key[0])


def stage_windows(probe: Probe, p: int, layers: list[int], first: bool, last: bool) -> tuple[list, list]:
    """(forward windows, backward windows) of one microbatch through a stage, pass p of the probe."""
    fw, bw, kinds, n = probe.forward[p], probe.backward[p], probe.kinds, len(probe.kinds)
    forward = [fw["input"] if first else Window(probe.stage_input, probe.stage_input)]  # the stage's input
    forward += [fw["tail"] if i == n - 1 else fw["first"] if i == 0 else _find(fw, (kinds[i], kinds[i + 1]))
                for i in layers]
    backward = [bw["output"]] if last else []
    backward += [bw["head"] if i == 0 else bw["last"] if i == n - 1 else _find(bw, (kinds[i], kinds[i - 1]))
                 for i in reversed(layers)]
    return forward, backward + ([] if first else [Window(-probe.stage_input, 0)]) + ([bw["release"]] if last else [])


class _Walk:
    """The live bytes of one rank through its step, and the highest point reached."""

    def __init__(self, static: Static, offload: bool, frozen: int = 0):
        # FSDP CPU offload: parameter shards, their gradients and the optimizer state live in host memory.
        # frozen: parameters no gradient or optimizer state goes with (the objective's frozen copies).
        self.offload, self.level, self.grads = offload, 0, 0
        self.params, self.state = (0, 0) if offload else (static.params + frozen, static.optimizer)
        self.peak, self.where = Breakdown(self.params, self.state), "start"

    def window(self, w: Window, what: str) -> None:
        b = Breakdown(self.params, self.state, self.grads, self.level, max(w.over, 0))
        if b.total > self.peak.total:
            self.peak, self.where = b, what
        self.level += w.keep

    def gradients_done(self, grads: int) -> None:
        """The reduced gradients now exist: file them as gradients rather than as held by the step."""
        moved = max(0, min(self.level, grads - self.grads))
        self.level -= moved
        self.grads += 0 if self.offload else moved


def _stages(plan, n: int) -> dict[int, tuple[list[int], bool, bool]]:
    """(layers, first, last) of every stage of a model of n layers, as the trainer splits it."""
    layout = plan.pipeline
    return {0: (list(range(n)), True, True)} if layout is None else {
        s: (layout.stage_layers(s, n), s == 0, s == layout.num_stages - 1) for s in range(layout.num_stages)}


def estimate(plan, probe: Probe) -> list[RankEstimate]:
    """One estimate per pipeline rank (the ranks that hold the first stage of each pipeline rank)."""
    n, layout, accum, passes = len(probe.kinds), plan.pipeline, plan.batch.grad_accum_steps, len(probe.forward)
    stages = _stages(plan, n)
    offload = plan.parallelize.cpu_offload and plan.dims.fsdp_enabled
    out = []
    for pp_rank, held in enumerate([[0]] if layout is None else [layout.stages_of_rank(r) for r in range(layout.pp)]):
        static = sum((stage_static(probe, *stages[s]) for s in held), Static())
        # The objective's frozen copies of the model (DPO's reference), parallelized like it: its
        # parameter shards again (offloaded with it), no gradients, no optimizer state.
        from titanlike.objectives.companion import Source

        frozen = static.params * sum(c.source is Source.FROZEN_COPY for c in plan.objective.companions)
        # Its frozen other models (a distillation teacher), each with the job's layout over the same
        # stages: their parameter shards likewise, and each microbatch first runs their forward without
        # gradients, whose activations are freed block by block: the highest rise of one of its windows.
        teacher = Window()
        for other, measured in probe.frozen:
            theirs = _stages(other, len(measured.kinds))
            frozen += sum((stage_static(measured, *theirs[s]).params for s in held), 0)
            rises = [w.over for s in held for w in stage_windows(measured, 0, *theirs[s])[0]]
            teacher = Window(0, max(teacher.over, max(rises, default=0)))
        # A generating companion (RL): the policy's whole copy it reads under FSDP or TP stays all run;
        # its cache and prefill rise before the step's microbatches, when no gradient is held.
        generation = probe.generation
        if generation is not None:
            frozen += generation.copy
        walk = _Walk(static, offload, frozen)
        if generation is not None:
            walk.window(Window(0, generation.prefill), "generation of the rollouts (prefill into the cache)")
        done = {s: [0, 0] for s in held}  # forwards, backwards run per stage

        def run(s: int, mb: int, backward: bool, keep_share: float = 0.0) -> int:
            what = (f"{'backward' if backward else 'forward'} {done[s][backward] + 1} of stage {s}" if layout else
                    f"{'backward' if backward else 'forward'} of microbatch {mb + 1}")
            before = walk.level
            for w in stage_windows(probe, min(done[s][backward], passes - 1), *stages[s])[backward]:
                walk.window(w, what)
            done[s][backward] += 1
            kept = int(max(0, before - walk.level) * keep_share)
            walk.level += kept
            return kept

        for rep in range(accum):
            if probe.frozen:
                walk.window(teacher, f"frozen model's forward of microbatch {rep + 1}")
            if layout is None:
                run(0, rep, False)
                run(0, rep, True)
                walk.gradients_done(static.grads)
                continue
            waiting: dict[tuple[int, int], int] = {}
            for kind, s, mb in probe.actions.get(pp_rank, []):
                if s not in held:
                    continue
                if kind in ("FORWARD", "FULL_BACKWARD"):
                    run(s, mb, kind != "FORWARD")
                elif kind == "BACKWARD_INPUT":
                    waiting[(s, mb)] = run(s, mb, True, WEIGHT_SHARE)
                elif kind == "BACKWARD_WEIGHT":
                    walk.level -= waiting.pop((s, mb), 0)
            share = static.grads / max(probe.probed.grads, 1)
            walk.window(Window(int(probe.reduce.keep * share) if rep == 0 else 0, probe.reduce.over),
                        "gradient reduction")
            walk.gradients_done(static.grads)
        scale = static.params / max(probe.probed.params, 1)
        walk.window(Window(0, 0 if offload else int(probe.update.over * scale)), "optimizer step")
        # What the CUDA caching allocator holds at the peak: the tensors plus the pools of the streams FSDP's
        # collectives allocate on, which the default stream cannot reuse (per collective its two largest
        # buffers: an upper bound, as some are alive at the peak and counted among the tensors too). Not
        # modeled: holes inside a pool, which expandable segments keep small. docs/performance.md says more.
        reserved = walk.peak.total + sum(sum(sizes) for sizes in probe.pools.values())
        out.append(RankEstimate(rank=pp_rank * (plan.dims.world_size // plan.dims.pp), pp_rank=pp_rank,
                                stages=list(held), peak=walk.peak, peak_phase=walk.where, reserved=reserved,
                                host=static.params + frozen + static.grads + static.optimizer if offload else 0))
    return out
