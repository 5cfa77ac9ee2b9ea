"""Time the gated delta rule on this CPU, paired: our chunked form (models/common/gated_delta.py), our
token-by-token recurrence, and transformers' torch_chunk_gated_delta_rule (its PyTorch fallback for the
flash-linear-attention kernels), forward and forward + backward, in fp32 on one thread.

Rounds are interleaved (each round runs every function once), the first round is dropped and the
median of the others printed, so that a change of load on the machine falls on all three alike.

    python scripts/bench_gated_delta.py --seq 1024 --rounds 7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlike.models.common.gated_delta import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule  # noqa: E402


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--k-heads", type=int, default=4)
    parser.add_argument("--v-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    a = parser.parse_args(argv)
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    torch.manual_seed(0)
    torch.set_num_threads(1)
    b, t, d = a.batch, a.seq, a.head_dim
    inputs = (l2norm(torch.randn(b, t, a.k_heads, d)), l2norm(torch.randn(b, t, a.k_heads, d)),
              torch.randn(b, t, a.v_heads, d), -F.softplus(torch.randn(b, t, a.v_heads)), torch.rand(b, t, a.v_heads))
    functions = {
        "ours chunked": lambda *x: chunk_gated_delta_rule(*x, chunk_size=64),
        "ours recurrent": lambda *x: recurrent_gated_delta_rule(*x),
        "transformers chunked": lambda *x: torch_chunk_gated_delta_rule(*x, chunk_size=64, output_final_state=True),
    }

    def run(fn, backward: bool) -> float:
        xs = [x.clone().requires_grad_(backward) for x in inputs]
        start = time.perf_counter()
        out, _ = fn(*xs)
        if backward:
            out.sum().backward()
        return time.perf_counter() - start

    for backward in (False, True):
        times = {name: [] for name in functions}
        for _ in range(a.rounds):
            for name, fn in functions.items():
                times[name].append(run(fn, backward))
        shape = f"batch {b}, seq {t}, {a.k_heads} key / {a.v_heads} value heads of {d}"
        print(f"{shape}, {'forward + backward' if backward else 'forward'}: "
              + ", ".join(f"{name} {statistics.median(ts[1:]) * 1e3:.0f} ms" for name, ts in times.items()))


if __name__ == "__main__":
    main()
