"""The memory breakdown shared by the analytic and the traced estimates."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

GiB = 2**30

# What each bucket holds, in the words printed next to it.
BUCKET_DOCS = {
    "parameters": "sharded parameters (fp32 masters) and buffers",
    "gathered_parameters": "unsharded parameter copies for compute (FSDP all-gather, or bf16 autocast copies)",
    "gradients": "gradients: sharded, plus unsharded ones being accumulated",
    "optimizer_state": "optimizer state (AdamW exp_avg, exp_avg_sq, step)",
    "activations": "tensors saved for backward, pipeline-stage inputs and outputs",
    "transient": "temporaries: recompute, communication buffers, optimizer intermediates, loss",
}


@dataclass
class Breakdown:
    """Bytes by category at one moment (usually the peak). The buckets sum to the total."""

    parameters: int = 0
    gathered_parameters: int = 0
    gradients: int = 0
    optimizer_state: int = 0
    activations: int = 0
    transient: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    def __add__(self, other: "Breakdown") -> "Breakdown":
        return Breakdown(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def __sub__(self, other: "Breakdown") -> "Breakdown":
        return Breakdown(**{f.name: getattr(self, f.name) - getattr(other, f.name) for f in fields(self)})

    def scaled(self, k: float) -> "Breakdown":
        return Breakdown(**{f.name: int(round(getattr(self, f.name) * k)) for f in fields(self)})

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


@dataclass
class RankEstimate:
    """The estimate for one representative rank (one pipeline rank; every other coordinate
    of the mesh holds the same shapes)."""

    rank: int
    pp_rank: int
    stages: list[int]
    peak: Breakdown
    # Where in the step the peak falls (e.g. "backward of microbatch 0", "optimizer step").
    peak_phase: str = ""
    # module fqn -> (peak bytes during its forward, during its backward), traced only.
    per_module: dict[str, tuple[int, int]] = field(default_factory=dict)
    # The largest memory of each phase of the step (e.g. "optimizer step"), for comparisons.
    phases: dict[str, Breakdown] = field(default_factory=dict)

    @property
    def peak_bytes(self) -> int:
        return self.peak.total

    def as_dict(self) -> dict:
        out = {"rank": self.rank, "pp_rank": self.pp_rank, "stages": self.stages,
               "peak_bytes": self.peak_bytes, "peak_phase": self.peak_phase, "breakdown": self.peak.as_dict()}
        if self.phases:
            out["phases"] = {k: v.as_dict() for k, v in self.phases.items()}
        if self.per_module:
            out["per_module"] = {k: {"forward_peak_bytes": f, "backward_peak_bytes": b}
                                 for k, (f, b) in self.per_module.items()}
        return out


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"
