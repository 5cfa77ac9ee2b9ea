"""Measure the real peak tensor memory of one training step on CPU, to check the estimates.

    torchrun --nproc_per_node=N scripts/measure_memory.py --measure.out DIR [train.py options]

Builds the real Trainer (gloo on CPU), runs two steps (the second with optimizer
state allocated, like every later step), then runs a third under torch.profiler with
profile_memory=True. The profiler records every allocation and free of the CPU
allocator with its size; the peak of their running sum, plus the bytes already live
when the step starts (parameters, buffers, gradients and optimizer state, counted
from their storages), is the measured peak of live tensor memory of the step. This is
independent of the trackers the traced estimate uses (allocator events, not
dispatch-level storage bookkeeping), and it sees what the real run does: real
collectives, real FSDP buffers. Each rank writes DIR/rank{r}.json.

The profiler follows only the thread that runs the step: an allocation freed on another
thread has no free event. gloo's reduce-scatter clones its input on the calling thread,
and when its worker thread finishes after the caller has let go, the clone is freed
there; it then stays in the running sum until the end of the step, so the measured peak
can be too high by up to end_minus_start_bytes (zero when nothing was freed elsewhere,
as the step ends with what it started with).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _live_bytes(trainer) -> int:
    import torch
    from torch.distributed._tools.common_utils import get_untyped_storages

    seen, total = set(), 0

    def add(t):
        nonlocal total
        if not isinstance(t, torch.Tensor):
            return
        local = t.to_local() if hasattr(t, "to_local") else t
        # Tensor subclasses (float8's weight wrapper) hold their data in inner tensors.
        for st in get_untyped_storages(local):
            if st.nbytes() == 0 or st.data_ptr() in seen:
                continue
            seen.add(st.data_ptr())
            total += st.nbytes()

    for part in trainer.model_parts:
        for p in part.parameters():
            add(p)
            add(p.grad)
        for b in part.buffers():
            add(b)
    for state in trainer.optimizer.state.values():
        for v in state.values():
            add(v)
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], allow_abbrev=False,
        epilog="Every other option is a train.py job option (--job.config_file FILE, --section.key VALUE): "
               "python3 train.py --help lists them.")
    parser.add_argument("--measure.out", dest="out", metavar="DIR",
                        help="write each rank's result to DIR/rank{r}.json (default: print it as JSON)")
    opts, argv = parser.parse_known_args(sys.argv[1:] if argv is None else argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from titanlike.config import load_job_config
    from titanlike.train.plan import plan_job
    from titanlike.train.trainer import Trainer

    out = opts.out
    cfg = load_job_config(argv)
    trainer = Trainer(plan_job(cfg, int(os.environ.get("WORLD_SIZE", 1))))
    try:
        trainer.checkpointer.load()
        data = iter(trainer.dataloader)
        for _ in range(2):
            trainer.train_step([trainer.prepare(next(data)) for _ in range(trainer.grad_accum_steps)])
        batch = [trainer.prepare(next(data)) for _ in range(trainer.grad_accum_steps)]
        baseline = _live_bytes(trainer)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            trainer.train_step(batch)
        events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                        key=lambda e: e.start_ns())
        running = peak = 0
        for e in events:
            if e.device_type() != torch._C._autograd.DeviceType.CPU:
                continue
            running += e.nbytes()
            peak = max(peak, running)
        rank = trainer.rank
        result = {"rank": rank, "baseline_bytes": baseline, "step_peak_above_baseline": peak,
                  "peak_bytes": baseline + peak, "end_minus_start_bytes": running}
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        else:
            print(json.dumps(result))
    finally:
        trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
