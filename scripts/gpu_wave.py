"""Issue #48's device work, prepared: each named piece is one `run` call on a lent GPU, sized to fit.

A lent H200 gives a session 15 minutes of device time, a minute of it to start, and nobody can debug
there; so every command is written here ahead, and `--check` parses every command's arguments on this
machine (tests/unit/test_gpu_wave.py runs it), so that a renamed option fails here, not on the GPU.

Once per session, on this machine (the kit is ~10 MB, ignored by git):

    EXTRA_WHEELS="$(python scripts/gpu_wave.py --extra-wheels)" bash ../shared/gpu/make-kit.sh
    bash scripts/gpu_kit_mamba.sh MAMBA_SOURCE      # only for the mamba piece: a state-spaces/mamba checkout
    python scripts/gpu_wave.py --check

Then one device call per piece, in the order of the list (`python scripts/gpu_wave.py --list`), with
carry [".gpu-kit"] and a timeout of the piece's estimate plus a minute:

    source .gpu-kit/activate.sh || exit 1; python scripts/gpu_wave.py PIECE --out $OUT

Each step of a piece runs as its own process under its own time limit; its output streams through
(the run's tail shows it) and is kept whole in $OUT/PIECE.STEP.log. A piece stops starting steps
when fewer seconds are left of --budget (default 540, under the device's 600 s per command) than the
next step's estimate, and the summary says which were skipped. Figures go to docs/performance.md with
the command, the device name activate.sh printed, torch's version and the date.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# What the box lacks for these pieces, beyond the kit's torchdata and torchao (all pure Python):
# flash-linear-attention's Triton kernels (gated_delta), einops (theirs and mamba_ssm's), torchtitan
# 0.2.2 and what its config module imports (8b).
EXTRA_WHEELS = ("flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.2 torchtitan==0.2.2 tyro docstring-parser "
                "shtab typeguard")


@dataclass
class Step:
    name: str
    argv: list[str]  # a script of this repository, then its arguments
    estimate_s: int  # on an H200, start and compile included
    env: dict[str, str] = field(default_factory=dict)

    def command(self) -> list[str]:
        script = self.argv[0]
        launcher = ["bash"] if script.endswith(".sh") else [sys.executable]
        return launcher + self.argv


def tokenizer() -> str:
    """The Llama 3 tokenizer the kit carries (activate.sh exports it; make-kit.sh writes it); without a kit,
    "" (the debug tokenizer: the flavors' vocabulary, and so the step's cost, stay the Llama 3 one)."""
    kit = REPO / ".gpu-kit" / "tokenizer.model"
    return os.environ.get("LLAMA3_TOKENIZER") or (str(kit) if kit.is_file() else "")


def pieces(out: Path) -> dict[str, tuple[str, list[Step]]]:
    """Every piece: what it measures (the issue's item) and its steps, in order of value."""
    tok = tokenizer()

    def dump(name: str) -> list[str]:  # a folder per run: a job locks its own
        return ["--job.dump_folder", str(out / name)]

    bench = ["scripts/bench.py", "--bench-warmup", "3", "--bench-steps", "10", "--bench-rounds", "2",
             "--metrics.no_enable_tensorboard", "--checkpoint.no_enable", "--profiling.no_enable_profiling"]
    one_b = [*bench, "--job.config_file", "train_configs/llama3_1b.toml", "--model.tokenizer_path", tok,
             "--training.seq_len", "4096"]
    eight_b = ["--job.config_file", "train_configs/llama3_8b.toml", "--model.tokenizer_path", tok,
               "--training.dataset", "default", "--training.dataset_path", "", "--training.seq_len", "8192",
               "--activation_checkpoint.mode", "full", "--compile.enable", "--metrics.no_enable_tensorboard",
               "--checkpoint.no_enable", "--profiling.no_enable_profiling"]
    short = ["--bench-warmup", "2", "--bench-steps", "3", "--bench-rounds", "2"]
    hybrid = [*bench, "--job.config_file", "train_configs/hybrid_debug.toml", "--training.seq_len", "4096",
              "--training.local_batch_size", "2", "--training.mixed_precision_param", "bfloat16"]
    return {
        "smoke": ("every family on CUDA, eager and compiled, and the 1B table row (a crash here first)", [
            Step("smoke", ["scripts/gpu_smoke.sh", tok], 200),
        ]),
        "rl": ("item 2: GRPO with a 1B policy (G 8, 256 tokens, bf16), the engine's CUDA graphs against TRL's "
               "rollout (transformers' generate as GRPOTrainer calls it: the box has no trl), the bf16 mismatch", [
            Step("grpo_1b", ["scripts/bench_rl.py", "--device", "cuda", "--dtype", "bfloat16", "--flavor", "1B",
                             "--tokenizer", tok, "--generations", "8", "--completion-length", "256", "--prompts", "8",
                             "--steps", "2", "--rounds", "2"], 330),
        ]),
        "optim": ("item 4 (Muon, bf16 optimizer states against fused AdamW: step time, memory, MFU at 1B "
                  "seq 4096 batch 1; the bf16-state update compiled) and item 1 (the clip folded into fused "
                  "AdamW: the profile's clip kernels)", [
            Step("adamw_fused", [*one_b, *dump("adamw_fused"), "--profile-steps", "3"], 75),
            Step("adamw_bf16_states", [*one_b, *dump("adamw_bf16"), "--optimizer.state_dtype", "bfloat16"], 50),
            Step("muon", [*one_b, *dump("muon"), "--optimizer.name", "Muon"], 55),
            Step("muon_bf16_states", [*one_b, *dump("muon_bf16"), "--optimizer.name", "Muon",
                                      "--optimizer.state_dtype", "bfloat16"], 55),
            Step("adamw_foreach", [*one_b, *dump("adamw_foreach"), "--optimizer.implementation", "foreach"], 50),
        ]),
        "8b": ("item 5: Llama 3 8B on one H200, full activation checkpointing, seq 8192, against torchtitan "
               "0.2.2 on the same settings (each side alone, so each peak memory is its own)", [
            Step("plan", ["train.py", *eight_b, *dump("plan_8b"),
                          "--job.validate_only"], 20),
            Step("titanlike", ["scripts/bench.py", *short, *eight_b, *dump("bench_8b")],
                 150),
            Step("torchtitan", ["scripts/bench_torchtitan.py", "--only", "torchtitan", *short, *eight_b,
                                *dump("torchtitan_8b")], 170),
        ]),
        "attention": ("item 3: sliding-window and sink attention (gpt-oss 20B's and Gemma 3 27B's layer shapes) "
                      "through flex compiled on CUDA against SDPA full causal attention, each checked first", [
            Step("gpt_oss_20b", ["scripts/bench_attention.py", "--device", "cuda", "--models", "gpt_oss:20B",
                                 "--seq-lens", "4096,8192"], 150),
            Step("gemma3_27b", ["scripts/bench_attention.py", "--device", "cuda", "--models", "gemma3:27B",
                                "--seq-lens", "4096,8192,16384"], 120),
        ]),
        "gated_delta": ("item 3: the Gated DeltaNet chunked rule (PyTorch, compiled) against flash-linear-attention's "
                        "Triton kernels (Qwen3-Next's 16 key / 32 value heads), outputs and gradients checked first", [
            Step("seq_4096", ["scripts/bench_gated_delta.py", "--device", "cuda", "--k-heads", "16", "--v-heads", "32",
                              "--seq", "4096", "--compile", "--functions", "transformers,fla"], 150),
            Step("seq_8192_16384", ["scripts/bench_gated_delta.py", "--device", "cuda", "--k-heads", "16",
                                    "--v-heads", "32", "--seq", "8192,16384", "--functions", "transformers,fla"], 60),
        ]),
        "mamba": ("item 1: mamba_ssm's Triton kernels against the PyTorch scan (the kit's copy of the "
                  "kernels: scripts/gpu_kit_mamba.sh), their test and one hybrid step each way", [
            Step("test", ["-m", "pytest", "-q", "tests/unit/test_mamba2.py", "-k", "gpu"], 60,
                 env={"PYTHONPATH": f"{REPO / '.gpu-kit' / 'mamba'}"}),
            Step("hybrid_kernels", [*hybrid, *dump("hybrid_kernels"), "--model.args.mamba.kernel", "auto"], 60,
                 env={"PYTHONPATH": f"{REPO / '.gpu-kit' / 'mamba'}"}),
            Step("hybrid_torch_scan", [*hybrid, *dump("hybrid_torch"), "--model.args.mamba.kernel", "torch"], 60),
        ]),
    }


def _prepend_env(env: dict[str, str]) -> dict[str, str]:
    """os.environ with each given path list put in front of what is there."""
    merged = dict(os.environ)
    for key, value in env.items():
        merged[key] = value + (os.pathsep + merged[key] if merged.get(key) else "")
    return merged


def run_piece(name: str, steps: list[Step], out: Path, budget_s: float) -> list[tuple[str, str, float]]:
    """Run the steps one after another, each limited to what is left of the budget; (step, verdict, seconds)."""
    start = time.monotonic()
    results = []
    for step in steps:
        left = budget_s - (time.monotonic() - start)
        if left < step.estimate_s:
            results.append((step.name, f"skipped ({left:.0f} s left, estimate {step.estimate_s} s)", 0.0))
            continue
        log = out / f"{name}.{step.name}.log"
        command = step.command()
        print(f"### {name}.{step.name}: {shlex.join(command)}", flush=True)
        began = time.monotonic()
        with open(log, "w") as sink:
            sink.write(f"### {shlex.join(command)}\n")
            sink.flush()
            proc = subprocess.Popen(command, cwd=REPO, env=_prepend_env(step.env), stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, bufsize=1)
            watchdog = threading.Timer(left, proc.kill)  # a silent hang is cut off too
            watchdog.start()
            try:
                for line in proc.stdout:  # stream through and keep: a run cut off still returns its log
                    sys.stdout.write(line)
                    sink.write(line)
                rc = proc.wait()
            finally:
                watchdog.cancel()
                if proc.poll() is None:
                    proc.kill()
        took = time.monotonic() - began
        verdict = "ok" if rc == 0 else ("out of time" if took > left else f"failed (exit {rc})")
        results.append((step.name, verdict, took))
    return results


def _load_script(path: Path):
    name = f"_checked_{path.stem}"
    if name not in sys.modules:  # registered first: a script's dataclasses look their module up by name
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def check(all_pieces: dict[str, tuple[str, list[Step]]]) -> list[str]:
    """Every step's arguments parsed by the script that takes them (its parse_args), train.py's job options by
    the job's loader, and every job planned for one process as train.py plans it (its data, tokenizer and
    layout rules; not the memory check, which needs the GPU); a shell script or pytest run only needs its
    files. Returns the problems, one per line."""
    from titanlike.config import JobConfig, load_job_config
    from titanlike.train.plan import plan_job

    problems = []
    for piece, (_, steps) in all_pieces.items():
        for step in steps:
            script, args = step.argv[0], step.argv[1:]
            where = f"{piece}.{step.name}"
            try:
                if script == "-m":  # python -m pytest ...: the test files it names exist
                    missing = [a for a in args if a.endswith(".py") and not (REPO / a).is_file()]
                    if missing:
                        problems.append(f"{where}: no such test file {missing}")
                elif script.endswith(".sh"):
                    if not (REPO / script).is_file():
                        problems.append(f"{where}: no such script {script}")
                else:
                    parsed = load_job_config(args) if script == "train.py" else \
                        _load_script(REPO / script).parse_args(args)
                    for job in (p for p in (parsed if isinstance(parsed, tuple) else (parsed,))
                                if isinstance(p, JobConfig)):
                        plan_job(job, world_size=1)
            except (Exception, SystemExit) as e:  # argparse exits on a bad option
                problems.append(f"{where}: {type(e).__name__}: {e}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("pieces", nargs="*", help="pieces to run, in this order")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu-wave-out")),
                        help="folder of the logs (default: $OUT, the device call's returned folder)")
    parser.add_argument("--budget", type=float, default=540, help="seconds for all the given pieces (default 540)")
    parser.add_argument("--list", action="store_true", help="print the pieces, their steps and estimates")
    parser.add_argument("--check", action="store_true", help="parse every step's arguments here and exit")
    parser.add_argument("--extra-wheels", action="store_true", help="print the kit's EXTRA_WHEELS and exit")
    args = parser.parse_args(argv)
    all_pieces = pieces(args.out)
    if args.extra_wheels:
        print(EXTRA_WHEELS)
        return 0
    if args.check:
        problems = check(all_pieces)
        print("\n".join(problems) or f"every step of {len(all_pieces)} pieces parses")
        return 1 if problems else 0
    if args.list or not args.pieces:
        for name, (what, steps) in all_pieces.items():
            print(f"{name} (~{sum(s.estimate_s for s in steps)} s): {what}")
            for step in steps:
                print(f"    {step.name} (~{step.estimate_s} s): {shlex.join(step.command()[1:])}")
        return 0
    unknown = [p for p in args.pieces if p not in all_pieces]
    if unknown:
        parser.error(f"no piece named {', '.join(unknown)}; the pieces are {', '.join(all_pieces)}")
    args.out.mkdir(parents=True, exist_ok=True)
    start, summary = time.monotonic(), []
    for name in args.pieces:
        left = args.budget - (time.monotonic() - start)
        summary += [(f"{name}.{s}", v, t) for s, v, t in run_piece(name, all_pieces[name][1], args.out, left)]
    print("### summary")
    for where, verdict, took in summary:
        print(f"{where:32s} {verdict:40s} {took:6.0f} s")
    return 0 if all(v == "ok" for _, v, _ in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
