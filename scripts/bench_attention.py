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
reference (and, where it has a backward, the gradients of q, k, v and the sinks of a random weighting
of those rows); the largest difference, relative to the reference's largest magnitude, is printed
and must be under the dtype's tolerance (TOLERANCE), else the row says MISMATCH and the exit status is 1.
Rounds are interleaved (each round calls every variant once), the first dropped, the median printed:
CUDA times by synchronize and the wall clock, CPU by this process's CPU time on one thread. The forward
runs as in training, on inputs that need gradients (so a compiled variant compiles once, for the check,
and serves both phases); the forward-only flex variants of CPU run without autograd.

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
    spec = get_model_spec(family)
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


def max_difference(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over max |want| (in float32): the error in units of the tensor's scale."""
    got, want = got.float(), want.float()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


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
    ok: bool = True
    ms: dict = field(default_factory=dict)  # "fwd" / "fwd+bwd" -> median ms
    peak_gib: float | None = None
    note: str = ""


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


@contextlib.contextmanager
def _eager_flex():
    """FlexAttention eager, without its warning that it is (the table's header says so)."""
    with torch.compiler.set_stance("force_eager"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        yield


def bench_layer(layer: LayerShape, seq: int, names: list[str], a, device, dtype) -> tuple[list[Result], str]:
    """Check, then time, the variants on one layer's shape at one sequence length."""
    torch.manual_seed(0)
    cpu = device.type == "cpu"
    b = a.batch
    q = torch.randn(b, layer.heads, seq, layer.head_dim, device=device, dtype=dtype)
    k = torch.randn(b, layer.kv_heads, seq, layer.head_dim, device=device, dtype=dtype)
    v = torch.randn(b, layer.kv_heads, seq, layer.head_dim, device=device, dtype=dtype)
    sinks = torch.randn(layer.heads, device=device, dtype=dtype)
    variants = [VARIANTS[n] for n in names]
    notes = []
    masks = {}
    if any(var.flex for var in variants):
        timer = Timer(device)
        ids = torch.zeros(b, seq, dtype=torch.long, device=device)
        DocumentMask.from_document_ids(ids, "flex").windowed(layer.window)  # warm-up
        built = {}
        built["full"] = timer(lambda: masks.__setitem__("full", DocumentMask.from_document_ids(ids, "flex")))
        built["window"] = timer(lambda: masks.__setitem__("window", masks["full"].windowed(layer.window)))
        notes.append(f"flex block masks built in {built['full'] * 1e3:.1f} ms (full) + "
                     f"{built['window'] * 1e3:.1f} ms (window), once per microbatch")
    torch.compiler.reset()  # a fresh compile cache for each shape: no recompile limit reached across them
    calls = {}
    for name, var in zip(names, variants):
        fn = var.fn
        if a.compile and not (cpu and var.flex):
            fn = torch.compile(fn, dynamic=False)
        calls[name] = fn

    def call(name: str, q, k, v, sinks):
        var = VARIANTS[name]
        with _eager_flex() if cpu and var.flex else contextlib.nullcontext():
            return calls[name](q, k, v, masks, layer.window, sinks if var.sinks else None)

    has_backward = {n: not (cpu and VARIANTS[n].flex) for n in names}
    results = {n: Result(VARIANTS[n].label) for n in names}
    tol = TOLERANCE[dtype]
    rows = check_rows(a.check_rows, seq, device)
    weight = torch.randn(b, layer.heads, len(rows), layer.head_dim, device=device)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]

    def grads_of(out_rows: torch.Tensor) -> list[torch.Tensor]:
        return torch.autograd.grad((out_rows.float() * weight).sum(), leaves, allow_unused=True)

    # The check: outputs at `rows` (and gradients through them) against the float32 reference.
    for name in list(names):
        var, res = VARIANTS[name], results[name]
        try:
            want = reference(*leaves[:3], rows, window=layer.window if var.window else None,
                             sinks=leaves[3] if var.sinks else None)
            if has_backward[name]:
                got = call(name, *leaves)[:, :, rows]
                got_grads = grads_of(got)
                want_grads = grads_of(want)
                pairs = [(g, w) for g, w in zip(got_grads, want_grads) if w is not None]
                res.diff_grad = max(max_difference(g if g is not None else torch.zeros_like(w), w) for g, w in pairs)
            else:
                with torch.no_grad():
                    got = call(name, q, k, v, sinks)[:, :, rows]
            res.diff_out = max_difference(got.detach(), want.detach())
        except Exception as err:  # an OOM or a kernel that fails: a row of the table, not the end of the run
            _failed(res, "check", err)
            names.remove(name)
            _free(device)
            continue
        res.ok = res.diff_out <= tol and (res.diff_grad is None or res.diff_grad <= tol)
        del want, got
        _free(device)

    grad_out = torch.randn(b, layer.heads, seq, layer.head_dim, device=device, dtype=dtype)
    timer = Timer(device)
    for phase in ("fwd", "fwd+bwd"):
        live = [n for n in names if phase == "fwd" or has_backward[n]]
        times = {n: [] for n in live}
        for round_ in range(a.rounds):
            for name in list(live):
                try:
                    if not has_backward[name]:  # forward only, without autograd
                        def run():
                            with torch.no_grad():
                                call(name, q, k, v, sinks)
                    elif phase == "fwd":  # as in training (inputs that need gradients): the check's graph
                        def run():
                            call(name, *leaves)
                    else:
                        def run():
                            for t in leaves:
                                t.grad = None
                            call(name, *leaves).backward(grad_out)
                    seconds = _timed(timer, run, device, results[name], round_ == a.rounds - 1)
                    times[name].append(seconds)
                except Exception as err:
                    _failed(results[name], phase, err)
                    live.remove(name)
                    times.pop(name)
                    _free(device)
        for name, ts in times.items():
            results[name].ms[phase] = statistics.median(ts[1:] if len(ts) > 1 else ts) * 1e3
    for name in names:
        if not has_backward[name]:
            results[name].note = results[name].note or "no backward: FlexAttention on CPU"
    return list(results.values()), "; ".join(notes)


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
    result.ok = False


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
        verdict = "" if res.ok else "  MISMATCH"
        note = f"  ({res.note})" if res.note else ""
        lines.append(f"  {res.label:30s} {f_ms:>9s} {f_x:>6s} {b_ms:>11s} {b_x:>6s} {peak:>9s}  {out} / {grad}"
                     f"{verdict}{note}")
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


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
    if a.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; this machine has none (use --device cpu)")
    cuda = a.device == "cuda"
    a.dtype = DTYPES[a.dtype or ("bfloat16" if cuda else "float32")]
    a.models = a.models or ("gpt_oss:debugmodel,gemma3:debugmodel" if a.quick else "gpt_oss:20B,gemma3:27B")
    a.seq_lens = a.seq_lens or ([64, 128] if a.quick else [4096, 8192, 16384] if cuda else [512, 1024])
    a.rounds = a.rounds or (3 if a.quick else 10 if cuda else 5)
    a.compile = cuda if a.compile is None else a.compile
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    layers = [sliding_layer(m) for m in a.models.split(",")]
    ok = True
    for layer in layers:
        names = [n for n in a.variants.split(",") if layer.sinks or not VARIANTS[n].sinks]
        print(f"{layer.name} sliding layer: {layer.heads} query / {layer.kv_heads} key-value heads of "
              f"{layer.head_dim}, window {layer.window}{', sinks' if layer.sinks else ''}; batch {a.batch}, "
              f"{str(a.dtype).removeprefix('torch.')}, {a.device}, {'compiled' if a.compile else 'eager'}"
              + ("; CPU FlexAttention eager and forward only" if device.type == "cpu" and
                 any(VARIANTS[n].flex for n in names) else ""))
        for seq in a.seq_lens:
            results, notes = bench_layer(layer, seq, list(names), a, device, a.dtype)
            print(format_table(layer, seq, results, notes, TOLERANCE[a.dtype]), flush=True)
            ok = ok and all(r.ok for r in results)
    if not ok:
        print("FAILED: a variant's output or gradients differ from the float32 reference beyond tolerance "
              "(MISMATCH), or it raised an error (ERROR)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
