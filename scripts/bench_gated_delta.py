"""Time the gated delta rule, paired: our chunked form (models/common/gated_delta.py), eager and (--compile)
compiled, our token-by-token recurrence, transformers' torch_chunk_gated_delta_rule (its PyTorch fallback
for the flash-linear-attention kernels) and, where it imports (CUDA, Triton), flash-linear-attention's
chunk_gated_delta_rule, forward and forward + backward.

Every function gets the same tensors in the same conventions: time-first (batch, seq, heads, dim) q, k
and v (FLA 0.6 takes no other layout), q and k already unit length (l2norm once, before, as
models/qwen3_next does, so FLA's and transformers' use_qk_l2norm_in_kernel stay off), the default scale
k_dim^-0.5 of all three, g the natural-log decay (<= 0) in float32 as qwen3_next computes it, beta after
its sigmoid, and key heads serving consecutive groups of value heads (FLA's i_h // (HV // H), our and
transformers' repeat_interleave). transformers swaps FLA's kernel in for its own function when fla
imports (the fallback decorator of its hub_kernels.py); the column calls the PyTorch function beneath it
(inspect.unwrap), so it stays the fallback.

Before timing, each function's output (and, for forward + backward, the gradients of q, k, v, g and beta
under a random weighting of the output) is compared with our eager chunked form's; the largest
difference, relative to ours' largest magnitude, is printed and must be under the dtype's tolerance,
else the row says MISMATCH and the exit status is 1. Rounds are interleaved (each round runs every
function once, every other round in reverse order), the first dropped, the median printed: CUDA times by
synchronize and the wall clock, CPU by this process's CPU time on one thread. The forward runs as in
training, on inputs that need gradients (so the compiled form compiles its graph once, and both phases
use it).

The FLA column was checked on CPU through Triton's interpreter (TRITON_INTERPRET=1, fla 0.6.0, triton
3.9): its output and gradients agree with ours to 3e-6 in float32 and 1e-3 in float16 (bfloat16 is
not emulated right by the interpreter), so the conventions above are FLA's.

GPU: fla 0.6.0 imports einops (as mamba_ssm's kernels do: scripts/gpu_kit_mamba.sh), which the GPU box is
not known to have, so the kit carries it beside the two wheels:
    EXTRA_WHEELS="flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2" bash ../shared/gpu/make-kit.sh
then (one H200, Qwen3-Next's 16 key / 32 value heads of 128; wall times estimated, not measured: dynamo
unrolls the chunk loop, so the compile grows with the sequence):
    python scripts/bench_gated_delta.py --device cuda --k-heads 16 --v-heads 32 --seq 4096 --compile \\
        --functions transformers,fla   # ~2.5 min
    python scripts/bench_gated_delta.py --device cuda --k-heads 16 --v-heads 32 --seq 8192,16384 \\
        --functions transformers,fla   # ~1 min
CPU:
    python scripts/bench_gated_delta.py --seq 1024 --rounds 7
    python scripts/bench_gated_delta.py --quick   (the test's)
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titanlike.models.common.gated_delta import chunk_gated_delta_rule, l2norm, recurrent_gated_delta_rule  # noqa: E402

# Largest |got - ours| / max |ours| accepted: a few roundings of the dtype.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 4e-2, torch.float16: 5e-3}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OPTIONAL = ("recurrent", "transformers", "fla")
REFERENCE = "ours chunked"


def fla_kernel(device: torch.device) -> tuple[Callable | None, str]:
    """flash-linear-attention's chunk_gated_delta_rule, or None and why it cannot run here."""
    if device.type != "cuda":
        return None, "its Triton kernels need CUDA"
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except Exception as err:  # not installed, or no triton
        return None, f"it does not import ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    return fla_chunk, ""


def build_functions(names: list[str], chunk_size: int, compile_ours: bool,
                    device: torch.device) -> tuple[dict[str, Callable], list[str]]:
    """name -> f(q, k, v, g, beta) -> output, ours first; and a line for each requested one left out."""
    functions = {REFERENCE: lambda *x: chunk_gated_delta_rule(*x, chunk_size=chunk_size)[0]}
    absent = []
    if compile_ours:
        compiled = torch.compile(chunk_gated_delta_rule, dynamic=False)
        functions["ours compiled"] = lambda *x: compiled(*x, chunk_size=chunk_size)[0]
    if "recurrent" in names:
        functions["ours recurrent"] = lambda *x: recurrent_gated_delta_rule(*x)[0]
    if "transformers" in names:
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

        fallback = inspect.unwrap(torch_chunk_gated_delta_rule)
        functions["transformers chunked"] = lambda *x: fallback(*x, chunk_size=chunk_size, output_final_state=True)[0]
    if "fla" in names:
        fla_chunk, why = fla_kernel(device)
        if fla_chunk is None:
            absent.append(f"fla: not run: {why}")
        else:
            functions["fla chunked"] = lambda *x: fla_chunk(*x, chunk_size=chunk_size, output_final_state=True)[0]
    return functions, absent


def make_inputs(batch: int, seq: int, k_heads: int, v_heads: int, head_dim: int, device, dtype):
    """q, k (unit length), v, g (float32 log decay) and beta, time-first."""
    q = l2norm(torch.randn(batch, seq, k_heads, head_dim, device=device)).to(dtype)
    k = l2norm(torch.randn(batch, seq, k_heads, head_dim, device=device)).to(dtype)
    v = torch.randn(batch, seq, v_heads, head_dim, device=device, dtype=dtype)
    g = -F.softplus(torch.randn(batch, seq, v_heads, device=device))
    beta = torch.rand(batch, seq, v_heads, device=device).to(dtype)
    return q, k, v, g, beta


def max_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want| (in float32): the error in units of the tensor's scale."""
    got, want = got.float(), want.float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def check(functions: dict[str, Callable], inputs, *, backward: bool,
          errors: dict[str, str] | None = None) -> dict[str, float]:
    """name -> largest difference from ours of the output (and of every input's gradient). A function
    other than ours that raises is left out, its error in `errors` (when given, else it propagates)."""
    weight = None
    want = None
    diffs = {}
    for name, fn in functions.items():
        try:
            leaves = [x.detach().clone().requires_grad_() for x in inputs]
            out = fn(*leaves)
            if weight is None:
                weight = torch.randn(out.shape, device=out.device)
            got = [out.detach()]
            if backward:
                got += list(torch.autograd.grad((out.float() * weight).sum(), leaves))
        except Exception as err:
            if want is None or errors is None:
                raise
            errors[name] = describe_error(err)
            continue
        if want is None:
            want = got
        diffs[name] = max(max_difference(g, w) for g, w in zip(got, want))
    return diffs


def describe_error(err: Exception) -> str:
    """One line for the table: running out of memory is a result, anything else an ERROR."""
    if isinstance(err, torch.OutOfMemoryError):
        return "out of memory"
    text = str(err).strip().splitlines()
    return f"ERROR {type(err).__name__}: {text[0][:100] if text else ''}"


class Timer:
    """Seconds of one call: the wall clock after synchronize on CUDA, this process's CPU time on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.cuda:
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            return time.perf_counter() - start
        start = time.process_time()
        fn()
        return time.process_time() - start


def bench(functions: dict[str, Callable], inputs, *, backward: bool, rounds: int, timer: Timer,
          errors: dict[str, str]) -> dict[str, float]:
    """name -> median seconds of a call over the rounds after the first; one that raises goes to `errors`."""
    grad = torch.randn_like(functions[REFERENCE](*inputs)) if backward else None

    def run(fn):
        xs = [x.detach().requires_grad_() for x in inputs]
        out = fn(*xs)
        if backward:
            out.backward(grad)

    times = {name: [] for name in functions}
    for round_ in range(rounds):
        # Every other round in reverse, so that each function follows each other one alike (what one leaves
        # behind, freed memory to fault in again on CPU, falls on all).
        for name, fn in list(functions.items())[::1 if round_ % 2 == 0 else -1]:
            if name in errors:
                continue
            try:
                times[name].append(timer(lambda: run(fn)))
            except Exception as err:
                errors[name] = describe_error(err)
    return {name: statistics.median(ts[1:] if len(ts) > 1 else ts) for name, ts in times.items() if name not in errors}


def format_table(title: str, seconds: dict[str, float], diffs: dict[str, float], errors: dict[str, str],
                 tol: float) -> str:
    base = seconds.get(REFERENCE)
    lines = [title, f"  {'function':22s} {'ms':>10s} {'x ours':>7s}  max diff (tolerance {tol:.0e})"]
    for name, s in seconds.items():
        verdict = "" if diffs[name] <= tol else "  MISMATCH"
        lines.append(f"  {name:22s} {s * 1e3:10.3f} {s / base:7.2f}  {diffs[name]:.1e}{verdict}")
    for name, error in errors.items():
        lines.append(f"  {name:22s} {'-':>10s} {'-':>7s}  {error}")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--seq", "--seq-lens", dest="seq_lens", type=_ints, default=None,
                        help="sequence lengths, comma separated (default 1024; --quick 96)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--k-heads", type=int, default=None, help="default 4 (--quick 2)")
    parser.add_argument("--v-heads", type=int, default=None, help="default 8 (--quick 4)")
    parser.add_argument("--head-dim", type=int, default=None, help="default 128 (--quick 32)")
    parser.add_argument("--chunk-size", type=int, default=64, help="16, 32 or 64 (FLA takes no other)")
    parser.add_argument("--rounds", type=int, default=None, help="default 5 (--quick 3)")
    parser.add_argument("--functions", default=",".join(OPTIONAL),
                        help=f"besides ours (eager, and compiled with --compile): a comma list of "
                             f"{', '.join(OPTIONAL)}")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False,
                        help="add our chunked form under torch.compile")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (the test's)")
    a = parser.parse_args(argv)
    unknown = [n for n in a.functions.split(",") if n and n not in OPTIONAL]
    if unknown:
        parser.error(f"--functions {','.join(unknown)} unknown; known: {', '.join(OPTIONAL)}")
    a.dtype = DTYPES[a.dtype or ("bfloat16" if a.device == "cuda" else "float32")]
    a.seq_lens = a.seq_lens or ([96] if a.quick else [1024])
    a.k_heads = a.k_heads or (2 if a.quick else 4)
    a.v_heads = a.v_heads or (4 if a.quick else 8)
    a.head_dim = a.head_dim or (32 if a.quick else 128)
    a.rounds = a.rounds or (3 if a.quick else 5)
    return a


def check_machine(a) -> None:
    """The device the arguments name is this machine's (apart from parse_args, so that the commands prepared
    for a GPU parse here: scripts/gpu_wave.py --check)."""
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA GPU; this machine has none (use --device cpu)")


def main(argv=None) -> int:
    a = parse_args(argv)
    check_machine(a)
    device = torch.device(a.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    functions, absent = build_functions(a.functions.split(","), a.chunk_size, a.compile, device)
    for line in absent:
        print(line)
    tol, timer, ok = TOLERANCE[a.dtype], Timer(device), True
    for seq in a.seq_lens:
        torch.manual_seed(0)
        inputs = make_inputs(a.batch, seq, a.k_heads, a.v_heads, a.head_dim, device, a.dtype)
        shape = (f"batch {a.batch}, seq {seq}, {a.k_heads} key / {a.v_heads} value heads of {a.head_dim}, "
                 f"{str(a.dtype).removeprefix('torch.')}, {a.device}")
        for backward in (False, True):
            errors = {}
            start = time.perf_counter()
            # Also the first call of each: the compiled form compiles here.
            diffs = check(functions, inputs, backward=backward, errors=errors)
            checked = time.perf_counter() - start
            seconds = bench(functions, inputs, backward=backward, rounds=a.rounds, timer=timer, errors=errors)
            phase = "forward + backward" if backward else "forward"
            print(format_table(f"{shape}, {phase} (check, compiles included: {checked:.1f} s wall)",
                               seconds, diffs, errors, tol), flush=True)
            failed = any(d > tol for d in diffs.values()) or any(e.startswith("ERROR") for e in errors.values())
            ok = ok and not failed
            for name in errors:  # not tried again
                functions.pop(name)
    if not ok:
        print("FAILED: a function's output or gradients differ from our chunked form's beyond tolerance "
              "(MISMATCH), or it raised an error (ERROR)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
