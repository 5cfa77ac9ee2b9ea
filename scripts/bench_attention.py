"""Time titanlike's sliding-window and sink attention (gpt-oss, Gemma 3) against full causal SDPA.

Every variant is a call of `core_attention` (models/common/attention.py) on the heads, key/value heads,
head_dim, window and sinks of a family's first sliding layer (the model built on meta, so the shapes are
the flavor's own), batch `--batch`, one document per sample:
  (a) full causal attention through SDPA (is_causal: the fused kernels): the baseline;
  (b) the window through FlexAttention, the block mask of DocumentMask.windowed (what document masking
      on CUDA runs);
  (c) the window and learned sinks through FlexAttention, corrected from its log-sum-exp (add_sinks);
  (d) the window through SDPA with a dense banded mask (what runs without document masking);
  (e) the window and sinks through the dense sink column (sink_attention: scores in fp32, O(seq^2)).
(c) and (e) run for layers with sinks only. `--variants` adds `full_sinks_flex` and `full_sinks_sdpa`
(gpt-oss's full layers). The flex variants get the windowed mask itself, built once per microbatch as
the first sliding layer builds it, so a compiled call holds no eager lookup.

Before timing, each variant's output at a sample of query rows is compared with a float32 dense
reference (and, where it has a backward, the gradients of q, k, v and the sinks of a random weighting of
those rows); the largest difference, relative to the reference's largest magnitude, is printed and must
be under the dtype's tolerance (TOLERANCE), else the row says MISMATCH and the exit status is 1. Rounds
are interleaved (each round calls every variant once, every other round in reverse order), the first
dropped, the median printed: CUDA times by synchronize and the wall clock, CPU by this process's CPU
time on one thread. The forward runs as in training, on inputs that need gradients (so a compiled
variant compiles once, for the check, and serves both phases); the forward-only flex variants of CPU run
without autograd.

On CPU FlexAttention runs eager (its unfused implementation, under torch.compiler.set_stance
"force_eager") and forward only: torch's CPU FlexAttention has no backward, and compiled none with the
log-sum-exp the sinks need. `--compile` then compiles the SDPA variants only. On CUDA `--compile`
(the default) compiles each variant's call, as a compiled block would; `--no-compile` calls it eagerly,
where FlexAttention still runs attention.py's compiled flex_attention.

GPU commands (one H200, bf16; wall times estimated, not measured: flex compiles its forward and
backward kernels, some 10-30 s, for each flex variant at each sequence length):
    python scripts/bench_attention.py --device cuda --models gpt_oss:20B --seq-lens 4096,8192   # ~2.5 min
    python scripts/bench_attention.py --device cuda --models gpt_oss:20B --seq-lens 16384       # ~1.5 min
    python scripts/bench_attention.py --device cuda --models gemma3:27B --seq-lens 4096,8192,16384   # ~2 min
    python scripts/bench_attention.py --device cuda --models gemma3:4B --seq-lens 8192   # head_dim 256, ~1 min
CPU (tiny, the test's): python scripts/bench_attention.py --quick --no-compile
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# The timer, the relative difference and the device check are the gated-delta benchmark's.
from bench_gated_delta import Timer, _ints, check_machine, max_difference  # noqa: E402

from titanlike.models.common.attention import Attention, DocumentMask, core_attention  # noqa: E402

# Largest |got - reference| / max |reference| accepted: a few roundings of the dtype.
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 4e-2, torch.float16: 5e-3}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def full_sdpa(q, k, v, masks, window, sinks):
    return core_attention(q, k, v)


def window_flex(q, k, v, masks, window, sinks):
    return core_attention(q, k, v, masks["window"])


def window_sinks_flex(q, k, v, masks, window, sinks):
    return core_attention(q, k, v, masks["window"], sinks=sinks)


def window_sdpa(q, k, v, masks, window, sinks):
    return core_attention(q, k, v, window=window)


def window_sinks_sdpa(q, k, v, masks, window, sinks):
    return core_attention(q, k, v, window=window, sinks=sinks)


def full_sinks_flex(q, k, v, masks, window, sinks):
    return core_attention(q, k, v, masks["full"], sinks=sinks)


def full_sinks_sdpa(q, k, v, masks, window, sinks):
    return core_attention(q, k, v, sinks=sinks)


@dataclass(frozen=True)
class Variant:
    label: str
    fn: Callable  # (q, k, v, masks, window, sinks) -> out; one module-level function each, so that
    # torch.compile keeps one cache per variant
    window: bool  # sees only the window (for the reference)
    sinks: bool
    flex: bool


VARIANTS = {
    "sdpa": Variant("(a) full causal, SDPA", full_sdpa, False, False, False),
    "window_flex": Variant("(b) window, flex", window_flex, True, False, True),
    "window_sinks_flex": Variant("(c) window + sinks, flex", window_sinks_flex, True, True, True),
    "window_sdpa": Variant("(d) window, SDPA dense mask", window_sdpa, True, False, False),
    "window_sinks_sdpa": Variant("(e) window + sinks, dense", window_sinks_sdpa, True, True, False),
    "full_sinks_flex": Variant("(f) full + sinks, flex", full_sinks_flex, False, True, True),
    "full_sinks_sdpa": Variant("(g) full + sinks, dense", full_sinks_sdpa, False, True, False),
}
DEFAULT_VARIANTS = ("sdpa", "window_flex", "window_sinks_flex", "window_sdpa", "window_sinks_sdpa")


@dataclass(frozen=True)
class LayerShape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    window: int
    sinks: bool


def sliding_layer(model: str) -> LayerShape:
    """The attention of `family:flavor`'s first sliding layer, read from the model built on meta."""
    from titanlike.models.registry import get_model_spec

    family, _, flavor = model.partition(":")
    try:
        spec = get_model_spec(family)
    except KeyError as err:
        raise ValueError(f"--models {model}: {err.args[0]}") from None
    if flavor not in spec.flavors:
        raise ValueError(f"--models {model}: {family} has no flavor {flavor!r}; known: {', '.join(spec.flavors)}")
    with torch.device("meta"):
        net = spec.model_cls(spec.flavors[flavor])
    for module in net.modules():
        if isinstance(module, Attention) and module.window is not None:
            return LayerShape(model, module.wq.out_features // module.head_dim,
                              module.wk.out_features // module.head_dim, module.head_dim, module.window,
                              module.sinks is not None)
    raise ValueError(f"--models {model}: the model has no sliding-window attention layer")


def window_work_fraction(seq: int, window: int) -> float:
    """The sliding window's (query, key) pairs over full causal attention's: the work a kernel that skips
    what the band leaves out would do."""
    w = min(window, seq)
    return (w * (w + 1) / 2 + (seq - w) * w) / (seq * (seq + 1) / 2)


def reference(q, k, v, rows, *, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention of the query `rows` in float32 math: a dense mask, the sink as one more softmax column."""
    rep = q.shape[1] // k.shape[1]
    q, k, v = q[:, :, rows].float(), k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    keys = torch.arange(k.shape[2], device=q.device)
    distance = rows[:, None] - keys[None, :]
    allowed = (distance >= 0) & (distance < (window or k.shape[2]))
    scores = scores.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], -1)
    return scores.softmax(-1)[..., :k.shape[2]] @ v


def check_rows(query_rows: int, seq: int, device) -> torch.Tensor:
    """The query rows the check covers: the first and last ones, and some evenly spaced between."""
    if seq <= query_rows:
        return torch.arange(seq, device=device)
    ends = torch.cat([torch.arange(query_rows // 4), torch.arange(seq - query_rows // 4, seq)])
    middle = torch.linspace(0, seq - 1, query_rows // 2).long()
    return torch.unique(torch.cat([ends, middle])).to(device)


@dataclass
class Result:
    label: str
    diff_out: float | None = None
    diff_grad: float | None = None
    mismatch: bool = False  # a difference beyond the tolerance
    error: bool = False  # an error other than running out of memory
    ms: dict = field(default_factory=dict)  # "fwd" / "fwd+bwd" -> median ms
    peak_gib: float | None = None
    note: str = ""


@contextlib.contextmanager
def _eager_flex():
    """FlexAttention eager, without its warning that it is (the table's header says so)."""
    with torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


class LayerBench:
    """One layer's shape at one sequence length: the inputs, the flex block masks and each variant's call."""

    def __init__(self, layer: LayerShape, seq: int, names: list[str], a, device: torch.device, dtype):
        torch.manual_seed(0)
        self.layer, self.device, self.cpu, self.timer = layer, device, device.type == "cpu", Timer(device)
        b, heads, d = a.batch, layer.heads, layer.head_dim
        self.q = torch.randn(b, heads, seq, d, device=device, dtype=dtype)
        self.k, self.v = (torch.randn(b, layer.kv_heads, seq, d, device=device, dtype=dtype) for _ in range(2))
        self.sinks = torch.randn(heads, device=device, dtype=dtype)
        # The same values as leaves of autograd, for the check and the timed forward + backward.
        self.leaves = [t.detach().clone().requires_grad_() for t in (self.q, self.k, self.v, self.sinks)]
        self.grad_out = torch.randn(b, heads, seq, d, device=device, dtype=dtype)
        self.masks, self.notes = {}, []
        if any(VARIANTS[n].flex for n in names):
            ids = torch.zeros(b, seq, dtype=torch.long, device=device)
            DocumentMask.from_document_ids(ids, "flex").windowed(layer.window)  # warm-up
            full = self.timer(lambda: self.masks.__setitem__("full", DocumentMask.from_document_ids(ids, "flex")))
            window = self.timer(lambda: self.masks.__setitem__("window", self.masks["full"].windowed(layer.window)))
            self.notes.append(f"flex block masks built in {full * 1e3:.1f} ms (full) + {window * 1e3:.1f} ms "
                              "(window), once per microbatch")
        if a.compile:
            torch.compiler.reset()  # a fresh compile cache for each shape: no recompile limit reached across them
        self.calls = {n: torch.compile(VARIANTS[n].fn, dynamic=False) if a.compile and not self.eager_flex(n)
                      else VARIANTS[n].fn for n in names}

    def eager_flex(self, name: str) -> bool:
        """FlexAttention on CPU: eager, forward only (the module docstring)."""
        return self.cpu and VARIANTS[name].flex

    def call(self, name: str, *, grad: bool) -> torch.Tensor:
        """The variant's output, on the autograd leaves (grad) or on plain tensors without autograd."""
        var = VARIANTS[name]
        q, k, v, sinks = self.leaves if grad else (self.q, self.k, self.v, self.sinks)
        with torch.set_grad_enabled(grad), _eager_flex() if self.eager_flex(name) else contextlib.nullcontext():
            return self.calls[name](q, k, v, self.masks, self.layer.window, sinks if var.sinks else None)

    def check(self, name: str, result: Result, rows: torch.Tensor, tol: float) -> None:
        """Outputs at `rows`, and the gradients of a random weighting of them, against the float32 reference."""
        var, leaves = VARIANTS[name], self.leaves
        want = reference(*leaves[:3], rows, window=self.layer.window if var.window else None,
                         sinks=leaves[3] if var.sinks else None)
        got = self.call(name, grad=not self.eager_flex(name))[:, :, rows]
        result.diff_out = max_difference(got.detach(), want.detach())
        if got.requires_grad:
            weight = torch.randn(want.shape, device=want.device)
            grads = [torch.autograd.grad((out.float() * weight).sum(), leaves, allow_unused=True)
                     for out in (got, want)]
            result.diff_grad = max(max_difference(g if g is not None else torch.zeros_like(w), w)
                                   for g, w in zip(*grads) if w is not None)
        result.mismatch = result.diff_out > tol or (result.diff_grad is not None and result.diff_grad > tol)

    def run(self, name: str, phase: str) -> None:
        """One timed call: the forward as in training (on inputs that need gradients: the check's compiled
        graph), or forward and backward; CPU's flex variants forward only, without autograd."""
        if phase == "fwd":
            self.call(name, grad=not self.eager_flex(name))
            return
        for t in self.leaves:
            t.grad = None
        self.call(name, grad=True).backward(self.grad_out)


def bench_layer(layer: LayerShape, seq: int, names: list[str], a, device, dtype) -> tuple[list[Result], str]:
    """Check, then time, the variants on one layer's shape at one sequence length."""
    bench = LayerBench(layer, seq, names, a, device, dtype)
    results = {n: Result(VARIANTS[n].label) for n in names}
    rows = check_rows(a.check_rows, seq, device)
    live = []
    for name in names:
        try:
            bench.check(name, results[name], rows, TOLERANCE[dtype])
            live.append(name)
        except Exception as err:  # an OOM or a kernel that fails: a row of the table, not the end of the run
            _failed(results[name], "check", err)
        _free(device)
    for phase in ("fwd", "fwd+bwd"):
        timed = [n for n in live if phase == "fwd" or not bench.eager_flex(n)]
        times = {n: [] for n in timed}
        for round_ in range(a.rounds):
            # Every other round in reverse, so that each variant follows each other one alike.
            for name in timed[::1 if round_ % 2 == 0 else -1]:
                try:
                    times[name].append(_timed(bench.timer, lambda: bench.run(name, phase), device, results[name],
                                              round_ == a.rounds - 1))
                except Exception as err:
                    _failed(results[name], phase, err)
                    timed.remove(name)
                    del times[name]
                    _free(device)
        for name, ts in times.items():
            results[name].ms[phase] = statistics.median(ts[1:] if len(ts) > 1 else ts) * 1e3
    for name in live:
        if bench.eager_flex(name):
            results[name].note = results[name].note or "no backward: FlexAttention on CPU"
    return list(results.values()), "; ".join(bench.notes)


def _timed(timer: Timer, run, device, result: Result, last: bool) -> float:
    if last and device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        seconds = timer(run)
        result.peak_gib = max(result.peak_gib or 0.0, (torch.cuda.max_memory_allocated() - base) / 2**30)
        return seconds
    return timer(run)


def _failed(result: Result, phase: str, err: Exception) -> None:
    """Note the error on the variant's row; running out of memory is a result (the dense O(seq^2) paths at
    long sequences), any other error fails the run."""
    if isinstance(err, torch.OutOfMemoryError):
        result.note = f"{phase}: out of memory"
        return
    text = str(err).strip().splitlines()
    result.note = f"{phase}: ERROR {type(err).__name__}: {text[0][:100] if text else ''}"
    result.error = True


def _free(device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def format_table(layer: LayerShape, seq: int, results: list[Result], notes: str, tol: float) -> str:
    lines = [f"seq {seq}: the window covers {window_work_fraction(seq, layer.window):.1%} of full causal "
             f"attention's (query, key) pairs" + (f"; {notes}" if notes else "")]
    lines.append(f"  {'variant':30s} {'fwd ms':>9s} {'x (a)':>6s} {'fwd+bwd ms':>11s} {'x (a)':>6s} "
                 f"{'peak GiB':>9s}  max diff out / grad (tolerance {tol:.0e})")
    base = results[0].ms if results and results[0].label.startswith("(a)") else {}

    def cell(res: Result, phase: str) -> tuple[str, str]:
        if phase not in res.ms:
            return "-", "-"
        ratio = f"{res.ms[phase] / base[phase]:.2f}" if phase in base else "-"
        return f"{res.ms[phase]:.3f}", ratio

    for res in results:
        (f_ms, f_x), (b_ms, b_x) = cell(res, "fwd"), cell(res, "fwd+bwd")
        peak = f"{res.peak_gib:.2f}" if res.peak_gib is not None else "-"
        out = f"{res.diff_out:.1e}" if res.diff_out is not None else "-"
        grad = f"{res.diff_grad:.1e}" if res.diff_grad is not None else "-"
        verdict = "  MISMATCH" if res.mismatch else ""
        note = f"  ({res.note})" if res.note else ""
        lines.append(f"  {res.label:30s} {f_ms:>9s} {f_x:>6s} {b_ms:>11s} {b_x:>6s} {peak:>9s}  {out} / {grad}"
                     f"{verdict}{note}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--models", default=None,
                        help="family:flavor list (default gpt_oss:20B,gemma3:27B; --quick: their debug models)")
    parser.add_argument("--seq-lens", type=_ints, default=None,
                        help="default 4096,8192,16384 on CUDA, 512,1024 on CPU, 64,128 with --quick")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help=f"comma list of {', '.join(VARIANTS)} (sink variants skip layers without sinks)")
    parser.add_argument("--rounds", type=int, default=None, help="default 10 on CUDA, 5 on CPU, 3 with --quick")
    parser.add_argument("--check-rows", type=int, default=256, help="query rows compared with the reference")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile each variant's call (default: on CUDA)")
    parser.add_argument("--quick", action="store_true", help="the debug models' shapes, tiny sequences")
    a = parser.parse_args(argv)
    unknown = [n for n in a.variants.split(",") if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants {','.join(unknown)} unknown; known: {', '.join(VARIANTS)}")
    cuda = a.device == "cuda"
    a.dtype = DTYPES[a.dtype or ("bfloat16" if cuda else "float32")]
    a.models = a.models or ("gpt_oss:debugmodel,gemma3:debugmodel" if a.quick else "gpt_oss:20B,gemma3:27B")
    a.seq_lens = a.seq_lens or ([64, 128] if a.quick else [4096, 8192, 16384] if cuda else [512, 1024])
    a.rounds = a.rounds or (3 if a.quick else 10 if cuda else 5)
    a.compile = cuda if a.compile is None else a.compile
    try:
        a.layers = [sliding_layer(m) for m in a.models.split(",")]
    except ValueError as err:
        parser.error(str(err))
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    check_machine(a)
    device = torch.device(a.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    ok = True
    for layer in a.layers:
        names = [n for n in a.variants.split(",") if layer.sinks or not VARIANTS[n].sinks]
        print(f"{layer.name} sliding layer: {layer.heads} query / {layer.kv_heads} key-value heads of "
              f"{layer.head_dim}, window {layer.window}{', sinks' if layer.sinks else ''}; batch {a.batch}, "
              f"{str(a.dtype).removeprefix('torch.')}, {a.device}, {'compiled' if a.compile else 'eager'}"
              + ("; CPU FlexAttention eager and forward only" if device.type == "cpu" and
                 any(VARIANTS[n].flex for n in names) else ""))
        for seq in a.seq_lens:
            results, notes = bench_layer(layer, seq, list(names), a, device, a.dtype)
            print(format_table(layer, seq, results, notes, TOLERANCE[a.dtype]), flush=True)
            ok = ok and not any(r.mismatch or r.error for r in results)
    if not ok:
        print("FAILED: a variant's output or gradients differ from the float32 reference beyond tolerance "
              "(MISMATCH), or it raised an error (ERROR)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
