"""Does a planned job fit this machine? The check train.py makes before any process group exists.

The estimate of the busiest rank's memory for the JobPlan train.py is about to run, against what this
machine has for one rank. A job that does not fit is refused in one sentence; a job the estimate
cannot run is let through with a note saying the check was skipped (also when this process already
has a process group: the probe needs a fake one of its own). train.py finds `check_fits` as the
`titanlike.preflight` entry point pyproject.toml registers (a checkout's train.py passes it itself).
"""

from __future__ import annotations

import os

import torch

from titanlike.config.loader import ConfigError
from titanlike.observe.memory import device_memory
from titanlike.train.plan import JobPlan

GiB = 2**30


def machine_memory() -> tuple[int, str]:
    """(bytes one rank may use, what they are) on this machine: the GPU this rank will use, or on
    CPU the host's memory (its cgroup limit if lower) shared by LOCAL_WORLD_SIZE ranks."""
    if torch.cuda.is_available():
        # The device this rank will pick, by index: reading its properties creates no CUDA context.
        return device_memory(f"cuda:{int(os.environ.get('LOCAL_RANK', 0)) % torch.cuda.device_count()}")
    total, where = device_memory("cpu")
    local = max(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), 1)
    if local > 1:
        return total // local, f"this host's {total / GiB:.1f} GiB of memory shared by {local} local ranks leave"
    return total, where


def estimate_peak_memory(plan: JobPlan) -> tuple[int, str]:
    """(bytes the busiest rank needs, its largest parts): on a GPU what the allocator reserves (CUDA kernels),
    on CPU the tensors' peak (CPU kernels, exact bytes). The plan is made again without what a probe cannot run."""
    from estimation.layout import estimate
    from estimation.options import prepare_job
    from estimation.probe import probe

    cuda = torch.cuda.is_available()
    prep = prepare_job(plan.cfg, plan.dims.world_size, vocab_size=plan.model_args.vocab_size).plan
    ranks = estimate(prep, probe(prep, granularity=512 if cuda else 1, device="cuda" if cuda else "cpu"))
    top = max(ranks, key=lambda r: r.reserved if cuda else r.peak_bytes)
    b = top.peak
    parts = f"{(b.parameters + b.gradients + b.optimizer_state) / GiB:.1f} GiB of weights, gradients and optimizer " \
            f"state, {(b.activations + b.transient) / GiB:.1f} GiB held by the step"
    return (top.reserved if cuda else top.peak_bytes), parts


def check_fits(plan: JobPlan) -> str | None:
    """Refuse (ConfigError, one sentence) a job whose estimated memory per rank exceeds what this machine
    has for one rank; returns the reason when there is no estimate to check (None when checked)."""
    if torch.distributed.is_initialized():
        return "this process already has a process group (jobs run one after another in one launch)"
    try:
        peak, parts = estimate_peak_memory(plan)
    except (ValueError, NotImplementedError, RuntimeError) as e:
        return f"the estimator cannot run this job ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    memory, where = machine_memory()
    if peak > memory:
        raise ConfigError(
            f"the job needs about {peak / GiB:.1f} GiB per rank ({parts}, by the estimator) but "
            f"{where} {memory / GiB:.1f} GiB; lower training.local_batch_size or training.seq_len, set "
            "activation_checkpoint.mode full, spread the model over more ranks (parallelism degrees) or pick a "
            "smaller model.flavor")
    return None
