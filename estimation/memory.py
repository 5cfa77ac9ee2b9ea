"""The memory breakdown of an estimate."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

GiB = 2**30

# What each bucket holds, in the words printed next to it.
BUCKET_DOCS = {
    "parameters": "parameter shards (fp32 masters) and buffers, as parallelized",
    "optimizer_state": "optimizer state (AdamW exp_avg, exp_avg_sq, step)",
    "gradients": "reduced gradients kept from earlier microbatches, or for the optimizer step",
    "activations": "what the step holds when the peak begins: saved activations, gathered weights, gradients "
                   "made so far, pipeline stage inputs, the batch",
    "transient": "the rise above that within the peak's stretch: recompute, collective buffers, temporaries",
}


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
    caching allocator holds then (estimation/layout.py `reserved_bytes`)."""

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


def gib(n: float) -> str:
    return f"{n / GiB:.2f} GiB"
