"""The estimator against torchtitan's published per-GPU memory (H100 96 GB, Llama 3.1, Dec. 2024).

    python scripts/published_memory.py [--only 8B ...] [--markdown]

Source: pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (torch, torchao and
torchtitan of 2024-12-23/26). Each row is that table's configuration as train.py options: torchtitan's
presets of the time (seq_len 8192, AdamW with foreach kernels, bf16 parameters with fp32 reduction,
op-level selective checkpointing for 8B, full for 70B and 405B, pipeline microbatches = pipeline
degree, float8 on every linear but the output projection with float8 all-gather and precomputed
scales), with the table's layout, batch, sequence length and techniques. The published figure is
the CUDA caching allocator's peak reserved memory of the busiest GPU (torch.cuda.memory_stats
"reserved_bytes.all.peak"); the estimate printed beside it is `reserved_bytes` of the estimate.

Two rows train 262,144-token sequences, past Llama 3.1's context of 131,072 positions, which train.py
refuses: torchtitan then sized its RoPE table to training.seq_len. Those rows use the flavor with its
context extended to 262,144 (`8B_ctx262144`, `405B_ctx262144`: the same weights and a longer RoPE
table), registered by this script while it estimates them.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

FOREACH = ["--optimizer.implementation", "foreach"]
# torchtitan compiled the transformer blocks only until compile.components (pytorch/torchtitan#1608,
# 2025-08) added the loss: these rows' loss runs eagerly.
COMPILE = ["--compile.enable", "--compile.components", "model"]
FLOAT8 = ["--model.converters", "float8", "--float8.enable_fsdp_float8_all_gather",
          "--float8.precompute_float8_dynamic_scale_for_fsdp", "--float8.filter_fqns", "output"]
ASYNC_TP = ["--parallelism.enable_async_tensor_parallel"]


def _cfg(name: str) -> list[str]:
    return ["--job.config_file", str(REPO / "train_configs" / name), *FOREACH]


LONG = 262144  # past Llama 3.1's context: the rows use the flavor with a context this long


def _long(flavor: str, seq: int) -> list[str]:
    return ["--model.flavor", f"{flavor}_ctx{LONG}"] if seq > 131072 else []


def _8b(lbs: int) -> list[str]:
    return [*_cfg("llama3_8b.toml"), "--training.local_batch_size", str(lbs)]


def _8b_cp(cp: int, seq: int) -> list[str]:
    return [*_8b(1), "--activation_checkpoint.mode", "full", *COMPILE, *FLOAT8,
            "--parallelism.context_parallel_degree", str(cp), "--training.seq_len", str(seq), *_long("8B", seq)]


def _405b(lbs: int, schedule: str, cp: int = 1, seq: int = 8192) -> list[str]:
    return [*_cfg("llama3_405b.toml"), *_long("405B", seq), "--training.local_batch_size", str(lbs),
            "--training.seq_len", str(seq),
            "--parallelism.pipeline_parallel_schedule", schedule, "--parallelism.context_parallel_degree", str(cp),
            "--parallelism.pipeline_parallel_microbatch_size", str(lbs // 8), *COMPILE, *FLOAT8, *ASYNC_TP]


_70B = [*_cfg("llama3_70b.toml"), "--training.local_batch_size", "16", *COMPILE, *FLOAT8]

# (table, row, published GiB, GPUs, train.py options)
ROWS = [
    ("1: 8B, 8 GPUs, FSDP 8", "FSDP", 82.4, 8, _8b(2)),
    ("1: 8B, 8 GPUs, FSDP 8", "+ compile", 77.0, 8, [*_8b(2), *COMPILE]),
    ("1: 8B, 8 GPUs, FSDP 8", "+ compile + float8", 76.8, 8, [*_8b(2), *COMPILE, *FLOAT8]),
    ("2: 8B, 8 GPUs, CP", "FSDP 8, CP 1, seq 32768", 83.9, 8, _8b_cp(1, 32768)),
    ("2: 8B, 8 GPUs, CP", "FSDP 4, CP 2, seq 65536", 84.2, 8, _8b_cp(2, 65536)),
    ("2: 8B, 8 GPUs, CP", "FSDP 2, CP 4, seq 131072", 84.0, 8, _8b_cp(4, 131072)),
    ("2: 8B, 8 GPUs, CP", "FSDP 1, CP 8, seq 262144", 84.5, 8, _8b_cp(8, 262144)),
    ("3: 8B, 128 GPUs, FSDP 128", "FSDP", 67.0, 128, _8b(2)),
    ("3: 8B, 128 GPUs, FSDP 128", "+ compile", 62.0, 128, [*_8b(2), *COMPILE]),
    ("3: 8B, 128 GPUs, FSDP 128", "+ compile + float8", 61.8, 128, [*_8b(2), *COMPILE, *FLOAT8]),
    ("4: 70B, 256 GPUs, FSDP 32 x TP 8", "2D", 71.9, 256, _70B),
    ("4: 70B, 256 GPUs, FSDP 32 x TP 8", "2D + async TP", 67.6, 256, [*_70B, *ASYNC_TP]),
    ("5: 405B, 512 GPUs, FSDP 8 x TP 8 x PP 8", "1F1B", 82.5, 512, _405b(32, "1F1B")),
    ("5: 405B, 512 GPUs, FSDP 8 x TP 8 x PP 8", "Interleaved 1F1B", 72.7, 512, _405b(32, "Interleaved1F1B")),
    ("6: 405B, 512 GPUs, TP 8 x PP 8, 1F1B", "FSDP 8, CP 1, seq 32768", 75.3, 512, _405b(8, "1F1B", 1, 32768)),
    ("6: 405B, 512 GPUs, TP 8 x PP 8, 1F1B", "FSDP 4, CP 2, seq 65536", 75.9, 512, _405b(8, "1F1B", 2, 65536)),
    ("6: 405B, 512 GPUs, TP 8 x PP 8, 1F1B", "FSDP 2, CP 4, seq 131072", 77.1, 512, _405b(8, "1F1B", 4, 131072)),
    ("6: 405B, 512 GPUs, TP 8 x PP 8, 1F1B", "FSDP 1, CP 8, seq 262144", 84.9, 512, _405b(8, "1F1B", 8, 262144)),
]


@contextlib.contextmanager
def long_context_flavors():
    """8B_ctx262144 and 405B_ctx262144 in the llama3 registry while the block runs."""
    from titanlike.models.registry import get_model_spec

    flavors = get_model_spec("llama3").flavors
    added = {f"{f}_ctx{LONG}": flavors[f].with_context_len(LONG) for f in ("8B", "405B")}
    flavors.update(added)
    try:
        yield
    finally:
        for name in added:
            del flavors[name]


def estimate_row(gpus: int, argv: list[str]) -> dict:
    """The estimate (estimation/estimate.py run_estimate's result) of one row."""
    from estimation.options import parse_estimate_args
    from estimation.estimate import run_estimate
    from titanlike.config import load_job_config

    opts, rest = parse_estimate_args([*argv, "--estimate.world_size", str(gpus)])
    with long_context_flavors():
        return run_estimate(load_job_config(rest), opts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="rows whose table or row name contains one of these")
    parser.add_argument("--markdown", action="store_true",
                        help="a Markdown table with each row's command (docs/performance.md)")
    a = parser.parse_args()
    if a.markdown:
        print("| table | row | GPUs | published (GiB) | estimate (GiB) | error | tensors at the peak (GiB) | command |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for table, row, published, gpus, argv in ROWS:
        if a.only and not any(o.lower() in f"{table} {row}".lower() for o in a.only):
            continue
        r = estimate_row(gpus, argv)
        est, peak = r["reserved_bytes"] / 2**30, r["peak_bytes"] / 2**30
        error = f"{(est - published) / published:+.0%}"
        command = " ".join(x.replace(str(REPO) + "/", "") for x in argv)
        if a.markdown:
            print(f"| {table} | {row} | {gpus} | {published} | {est:.1f} | {error} | {peak:.1f} | "
                  f"`{command} --estimate.world_size {gpus}` |", flush=True)
        else:
            print(f"{table + ' ' + row:<62} published {published:5.1f}  estimate {est:5.1f} GiB  {error:>5}  "
                  f"(tensors {peak:.1f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
