#!/usr/bin/env python
"""GRPO speed: titanlike against TRL's GRPOTrainer (its default generation, transformers' generate, no
vLLM) on the same model, prompts, group size and completion length, one process on CPU or one GPU.

    python scripts/bench_rl.py [--flavor debugmodel] [--prompts 4] [--generations 8] [--completion-length 64]
                               [--steps 3] [--rounds 3] [--compile | --engine eager|compiled|both]
                               [--device cpu|cuda] [--dtype float32|bfloat16] [--tokenizer PATH]
                               [--trl-side auto|trainer|generate] [--quick]

The model is titanlike's Llama 3 flavor initialized with seed 0, which the titanlike job builds again
(debug.seed 0: the initialization is a function of the seed and each parameter's name), exported to a
Hugging Face folder with its tokenizer that TRL loads: both start from the same weights. The prompts are
texts ("add: 34 + 36 ="), the same rows for both (each side shuffles them with its own seed); the reward
(`digits` below) is one function with TRL's signature that both call. Every step generates G completions
of each prompt and trains one optimizer step on them (AdamW, beta 0, loss_type dapo, num_iterations 1).
TRL is told `min_new_tokens` = the completion length, so every completion has that many tokens;
titanlike has no such option and ends a row at EOS, so its figures count the tokens it actually generated.

On CPU (the default) time is the process's CPU time (time.process_time) at one thread, which a shared
machine's load moves far less than wall time. Each round runs a fresh titanlike job, then a fresh TRL
trainer, of steps + 1 steps (the first one is a warm-up and not counted): rollout tokens per second (the
generation call's new tokens over its time: titanlike's Engine.generate, TRL's model.generate) and the
whole step's time (generation, rewards, loss, backward, optimizer), with their ratios, and the share of
titanlike's step spent generating. --compile (--engine both) adds titanlike with grpo.compile_generation
(the decode step compiled; its compile falls in the warm-up step) to each round.

--device cuda: time is wall time between torch.cuda.synchronize() calls (a GPU's work is not the
process's CPU time), each side's peak GPU memory (torch.cuda.max_memory_allocated, reset before each
side) is printed, both sides step with fused AdamW, and titanlike generates with grpo.compile_generation
unless --engine says otherwise (the decode step replayed as a CUDA graph, titanlike/inference/engine.py).
--dtype bfloat16 trains titanlike as its 1B preset does, training.mixed_precision_param bfloat16 (on one
device: fp32 weights, the step under bf16 autocast, train/plan.py; the engine decodes in the weights'
dtype, fp32), and gives TRL the model in bf16 with GRPOConfig bf16, as its users load it. Each titanlike
row also prints its `mismatch`, the mean |engine - trainer| log-probability of the completion tokens
(objectives/grpo.py), from its last step's logged metrics. --tokenizer: a tiktoken ranks file (Llama 3's
tokenizer.model) for both sides, which sizes the model's vocabulary as the job does; the export converts
it for transformers as it does the debug tokenizer (titanlike/data/hf_tokenizer.py).

Without trl (--trl-side generate; auto takes it when trl is not importable) TRL's side is its rollout
alone: transformers' generate on the model, with the GenerationConfig GRPOTrainer builds (trl 1.16
grpo_trainer.py, __init__ without vLLM), the left-padded ids and mask its `_generate_single_turn` makes
of each prompt G times, and in bf16 the forward accelerate's prepare gives the model (bf16 autocast,
outputs made fp32), steps + 1 calls of the prompts in file order; rollout tokens/s, no step figure.
tests/integration/test_bench_rl.py checks both against a real GRPOTrainer.

On a lent H200 (issue 48 item 2; that machine has no trl, so TRL's side is the stand-in; LLAMA3_TOKENIZER
names Llama 3's tokenizer.model there):

    python scripts/bench_rl.py --device cuda --dtype bfloat16 --flavor 1B --tokenizer $LLAMA3_TOKENIZER \\
        --generations 8 --completion-length 256 --prompts 8 --steps 2 --rounds 2

An estimate, not a measurement (nothing here has run on a GPU yet): ~15 s of imports; ~30 s to export
the 1B model (initialized on the GPU, written in bf16, 2.5 GB) with the 128k-token tokenizer converted;
per titanlike round ~10 s to build the job, then the warm-up step's compile of the decode step and its
CUDA-graph capture, ~60-90 s in the first round (a fresh job recompiles: ~20-30 s in the second, from
inductor's cache), and 3 steps of ~2-3 s (64 rows x 256 tokens: under 1 s of fp32 CUDA-graph decode at
~3 ms a token, then the step's forward and backward over 64 rows of 320); per TRL round ~5 s to load
and 3 generate calls of ~5-8 s (eager bf16 decode under autocast, ~20-30 ms a token). About 3.5-4
minutes in all, most of it the first compile: give the call a 420 s limit, and if it must be shorter,
--rounds 1 (~2.5 minutes) still gives every figure, unpaired.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import random
import statistics
import sys
import tempfile
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# --quick: a smoke run of every code path on the tiny model (one round, one timed step).
QUICK = {"flavor": "debugmodel_tiny", "prompts": 2, "generations": 2, "completion_length": 8, "steps": 1,
         "rounds": 1}
# GRPOConfig's generation defaults in trl 1.16 (grpo_config.py) that the bench leaves as they are; the
# stand-in builds TRL's GenerationConfig with them (tests/integration/test_bench_rl.py checks it).
TRL_GENERATION_DEFAULTS = {"top_p": 1.0, "top_k": 0, "min_p": None, "repetition_penalty": 1.0,
                           "cache_implementation": None}


def digits(prompts, completions, **kwargs) -> list[float]:
    """A reward with TRL's signature: 1 for a completion holding a digit, else 0."""
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


class Meter:
    """How a side is measured on its device: `now`, the process's CPU time on CPU, on a GPU wall time once its
    queue is drained; and on a GPU the peak memory allocated since `fresh` (None on CPU)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"

    def now(self) -> float:
        if not self.cuda:
            return time.process_time()
        import torch

        torch.cuda.synchronize()
        return time.perf_counter()

    def fresh(self) -> None:
        """Before a side: the last side's objects and compiled graphs (on a GPU, their CUDA graphs' memory)
        let go, and the peak reset."""
        import torch

        gc.collect()
        torch.compiler.reset()
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        import torch

        return torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None

    def describe(self) -> str:
        import torch

        return f"{torch.cuda.get_device_name()}, wall time" if self.cuda else "1 thread, CPU time"


class Clock:
    """Seconds (of `now`) and generated tokens, per step or per generation call."""

    def __init__(self, now=time.process_time):
        self.now = now
        self.steps, self.generation, self.tokens = [], [], []

    @contextlib.contextmanager
    def step(self):
        self.generation.append(0.0)
        self.tokens.append(0)
        begin = self.now()
        yield
        self.steps.append(self.now() - begin)

    def generated(self, seconds: float, tokens: int) -> None:
        """A generation call inside the current step."""
        self.generation[-1] += seconds
        self.tokens[-1] += tokens

    def rollout(self, seconds: float, tokens: int) -> None:
        """A generation call of its own, outside any step (TRL's rollout alone)."""
        self.generation.append(seconds)
        self.tokens.append(tokens)

    def figures(self) -> dict:
        """Over the steps (calls) after the first (a warm-up): rollout tokens/s, and with steps the mean step
        time and the share of it spent generating (None without steps)."""
        generation, tokens = self.generation[1:], self.tokens[1:]
        out = {"rollout_tokens_per_s": sum(tokens) / sum(generation), "tokens_per_step": sum(tokens) / len(tokens),
               "step_s": None, "generation_share": None}
        if self.steps:
            steps = self.steps[1:]
            out.update(step_s=sum(steps) / len(steps), generation_share=sum(generation) / sum(steps))
        return out


def step_callback(clock: Clock):
    """A transformers TrainerCallback that times each optimizer step of a trainer with `clock`."""
    import transformers

    class Steps(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.context = clock.step()
            self.context.__enter__()

        def on_step_end(self, *_, **__):
            self.context.__exit__(None, None, None)

    return Steps()


def write_model(folder: str, flavor: str, chat_template: str | None = None, *, tokenizer_path: str | None = None,
                device: str = "cpu", dtype: str = "float32") -> None:
    """titanlike's llama3 flavor, initialized with seed 0 on `device` (the values depend on the device type,
    models/common/init.py: the job's), as a Hugging Face folder of `dtype` weights with its tokenizer (and
    chat_template in its tokenizer_config.json when given). tokenizer_path: a tokenizer other than the debug
    one, whose vocabulary then sizes the model as the job's plan does (train/plan.py)."""
    import torch

    from titanlike.checkpoint.hf import write_hf
    from titanlike.data import DEFAULT_TOKENIZER_PATH
    from titanlike.data.tokenizer import build_tokenizer
    from titanlike.models.registry import get_model_spec

    spec = get_model_spec("llama3")
    args = spec.flavors[flavor]
    if tokenizer_path:
        args = args.update_from_config(vocab_size=build_tokenizer(tokenizer_path).vocab_size, seq_len=args.max_seq_len)
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device=device)
    model.init_weights(seed=0)
    state = {name: value.to("cpu") for name, value in model.state_dict().items()}
    del model
    write_hf(state, spec, args, folder, dtype=getattr(torch, dtype),
             tokenizer_path=tokenizer_path or DEFAULT_TOKENIZER_PATH, chat_template=chat_template)


def write_prompts(path: str, n: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(10, 49), rng.randint(10, 49)
            f.write(json.dumps({"prompt": f"add: {a} + {b} =", "answer": str(a + b)}) + "\n")


def run_titanlike(args, folder: str, prompts: str, dump: str, *, compile: bool = False) -> dict:
    from titanlike.config import load_job_config
    from titanlike.inference.engine import Engine
    from titanlike.train.plan import plan_job
    from titanlike.train.trainer import Trainer

    argv = ["--model.name", "llama3", "--model.flavor", args.flavor, "--training.objective", "grpo",
            "--training.dataset", "text", "--training.dataset_path", prompts, "--training.split", "100,0,0",
            "--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(args.prompts),
            "--training.global_batch_size", str(args.prompts), "--training.steps", str(args.steps + 1),
            "--training.mixed_precision_param", args.dtype, "--training.max_norm", "1.0",
            "--optimizer.name", "AdamW", "--optimizer.lr", "1e-5",
            "--optimizer.implementation", "fused" if args.device == "cuda" else "foreach",
            "--lr_scheduler.warmup_steps", "0", "--grpo.num_generations", str(args.generations),
            "--grpo.max_completion_length", str(args.completion_length), "--grpo.reward_funcs", "bench_rl:digits",
            "--grpo.beta", "0", "--grpo.loss_type", "dapo", "--grpo.temperature", "1.0",
            "--checkpoint.no_enable", "--debug.seed", "0",
            "--metrics.no_enable_tensorboard", "--metrics.no_enable_jsonl", "--metrics.log_freq", "1000",
            "--job.dump_folder", dump, *(["--grpo.compile_generation"] if compile else []),
            *(["--model.tokenizer_path", args.tokenizer] if args.tokenizer else [])]
    clock = Clock(Meter(args.device).now)
    trainer = Trainer(plan_job(load_job_config(argv), 1))
    run_step = trainer._run_step
    generate = Engine.generate
    log = trainer.metrics.log
    logged = []  # the extra metrics of each logged step (the first and the last: metrics.log_freq 1000)

    def timed_step(data):
        with clock.step():
            return run_step(data)

    def timed_generate(engine, *a, **kw):
        begin = clock.now()
        completions, stats = generate(engine, *a, **kw)
        clock.generated(clock.now() - begin, stats.new_tokens)
        return completions, stats

    def kept_log(*a, **kw):
        logged.append(dict(kw.get("extra") or {}))
        return log(*a, **kw)

    # The trainer's own loop, its step and the engine's generate call timed (restored after the run).
    trainer._run_step = timed_step
    trainer.metrics.log = kept_log
    Engine.generate = timed_generate
    try:
        trainer.train()
    finally:
        Engine.generate = generate
        trainer.close()
    return {**clock.figures(), "mismatch": logged[-1].get("mismatch") if logged else None}


def load_trl_model(args, folder: str):
    """The exported model (in --dtype, on --device) and its tokenizer, as the bench gives them to TRL."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=args.dtype).to(args.device)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def trl_config(args, dump: str):
    """The GRPOConfig of TRL's side."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=dump, use_cpu=args.device == "cpu", bf16=args.dtype == "bfloat16", seed=0,
        max_steps=args.steps + 1, learning_rate=1e-5, lr_scheduler_type="constant", weight_decay=0.0,
        max_grad_norm=1.0, optim="adamw_torch_fused" if args.device == "cuda" else "adamw_torch",
        per_device_train_batch_size=args.prompts * args.generations, gradient_accumulation_steps=1,
        num_generations=args.generations, max_completion_length=args.completion_length, temperature=1.0,
        beta=0.0, loss_type="dapo", generation_kwargs={"min_new_tokens": args.completion_length},
        report_to="none", logging_steps=1000, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        # TRL's configs checkpoint activations by default (a second forward in the backward); titanlike's
        # job does not, so neither side does.
        activation_checkpointing=False)


def trl_trainer(args, folder: str, prompts: str, dump: str, clock: Clock | None = None):
    """TRL's GRPOTrainer on the exported model, its steps timed with `clock` when given."""
    import datasets
    import transformers
    from trl import GRPOTrainer

    model, tokenizer = load_trl_model(args, folder)
    data = datasets.load_dataset("json", data_files=prompts, split="train")
    trainer = GRPOTrainer(model=model, reward_funcs=digits, args=trl_config(args, dump), train_dataset=data,
                          processing_class=tokenizer, callbacks=[step_callback(clock)] if clock else None)
    trainer.remove_callback(transformers.PrinterCallback)  # its summary line of the run
    return trainer


def run_trl(args, folder: str, prompts: str, dump: str) -> dict:
    clock = Clock(Meter(args.device).now)
    trainer = trl_trainer(args, folder, prompts, dump, clock)
    model = trainer.model
    generate = model.generate

    def timed_generate(*a, **kw):
        begin = clock.now()
        out = generate(*a, **kw)
        rows, new = out.shape[0], out.shape[1] - kw["input_ids"].shape[1]
        clock.generated(clock.now() - begin, rows * new)  # min_new_tokens: every row is this long
        return out

    model.generate = timed_generate
    trainer.train()
    return {**clock.figures(), "mismatch": None}


def trl_generation_config(args, model, tokenizer):
    """The GenerationConfig GRPOTrainer builds for its transformers rollout with trl_config's settings (trl
    1.16 grpo_trainer.py __init__, no vLLM), after giving the model the tokenizer's pad id as it does; its
    eos ids are the tokenizer's EOS and every one the model's generation config declares."""
    from transformers import GenerationConfig

    settings = {**TRL_GENERATION_DEFAULTS, "temperature": 1.0}
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if tokenizer.eos_token_id not in eos:
        eos = [tokenizer.eos_token_id, *eos]
    kwargs = {"max_new_tokens": args.completion_length, "do_sample": True, "pad_token_id": tokenizer.pad_token_id,
              "bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos, **settings,
              "min_new_tokens": args.completion_length}  # trl_config's generation_kwargs, applied last
    return GenerationConfig(**kwargs, disable_compile=True)


def trl_forward(args, model) -> None:
    """GRPOConfig bf16 as TRL runs it: accelerate's prepare (Accelerator.prepare_model, native amp) makes the
    model's forward run under bf16 autocast and return its bf16 tensors as fp32, and GRPOTrainer's generate
    calls that forward (unwrap_model keeps it). The same wrapper on the stand-in's model."""
    import torch

    if args.dtype != "bfloat16":
        return
    forward = model.forward

    def autocast_forward(*a, **kw):
        with torch.autocast(device_type=args.device, dtype=torch.bfloat16):
            out = forward(*a, **kw)
        for name, value in out.items():  # accelerate's convert_to_fp32: the bf16 (and fp16) tensors
            if isinstance(value, torch.Tensor) and value.dtype in (torch.bfloat16, torch.float16):
                out[name] = value.float()
        return out

    model.forward = autocast_forward


def trl_inputs(tokenizer, texts: list[str]) -> dict:
    """GRPOTrainer's generate inputs for text prompts: each tokenized alone (_tokenize_prompts), then
    left-padded with the pad id, the attention mask 0 on the padding (_generate_single_turn)."""
    import torch

    ids = tokenizer(text=texts)["input_ids"]
    width = max(len(row) for row in ids)
    input_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, width - len(row):] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def rollout_prompts(args, prompts: str) -> list[list[str]]:
    """The stand-in's generation batches, steps + 1 of them: the next --prompts prompts of the file, each G
    times in a row (TRL's RepeatSampler gives a prompt's G rows together)."""
    with open(prompts) as f:
        texts = [json.loads(line)["prompt"] for line in f]
    batches = []
    for call in range(args.steps + 1):
        chosen = [texts[(call * args.prompts + i) % len(texts)] for i in range(args.prompts)]
        batches.append([t for t in chosen for _ in range(args.generations)])
    return batches


def run_generate(args, folder: str, prompts: str, dump: str) -> dict:
    """TRL's rollout alone (module docstring): generate with GRPOTrainer's GenerationConfig and inputs."""
    import torch

    model, tokenizer = load_trl_model(args, folder)
    config = trl_generation_config(args, model, tokenizer)
    trl_forward(args, model)
    model.train()  # as GRPOTrainer's training_step leaves it when it generates
    clock = Clock(Meter(args.device).now)
    for texts in rollout_prompts(args, prompts):
        inputs = {name: value.to(model.device) for name, value in trl_inputs(tokenizer, texts).items()}
        with torch.no_grad():
            begin = clock.now()
            out = model.generate(**inputs, generation_config=config)
            seconds = clock.now() - begin
        clock.rollout(seconds, out.shape[0] * (out.shape[1] - inputs["input_ids"].shape[1]))  # min_new_tokens
    return {**clock.figures(), "mismatch": None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel", help="a llama3 flavor (1B: Llama 3.2 1B)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--seq-len", type=int, help="titanlike's rows (default: the completion length + 64, at "
                        "least 128)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run, after one warm-up step")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds: titanlike, then TRL")
    parser.add_argument("--engine", choices=("eager", "compiled", "both"),
                        help="titanlike's generation: eager, grpo.compile_generation, or both sides (default: eager "
                        "on cpu, compiled on cuda)")
    parser.add_argument("--compile", action="store_true", help="--engine both")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="titanlike's training.mixed_precision_param; TRL's model dtype and GRPOConfig bf16")
    parser.add_argument("--tokenizer", help="a tiktoken tokenizer.model for both sides (default: the debug one)")
    parser.add_argument("--trl-side", choices=("auto", "trainer", "generate"), default="auto",
                        help="TRL's GRPOTrainer, or its rollout alone (transformers' generate with the trainer's "
                        "GenerationConfig); auto: the trainer when trl is importable")
    parser.add_argument("--quick", action="store_true", help="a smoke run of every code path: "
                        + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    args = parser.parse_args(argv)
    if args.quick:  # its sizes, unless given
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    if args.engine is None:
        args.engine = "both" if args.compile else "compiled" if args.device == "cuda" else "eager"
    if args.seq_len is None:
        args.seq_len = max(128, args.completion_length + 64)
    for name in ("prompts", "steps", "rounds", "completion_length"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.generations < 2:
        parser.error(f"--generations must be at least 2 (a group compares its completions), got {args.generations}")
    if args.trl_side == "auto":
        args.trl_side = "trainer" if importlib.util.find_spec("trl") is not None else "generate"
    elif args.trl_side == "trainer" and importlib.util.find_spec("trl") is None:
        parser.error("--trl-side trainer needs trl installed; use --trl-side generate for its rollout alone")
    from titanlike.models.llama3 import llama3_flavors

    if args.flavor not in llama3_flavors:
        parser.error(f"--flavor {args.flavor} is not a llama3 flavor; the flavors are {', '.join(llama3_flavors)}")
    return args


def check_machine(args) -> None:
    """The device the arguments name is this machine's (apart from parse_args, so that the commands prepared
    for a GPU parse here: scripts/gpu_wave.py --check)."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a GPU, and torch sees none")
    if args.device == "cpu" and torch.cuda.is_available():
        raise SystemExit("--device cpu on a machine with a GPU: titanlike's trainer would take the GPU; hide it "
                         "(CUDA_VISIBLE_DEVICES=) or use --device cuda")


def _shown(value, spec: str, width: int) -> str:
    return f"{'n/a':>{width}s}" if value is None else f"{value:{width}{spec}}"


def _line(name: str, f: dict) -> str:
    share = "n/a" if f["generation_share"] is None else f"{f['generation_share']:.0%}"
    return (f"{name:9s} rollout {f['rollout_tokens_per_s']:9.1f} tok/s  step {_shown(f['step_s'], '.3f', 7)} s  "
            f"generating {share:>4s}  {f['tokens_per_step']:.0f} tokens/step  mismatch "
            f"{_shown(f['mismatch'], '.2e', 8)}  peak {_shown(f['peak_gib'], '.2f', 6)} GiB")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_machine(args)

    import logging

    import torch
    import transformers

    meter = Meter(args.device)
    if not meter.cuda:
        torch.set_num_threads(1)
    logging.getLogger("titanlike").setLevel(logging.WARNING)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # from_pretrained's per-load bar
    work = tempfile.mkdtemp(prefix="bench_rl_")
    folder, prompts = os.path.join(work, "model"), os.path.join(work, "prompts.jsonl")
    write_model(folder, args.flavor, tokenizer_path=args.tokenizer, device=args.device, dtype=args.dtype)
    write_prompts(prompts, 200)
    if args.trl_side == "trainer":
        import trl

        theirs, trl_name = f"trl {trl.__version__}", "trl"
    else:
        theirs, trl_name = "no trl: TRL's rollout alone (generate), no step figure", "trl-gen"
    print(f"# llama3 {args.flavor}, {args.prompts} prompts x G {args.generations}, {args.completion_length} new "
          f"tokens, {args.dtype}; torch {torch.__version__}, transformers {transformers.__version__}, {theirs}; "
          f"{meter.describe()}; rounds of titanlike then TRL, {args.steps} steps each after a warm-up", flush=True)
    ours = {}
    if args.engine in ("eager", "both"):
        ours["titanlike"] = run_titanlike
    if args.engine in ("compiled", "both"):
        ours["compiled"] = partial(run_titanlike, compile=True)
    runs = {**ours, trl_name: run_trl if args.trl_side == "trainer" else run_generate}
    results = {name: [] for name in runs}
    for r in range(args.rounds):
        for name, run in runs.items():
            meter.fresh()
            figures = run(args, folder, prompts, os.path.join(work, f"{name}_{r}"))
            figures["peak_gib"] = meter.peak_gib()
            results[name].append(figures)
            print(f"round {r + 1} {_line(name, figures)}", flush=True)
        theirs = results[trl_name][-1]
        for name in ours:
            mine = results[name][-1]
            rollout = mine["rollout_tokens_per_s"] / theirs["rollout_tokens_per_s"]
            step = "n/a" if theirs["step_s"] is None else f"{theirs['step_s'] / mine['step_s']:.2f}x"
            print(f"round {r + 1} {name} / TRL: rollout {rollout:.2f}x  step {step} (> 1: titanlike faster)",
                  flush=True)
    print(f"medians of {args.rounds} round(s):")
    for name, figures in results.items():
        median = {key: None if figures[0][key] is None else statistics.median(f[key] for f in figures)
                  for key in figures[0]}
        print(f"median {_line(name, median)}")
    for name in ours:
        mine, theirs = results[name], results[trl_name]
        rollout = statistics.median(o["rollout_tokens_per_s"] / t["rollout_tokens_per_s"] for o, t in zip(mine, theirs))
        step = ("n/a (TRL's rollout alone)" if theirs[0]["step_s"] is None else
                f"{statistics.median(t['step_s'] / o['step_s'] for o, t in zip(mine, theirs)):.2f}x faster")
        print(f"median of {args.rounds} rounds, {name}: rollout tokens/s {rollout:.2f}x TRL's, whole step {step}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
