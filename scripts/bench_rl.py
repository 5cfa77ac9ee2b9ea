#!/usr/bin/env python
"""GRPO speed: titanlike against TRL's GRPOTrainer (its default generation, transformers' generate, no
vLLM) on the same model, prompts, group size and completion length, one process on CPU.

    python scripts/bench_rl.py [--flavor debugmodel] [--prompts 4] [--generations 8] [--completion-length 64]
                               [--steps 3] [--rounds 3] [--compile]

The model is titanlike's Llama 3 flavor initialized with seed 0, which the titanlike job builds again
(debug.seed 0: the initialization is a function of the seed and each parameter's name), exported to a
Hugging Face folder with its tokenizer that TRL loads: both start from the same weights. The prompts are
texts ("add: 34 + 36 ="), the same rows for both (each side shuffles them with its own seed); the reward
(`digits` below) is one function with TRL's signature that both call. Every step generates G completions
of each prompt and trains one optimizer step on them (fp32, AdamW, beta 0, loss_type dapo, num_iterations
1). TRL is told `min_new_tokens` = the completion length, so every completion has that many tokens;
titanlike has no such option and ends a row at EOS, so its figures count the tokens it actually generated.

Time is the process's CPU time (time.process_time) at one thread, which a shared machine's load moves
far less than wall time. Each round runs a fresh titanlike job, then a fresh TRL trainer, of steps + 1
steps (the first one is a warm-up and not counted): rollout tokens per second (the generation call's
new tokens over its CPU time: titanlike's Engine.generate, TRL's model.generate) and the whole step's
time (generation, rewards, loss, backward, optimizer), with their ratios. --compile adds titanlike with
grpo.compile_generation (the decode step compiled; its compile falls in the warm-up step) to each round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def digits(prompts, completions, **kwargs) -> list[float]:
    """A reward with TRL's signature: 1 for a completion holding a digit, else 0."""
    return [float(any(ch.isdigit() for ch in c)) for c in completions]


class Clock:
    """CPU seconds and generated tokens, per step."""

    def __init__(self):
        self.steps, self.generation, self.tokens = [], [], []

    @contextlib.contextmanager
    def step(self):
        self.generation.append(0.0)
        self.tokens.append(0)
        begin = time.process_time()
        yield
        self.steps.append(time.process_time() - begin)

    def generated(self, seconds: float, tokens: int) -> None:
        self.generation[-1] += seconds
        self.tokens[-1] += tokens

    def figures(self) -> dict:
        """Over the steps after the first (a warm-up): rollout tokens/s and the mean step time."""
        steps, generation, tokens = self.steps[1:], self.generation[1:], self.tokens[1:]
        return {"rollout_tokens_per_s": sum(tokens) / sum(generation), "step_s": sum(steps) / len(steps),
                "generation_share": sum(generation) / sum(steps), "tokens_per_step": sum(tokens) / len(tokens)}


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


def write_model(folder: str, flavor: str, chat_template: str | None = None) -> None:
    """titanlike's llama3 flavor, initialized with seed 0, as a Hugging Face folder with its tokenizer
    (and chat_template in its tokenizer_config.json when given)."""
    import torch

    from titanlike.checkpoint.hf import write_hf
    from titanlike.data import DEFAULT_TOKENIZER_PATH
    from titanlike.models.registry import get_model_spec

    spec = get_model_spec("llama3")
    args = spec.flavors[flavor]
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    write_hf(model.state_dict(), spec, args, folder, tokenizer_path=DEFAULT_TOKENIZER_PATH, chat_template=chat_template)


def write_prompts(path: str, n: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            a, b = rng.randint(10, 49), rng.randint(10, 49)
            f.write(json.dumps({"prompt": f"add: {a} + {b} =", "answer": str(a + b)}) + "\n")


def run_titanlike(args, folder: str, prompts: str, dump: str, *, compile: bool = False) -> Clock:
    from titanlike.config import load_job_config
    from titanlike.inference.engine import Engine
    from titanlike.train.plan import plan_job
    from titanlike.train.trainer import Trainer

    argv = ["--model.name", "llama3", "--model.flavor", args.flavor, "--training.objective", "grpo",
            "--training.dataset", "text", "--training.dataset_path", prompts, "--training.split", "100,0,0",
            "--training.seq_len", str(args.seq_len), "--training.local_batch_size", str(args.prompts),
            "--training.global_batch_size", str(args.prompts), "--training.steps", str(args.steps + 1),
            "--training.mixed_precision_param", "float32", "--training.max_norm", "1.0",
            "--optimizer.name", "AdamW", "--optimizer.lr", "1e-5", "--optimizer.implementation", "foreach",
            "--lr_scheduler.warmup_steps", "0", "--grpo.num_generations", str(args.generations),
            "--grpo.max_completion_length", str(args.completion_length), "--grpo.reward_funcs", "bench_rl:digits",
            "--grpo.beta", "0", "--grpo.loss_type", "dapo", "--grpo.temperature", "1.0",
            "--checkpoint.no_enable", "--debug.seed", "0",
            "--metrics.no_enable_tensorboard", "--metrics.no_enable_jsonl", "--metrics.log_freq", "1000",
            "--job.dump_folder", dump, *(["--grpo.compile_generation"] if compile else [])]
    clock = Clock()
    trainer = Trainer(plan_job(load_job_config(argv), 1))
    run_step = trainer._run_step
    generate = Engine.generate

    def timed_step(data):
        with clock.step():
            return run_step(data)

    def timed_generate(engine, *a, **kw):
        begin = time.process_time()
        completions, stats = generate(engine, *a, **kw)
        clock.generated(time.process_time() - begin, stats.new_tokens)
        return completions, stats

    # The trainer's own loop, its step and the engine's generate call timed (restored after the run).
    trainer._run_step = timed_step
    Engine.generate = timed_generate
    try:
        trainer.train()
    finally:
        Engine.generate = generate
        trainer.close()
    return clock


def run_trl(args, folder: str, prompts: str, dump: str) -> Clock:
    import datasets
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    clock = Clock()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    generate = model.generate

    def timed_generate(*a, **kw):
        begin = time.process_time()
        out = generate(*a, **kw)
        rows, new = out.shape[0], out.shape[1] - kw["input_ids"].shape[1]
        clock.generated(time.process_time() - begin, rows * new)  # min_new_tokens: every row is this long
        return out

    model.generate = timed_generate

    config = GRPOConfig(
        output_dir=dump, use_cpu=True, bf16=False, seed=0, max_steps=args.steps + 1, learning_rate=1e-5,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
        per_device_train_batch_size=args.prompts * args.generations, gradient_accumulation_steps=1,
        num_generations=args.generations, max_completion_length=args.completion_length, temperature=1.0,
        beta=0.0, loss_type="dapo", generation_kwargs={"min_new_tokens": args.completion_length},
        report_to="none", logging_steps=1000, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
        # TRL's configs checkpoint activations by default (a second forward in the backward); titanlike's
        # job does not, so neither side does.
        activation_checkpointing=False)
    data = datasets.load_dataset("json", data_files=prompts, split="train")
    trainer = GRPOTrainer(model=model, reward_funcs=digits, args=config, train_dataset=data,
                          processing_class=tokenizer, callbacks=[step_callback(clock)])
    trainer.remove_callback(transformers.PrinterCallback)  # its summary line of the run
    trainer.train()
    return clock


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--generations", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--completion-length", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run, after one warm-up step")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds: titanlike, then TRL")
    parser.add_argument("--compile", action="store_true", help="also titanlike with its decode step compiled")
    args = parser.parse_args()

    import logging

    import torch
    import transformers
    import trl

    torch.set_num_threads(1)
    logging.getLogger("titanlike").setLevel(logging.WARNING)
    transformers.logging.set_verbosity_error()
    work = tempfile.mkdtemp(prefix="bench_rl_")
    folder, prompts = os.path.join(work, "model"), os.path.join(work, "prompts.jsonl")
    write_model(folder, args.flavor)
    write_prompts(prompts, 200)
    print(f"# llama3 {args.flavor}, {args.prompts} prompts x G {args.generations}, {args.completion_length} new "
          f"tokens; torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}; "
          f"1 thread, CPU time; rounds of titanlike then TRL, {args.steps} steps each after a warm-up", flush=True)
    runs = {"titanlike": run_titanlike, "trl": run_trl}
    if args.compile:
        runs = {"titanlike": run_titanlike, "compiled": partial(run_titanlike, compile=True), "trl": run_trl}
    results = {name: [] for name in runs}
    for r in range(args.rounds):
        for name, run in runs.items():
            figures = run(args, folder, prompts, os.path.join(work, f"{name}_{r}")).figures()
            results[name].append(figures)
            print(f"round {r + 1} {name:9s} rollout {figures['rollout_tokens_per_s']:8.1f} tok/s  step "
                  f"{figures['step_s']:7.3f} s  generating {figures['generation_share']:.0%}  "
                  f"{figures['tokens_per_step']:.0f} tokens/step", flush=True)
        theirs = results["trl"][-1]
        for name in [n for n in runs if n != "trl"]:
            ours = results[name][-1]
            rollout = ours["rollout_tokens_per_s"] / theirs["rollout_tokens_per_s"]
            print(f"round {r + 1} {name} / TRL: rollout {rollout:.2f}x  step {theirs['step_s'] / ours['step_s']:.2f}x "
                  "(> 1: titanlike faster)", flush=True)
    for name in [n for n in runs if n != "trl"]:
        ours, theirs = results[name], results["trl"]
        rollout = statistics.median(o["rollout_tokens_per_s"] / t["rollout_tokens_per_s"] for o, t in zip(ours, theirs))
        step = statistics.median(t["step_s"] / o["step_s"] for o, t in zip(ours, theirs))
        print(f"median of {args.rounds} rounds, {name}: rollout tokens/s {rollout:.2f}x TRL's, whole step {step:.2f}x "
              "faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())
