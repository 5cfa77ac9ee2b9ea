"""Side by side with torchtitan on this machine: the same Llama, data, AdamW and clipping, trained by
titanlike's train_step and by torchtitan's own Trainer.train_step, in alternating paired rounds.

    pip install --no-deps --target /tmp/tt torchtitan==0.2.2 tyro docstring-parser shtab typeguard
    OMP_NUM_THREADS=2 python scripts/bench_torchtitan.py --torchtitan-path /tmp/tt \\
        [--bench-warmup 3] [--bench-steps 10] [--bench-rounds 5] [--only titanlike|torchtitan]
        [--real-rope] [--rope-only] [--profile] [train.py options]

torchtitan is not a dependency of titanlike: install it apart (the line above; tyro and its small
dependencies are what torchtitan's config module imports) and name the folder. Without train.py options
the job is train_configs/debug_model.toml: the Llama 3 debug model (dim 256, 8 layers, 16 query and 8
key/value heads, vocab of the debug tokenizer, Llama 3.1 RoPE scaling; 7.3 M parameters), seq 256,
batch 8, float32, AdamW (fused), gradient clipping at 1.0, one process.

On a GPU, the single-GPU table's configurations (bf16, compile, float8), e.g.

    python scripts/bench_torchtitan.py --torchtitan-path /tmp/tt --job.config_file train_configs/llama3_1b.toml \\
        --model.tokenizer_path $LLAMA3_TOKENIZER --model.args.tie_word_embeddings false [--model.converters float8]

torchtitan's Llama 3 has no tied embeddings, so the Llama 3.2 presets run untied on both sides. Each side
applies its own compile (per block) and its own float8 converter (torchtitan's Float8LinearConverter with
the job's [float8] settings); bf16 is torch.autocast on both at world size 1. Both models and optimizer
states share the device in the paired mode; `--only NAME` runs one side alone (titanlike's model leaves
the device before torchtitan's steps) so that the printed peak memory is that side's, and is the way to
fit 3B on one 80 GB GPU. The ratio of two --only runs is not paired: run them back to back.

What runs on each side:
  titanlike   its Trainer, built from the job as train.py builds it, and Trainer.train_step.
  torchtitan  its Llama 3 Transformer (torchtitan.models.llama3), built with the same sizes and loaded
              with titanlike's initial weights (the script checks that both give the same logits), its
              cross-entropy loss, OptimizersContainer (same AdamW settings and implementation) and LR
              schedulers, driven by torchtitan.train.Trainer.train_step itself, on a Trainer whose
              attributes are set here: its __init__ sets up CUDA and process groups and cannot run on a
              CPU-only machine. At world size 1 its meshes are all of size 1, so the mesh lookups answer
              None, as torchtitan's do at that size, without building a device mesh.
Both step through the same batches from titanlike's loader, fetched outside the timed region; the first
--bench-warmup steps of each are not timed; rounds alternate (ABBA order) and the median of the
per-round ratios is printed with the medians of each side. Load averages are printed with the figures:
on a shared machine, compare only figures taken at a low load.

--real-rope adds a third loop: titanlike with RoPE in its real-valued form in eager too (the form
inductor compiles, and the only form before 2026-11-25), to measure what the complex multiply saves.
--rope-only times just the rotary embedding (forward and backward of q and k, every layer of a step)
in the three forms instead of whole steps. --profile runs torch.profiler over the loops instead of
timing them, and prints each operator's self CPU time and calls per step side by side.

On a CPU-only machine torchtitan's package needs two stand-ins, installed only when the real module is
missing: `datasets` (imported by its Hugging Face dataloader, unused here) and its MoE Triton kernels
(imported by its float8 converter, unused by a dense Llama).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import os
import statistics
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO / "train_configs" / "debug_model.toml"


def _stand_in(name: str, **attributes) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module


def _missing(name: str) -> bool:
    return name not in sys.modules and importlib.util.find_spec(name) is None


def _unused(*args, **kwargs):
    raise RuntimeError("a stand-in of bench_torchtitan.py was called: this benchmark does not support that path")


def import_torchtitan(path: str | None) -> types.SimpleNamespace:
    """torchtitan's modules this benchmark uses, or SystemExit with one sentence saying why not."""
    if path:
        sys.path.insert(0, os.path.abspath(path))
    if importlib.util.find_spec("torchtitan") is None:
        raise SystemExit("torchtitan is not importable (it is not a titanlike dependency): install it apart with "
                         "`pip install --no-deps --target /tmp/tt torchtitan==0.2.2 tyro docstring-parser shtab "
                         "typeguard` and pass --torchtitan-path /tmp/tt.")
    if _missing("datasets"):
        _stand_in("datasets", Dataset=object, load_dataset=_unused)
        _stand_in("datasets.distributed", split_dataset_by_node=_unused)
        sys.modules["datasets"].distributed = sys.modules["datasets.distributed"]
    if _missing("triton"):
        _stand_in("torchtitan.models.moe.kernels", generate_permute_indices=_unused, fill_indices_wrapper=_unused)
    try:
        modules = {name: importlib.import_module(f"torchtitan.{name}") for name in (
            "train", "config", "components.loss", "components.optimizer", "components.lr_scheduler",
            "distributed", "distributed.utils", "models.llama3", "models.llama3.model.model",
            "models.llama3.infra.parallelize", "components.quantization.float8")}
    except ImportError as e:
        raise SystemExit(f"torchtitan is installed but does not import here ({e}); install its missing "
                         "dependency into the same folder with `pip install --no-deps --target ...`.") from None
    version = getattr(sys.modules["torchtitan"], "__version__", "unknown")
    return types.SimpleNamespace(version=version, **{name.replace(".", "_"): m for name, m in modules.items()})


def inputs_and_labels(batch):
    """A loader batch as (inputs, labels): a dict of named tensors, or the older (inputs, labels) pair."""
    if isinstance(batch, dict):
        return batch["inputs"], batch["labels"]
    return batch[0], batch[1]


def torchtitan_args(tt, args, seq_len: int):
    """torchtitan's TransformerModelArgs for titanlike's Llama args, or SystemExit if it has no equivalent."""
    from titanlike.models.llama3.model import TransformerModelArgs as Llama3Args

    if not isinstance(args, Llama3Args):
        raise SystemExit("bench_torchtitan.py compares the llama3 family only (--model.name llama3).")
    if args.rope_scaling is None or args.head_dim != args.dim // args.n_heads or args.tie_word_embeddings:
        raise SystemExit("torchtitan's Llama 3 always applies Llama 3.1 RoPE scaling, has head_dim = dim / n_heads "
                         "and no tied embeddings: choose a flavor like that (debugmodel, 100M, 8B).")
    model_args = tt.models_llama3_model_model
    s = args.rope_scaling
    return model_args.TransformerModelArgs(
        dim=args.dim, n_layers=args.n_layers, n_heads=args.n_heads, n_kv_heads=args.n_kv_heads,
        vocab_size=args.vocab_size, multiple_of=args.multiple_of, ffn_dim_multiplier=args.ffn_dim_multiplier,
        norm_eps=args.norm_eps, rope_theta=args.rope_theta, max_seq_len=seq_len, depth_init=args.depth_init,
        rope_scaling_args=model_args.RoPEScalingArgs(
            scaling_factor=s.factor, low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings))


def torchtitan_job(tt, cfg):
    """torchtitan's JobConfig with the job's optimizer, schedule, training, compile and float8 settings."""
    job = tt.config.JobConfig()
    o, s, t = cfg.optimizer, cfg.lr_scheduler, cfg.training
    job.optimizer = dataclasses.replace(job.optimizer, name=o.name, lr=o.lr, beta1=o.beta1, beta2=o.beta2, eps=o.eps,
                                      weight_decay=o.weight_decay, implementation=o.implementation)
    job.lr_scheduler = dataclasses.replace(job.lr_scheduler, warmup_steps=s.warmup_steps, decay_type=s.decay_type,
                                         min_lr_factor=s.min_lr_factor)
    job.training = dataclasses.replace(job.training, max_norm=t.max_norm, steps=t.steps, seq_len=t.seq_len,
                                     local_batch_size=t.local_batch_size, mixed_precision_param=t.mixed_precision_param)
    job.compile = dataclasses.replace(job.compile, enable=cfg.compile.enable, backend=cfg.compile.backend,
                                      components=list(cfg.compile.components))
    f = cfg.float8
    job.quantize.linear.float8 = dataclasses.replace(
        job.quantize.linear.float8, recipe_name=f.recipe_name or None, filter_fqns=list(f.filter_fqns), emulate=f.emulate,
        enable_fsdp_float8_all_gather=f.enable_fsdp_float8_all_gather,
        precompute_float8_dynamic_scale_for_fsdp=f.precompute_float8_dynamic_scale_for_fsdp)
    return job


def single_device_dims(tt):
    parallel_dims = tt.distributed.ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1,
                                                world_size=1)
    parallel_dims.get_optional_mesh = lambda dims: None  # every mesh has size 1 (see the module docstring)
    return parallel_dims


def convert_and_compile(tt, job, model, converters: list[str]) -> None:
    """What torchtitan's trainer does to its model on one device: its float8 converter (when the job
    converts to float8), then per-block torch.compile (when the job compiles)."""
    if "float8" in converters:
        tt.components_quantization_float8.Float8LinearConverter(job, single_device_dims(tt)).convert(model)
    if job.compile.enable and "model" in job.compile.components:
        tt.models_llama3_infra_parallelize.apply_compile(model, job.compile)


def torchtitan_trainer(tt, job, model, device):
    """A torchtitan Trainer holding its own components for `model`, built without its __init__ (that
    one sets up process groups)."""
    t = job.training
    parallel_dims = single_device_dims(tt)
    trainer = tt.train.Trainer.__new__(tt.train.Trainer)
    optimizers = tt.components_optimizer.build_optimizers([model], job.optimizer, parallel_dims)
    trainer.__dict__.update(
        job_config=job, parallel_dims=parallel_dims, device=device, model_parts=[model],
        model_args=model.model_args, tokenizer=None, gradient_accumulation_steps=1, step=0, ntokens_seen=0,
        loss_fn=tt.components_loss.build_cross_entropy_loss(job), optimizers=optimizers,
        lr_schedulers=tt.components_lr_scheduler.build_lr_schedulers(optimizers, job.lr_scheduler, t.steps),
        train_context=tt.distributed_utils.get_train_context(False),
        maybe_enable_amp=tt.distributed_utils.maybe_enable_amp(parallel_dims, t.mixed_precision_param, device.type),
        checkpointer=types.SimpleNamespace(maybe_wait_for_staging=lambda: None),
        # Steps that do not log: the comparison is of the steady step, as titanlike's below.
        metrics_processor=types.SimpleNamespace(should_log=lambda step: False),
    )
    return trainer


def time_steps(step_fn, batches: list) -> float:
    """Seconds for step_fn over the batches, fetched beforehand so that loading is not timed; on a GPU
    until the last kernel ends (a step that never syncs the host returns while its kernels queue)."""
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    for batch in batches:
        step_fn(batch)
    sync()
    return time.perf_counter() - start


def _given(args: list[str], option: str) -> bool:
    return any(arg == option or arg.startswith(f"{option}=") for arg in args)


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


@contextlib.contextmanager
def real_rope_in_eager():
    """titanlike's RoPE in its real-valued form in eager too (what it ran before 2026-11-25)."""
    from titanlike.models.common import rope

    fast = rope.rotate_pairs_complex
    rope.rotate_pairs_complex = rope.rotate_pairs_real
    try:
        yield
    finally:
        rope.rotate_pairs_complex = fast


def paired_rounds(step_fns: dict, fetch, *, warmup: int, steps: int, rounds: int) -> dict[str, list[float]]:
    """ms/step of each loop per round. In a round every loop steps through the same batches (fetch(n):
    the next n), and the order alternates (ABBA) so that drift hits every loop alike."""
    batches = fetch(warmup)
    for fn in step_fns.values():
        time_steps(fn, batches)
    times = {name: [] for name in step_fns}
    names = list(step_fns)
    for r in range(rounds):
        batches = fetch(steps)
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(time_steps(step_fns[name], batches) / steps * 1000)
    return times


def device_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"


def report(times: dict[str, list[float]], unit: str, *, tokens: int = 0, flops_per_token: float = 0.0,
           device=None) -> None:
    """Each loop's median; with tokens per step, tokens/s (and MFU on a known GPU) too."""
    from titanlike.observe.metrics import device_peak_flops

    peak = device_peak_flops(device) if device is not None else None
    base = next(iter(times))
    for name, samples in times.items():
        line = f"{name:32s} {statistics.median(samples):8.2f} {unit} (rounds: {', '.join(f'{s:.1f}' for s in samples)})"
        if tokens:
            tps = tokens / statistics.median(samples) * 1000
            line += f", {tps:,.0f} tokens/s" + (f", MFU {100 * tps * flops_per_token / peak:.1f}%" if peak else "")
        if name != base:
            speedups = [s / b for b, s in zip(times[base], samples)]  # > 1: the base loop is faster
            line += (f"; {base} speed / {name} speed = {statistics.median(speedups):.3f}x (median of paired "
                     "rounds' time ratios)")
        print(line)


def rope_only(tt, titanlike_model, tt_model, batch_size: int, seq_len: int, args) -> None:
    """Forward + backward of the rotary embedding of q and k, times the layers: each form's cost per step."""
    import torch

    from titanlike.models.common.rope import apply_rotary_emb

    a = titanlike_model.model_args
    table = titanlike_model.rope_cache
    freqs_cis = tt_model.freqs_cis
    q = torch.randn(batch_size, seq_len, a.n_heads, a.head_dim, requires_grad=True)
    k = torch.randn(batch_size, seq_len, a.n_kv_heads or a.n_heads, a.head_dim, requires_grad=True)
    grads = [torch.randn_like(q), torch.randn_like(k)]
    tt_rope = tt.models_llama3_model_model.apply_rotary_emb

    def rotate(fn):
        def one_step(_):
            for _ in range(a.n_layers):
                torch.autograd.grad(fn(q, k), [q, k], grads)
        return one_step

    def titanlike_real(xq, xk):
        with real_rope_in_eager():
            return apply_rotary_emb(xq, table), apply_rotary_emb(xk, table)

    fns = {"titanlike RoPE (complex, eager)": rotate(lambda xq, xk: (apply_rotary_emb(xq, table),
                                                                     apply_rotary_emb(xk, table))),
           "titanlike RoPE (real form)": rotate(titanlike_real),
           f"torchtitan {tt.version} RoPE": rotate(lambda xq, xk: tt_rope(xq, xk, freqs_cis))}
    with torch.no_grad():
        outq = apply_rotary_emb(q, table)
        with real_rope_in_eager():
            real = apply_rotary_emb(q, table)
        ref, _ = tt_rope(q, k, freqs_cis)
    print(f"max |difference| of rotated q in float32: complex vs real {(outq - real).abs().max().item():.2e}, "
          f"titanlike vs torchtitan {(outq - ref).abs().max().item():.2e}")
    print(f"load average before: {load()}")
    times = paired_rounds(fns, lambda n: [None] * n, warmup=args.bench_warmup, steps=args.bench_steps,
                          rounds=args.bench_rounds)
    report(times, f"ms per step ({a.n_layers} layers, q and k, forward + backward)")
    print(f"load average after: {load()}")


def profile_steps(step_fns: dict, fetch, *, warmup: int, steps: int, rows: int = 60) -> None:
    """torch.profiler over `steps` steps of each loop (same batches): self ms and calls per step of every
    operator, side by side, the costliest first: GPU kernel time on a GPU (where the step's time is), CPU
    time otherwise."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    from torch._dynamo.utils import counters

    batches = fetch(warmup + steps)
    per_op, wall = {}, {}
    for name, fn in step_fns.items():
        counters.clear()
        time_steps(fn, batches[:warmup])
        wall[name] = time_steps(fn, batches[warmup:]) / steps * 1000  # unprofiled, for the gaps
        with profile(activities=activities) as prof:
            time_steps(fn, batches[warmup:])
        per_op[name] = {e.key: ((e.self_device_time_total if gpu else e.self_cpu_time_total) / steps / 1000,
                                e.count / steps) for e in prof.key_averages()}
        # Recompiles and graph breaks show as host time the kernel table does not count.
        print(f"{name}: dynamo {dict(counters['stats'])}, graph breaks {sum(counters['graph_break'].values())}, "
              f"recompiles {dict(counters['recompiles'])}")
    names = list(per_op)
    ops = sorted({op for table in per_op.values() for op in table},
                 key=lambda op: -max(table.get(op, (0, 0))[0] for table in per_op.values()))
    print(f"load average: {load()}; self {'GPU' if gpu else 'CPU'} ms per step (calls per step), {steps} profiled "
          "steps per loop")
    print(f"{'operator':48s}" + "".join(f" {name[:24]:>24s}" for name in names))
    for op in ops[:rows]:
        cells = (per_op[name].get(op, (0.0, 0)) for name in names)
        print(f"{op[:48]:48s}" + "".join(f" {f'{ms:.2f} ({calls:g})':>24s}" for ms, calls in cells))
    print(f"{'total':48s}" + "".join(f" {sum(ms for ms, _ in per_op[n].values()):24.1f}" for n in names))
    print(f"{'wall ms per step (unprofiled)':48s}" + "".join(f" {wall[n]:24.1f}" for n in names))


def parse_args(argv: list[str] | None = None):
    """The benchmark's own options and the job's configuration (every other option, on the default job), checked."""
    from titanlike.config import load_job_config

    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Every other option is a train.py job option (--job.config_file FILE, --section.key VALUE); without "
               f"--job.config_file the job is {DEFAULT_CONFIG.relative_to(REPO)}.")
    parser.add_argument("--torchtitan-path", default=None,
                        help="the folder torchtitan was installed into with pip --target (default: the environment)")
    parser.add_argument("--bench-warmup", type=int, default=3, help="untimed steps first, per loop (default 3)")
    parser.add_argument("--bench-steps", type=int, default=10, help="timed steps per round (default 10)")
    parser.add_argument("--bench-rounds", type=int, default=5,
                        help="timed rounds, alternating the loops; medians are reported (default 5)")
    parser.add_argument("--real-rope", action="store_true",
                        help="also time titanlike with its real-valued RoPE in eager (the form before 2026-11-25)")
    parser.add_argument("--rope-only", action="store_true",
                        help="time only the rotary embedding (forward + backward of q and k) in each form")
    parser.add_argument("--profile", action="store_true",
                        help="instead of timing, profile --bench-steps steps of each loop with torch.profiler and "
                             "print every operator's self CPU time and calls per step, side by side")
    parser.add_argument("--only", choices=("titanlike", "torchtitan"), default=None,
                        help="run one side only, in this process alone, so that its peak memory is its own (both "
                             "sides' models and optimizer states in one process may not fit one GPU at 3B)")
    bench, rest = parser.parse_known_args(argv)
    if not _given(rest, "--job.config_file"):
        rest = ["--job.config_file", str(DEFAULT_CONFIG), *rest]
    if not _given(rest, "--job.dump_folder"):  # the trainer's lock and logs go to a scratch folder
        rest = [*rest, "--job.dump_folder", tempfile.mkdtemp(prefix="bench-torchtitan-")]
    return bench, load_job_config(rest)


def main() -> None:
    bench, cfg = parse_args()
    tt = import_torchtitan(bench.torchtitan_path)

    import torch

    from titanlike.models.outputs import logits_of
    from titanlike.train.plan import plan_job
    from titanlike.train.trainer import Trainer

    if int(os.environ.get("WORLD_SIZE", 1)) != 1:
        raise SystemExit("bench_torchtitan.py compares one process: run it without torchrun.")
    trainer = Trainer(plan_job(cfg, 1))
    if trainer.grad_accum_steps != 1:
        raise SystemExit("bench_torchtitan.py compares steps without gradient accumulation: leave "
                         "training.global_batch_size empty.")
    device = trainer.device
    t = cfg.training
    data = iter(trainer.dataloader)
    first_inputs, _ = inputs_and_labels(next(data))
    first_inputs = first_inputs.to(device)
    job = torchtitan_job(tt, cfg)
    ours = trainer.model_parts[0]

    tt_model = None
    if bench.only != "titanlike":
        # torchtitan's model with titanlike's initial weights (the parameter names are the same; per-block
        # compile and float8's Float8Linear keep them), then torchtitan's own float8 swap and compile.
        with torch.device("meta"):
            tt_model = tt.models_llama3_model_model.Transformer(torchtitan_args(tt, trainer.model_args, t.seq_len))
        tt_model.to_empty(device=device)
        with torch.no_grad():  # as torchtitan's trainer calls it
            tt_model.init_weights(buffer_device=device)
        missing, unexpected = tt_model.load_state_dict(ours.state_dict(), strict=False)
        if missing or unexpected:
            raise SystemExit(f"titanlike's and torchtitan's Llama differ: missing {missing}, unexpected {unexpected}")
        check = "logits checked without converters"
        if "float8" not in cfg.model.converters:  # float8 quantizes each side's matmuls on its own
            # Eager (a compiled block would compile once more for no-grad and then again for training).
            with torch.no_grad(), torch.compiler.set_stance("force_eager"):
                diff = (logits_of(ours(first_inputs)).float() - tt_model(first_inputs).float()).abs().max().item()
            check = f"logits differ by at most {diff:.1e} on the first batch (float32)"
        convert_and_compile(tt, job, tt_model, cfg.model.converters)
    if bench.only == "torchtitan":  # titanlike's model leaves the device: the memory figures are torchtitan's
        ours.to("meta")
        trainer.optimizer.state.clear()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    n_params = sum(p.numel() for p in ours.parameters())
    print(f"torchtitan {tt.version}, torch {torch.__version__} on {device_name(device)}; {cfg.model.name} "
          f"{cfg.model.flavor}: {n_params / 1e6:.2f} M parameters, seq {t.seq_len}, batch {t.local_batch_size}, "
          f"{t.mixed_precision_param}, compile {cfg.compile.enable}, converters {cfg.model.converters or 'none'}, "
          f"AdamW ({cfg.optimizer.implementation}), max_norm {t.max_norm}"
          + ("" if tt_model is None else f"; same weights: {check}"))
    if bench.rope_only:
        rope_only(tt, ours, tt_model, t.local_batch_size, t.seq_len, bench)
        trainer.close()
        return

    # torchtitan's single-device step enters torch.autocast with the job's dtype, which CPU autocast
    # refuses for float32 with a warning (and runs without it, as intended here).
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    tt_trainer = None if tt_model is None else torchtitan_trainer(tt, job, tt_model, device)

    def titanlike_step(batch):
        trainer.train_step([trainer.prepare(batch)])

    def titanlike_real_rope_step(batch):
        with real_rope_in_eager():
            trainer.train_step([trainer.prepare(batch)])

    def torchtitan_step(batch):
        inputs, labels = inputs_and_labels(batch)
        tt_trainer.step += 1
        tt_trainer.train_step(iter([({"input": inputs}, labels)]))

    step_fns = {"titanlike": titanlike_step, f"torchtitan {tt.version}": torchtitan_step}
    if bench.only:
        step_fns = {name: fn for name, fn in step_fns.items() if name.startswith(bench.only)}
    if bench.real_rope:
        step_fns["titanlike, real RoPE in eager"] = titanlike_real_rope_step
    fetch = lambda n: [next(data) for _ in range(n)]  # noqa: E731
    if bench.profile:
        profile_steps(step_fns, fetch, warmup=bench.bench_warmup, steps=bench.bench_steps)
        trainer.close()
        return
    print(f"load average before: {load()}")
    times = paired_rounds(step_fns, fetch, warmup=bench.bench_warmup, steps=bench.bench_steps,
                          rounds=bench.bench_rounds)
    report(times, "ms/step", tokens=t.local_batch_size * t.seq_len,
           flops_per_token=trainer.model_args.flops_per_token(t.seq_len), device=device)
    if device.type == "cuda":
        side = f"{bench.only}'s" if bench.only else "both sides' (one process: not separable)"
        print(f"peak memory, {side}: {torch.cuda.max_memory_reserved(device) / 2**30:.2f} GiB reserved, "
              f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB allocated")
    print(f"load average after: {load()}")
    trainer.close()


if __name__ == "__main__":
    main()
