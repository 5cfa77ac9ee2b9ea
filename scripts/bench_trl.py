#!/usr/bin/env python
"""SFT, LoRA and DPO speed: titanlike's Trainer against TRL's SFTTrainer and DPOTrainer on the same model,
data, batch and sequence length, one process per side on CPU (issue #47's "SFT 2.0x TRL's trained tokens/s,
LoRA 2.3x, DPO step 0.89x TRL's time").

    python scripts/bench_trl.py [--flavor debugmodel] [--seq-len 512] [--batch 8] [--steps 4] [--rounds 2]
                                [--only sft|lora|dpo] [--trl-packing-strategy bfd|wrapped] [--quick]

The model is titanlike's Llama 3 flavor initialized with seed 0, which each titanlike job builds again
(debug.seed 0), exported to a Hugging Face folder with its tokenizer and titanlike's llama3 chat template
(data/chat_template.py, whose generation tags mark the assistant's tokens), which TRL loads: both sides
start from the same weights and render conversations into the same tokens and assistant masks. Both train
in fp32 with AdamW (lr 1e-5, constant, no weight decay), gradient norm clipped at 1.0, no activation
checkpointing (TRL's configs turn it on by default), no evaluation, no saving, --batch samples or pairs a
step, one thread (torch.set_num_threads(1), OMP_NUM_THREADS=1).

- sft: the conversations of scripts/bench_sft.py (`conversations`, log-normal answer lengths), packed to
  seq_len, trained on the assistant's tokens only: titanlike's `training.objective sft` (best-fit
  decreasing; --batch samples of seq_len positions, each conversation attending within itself through
  SDPA with a dense document mask, the CPU path of models/common/attention.py), TRL's
  SFTConfig(packing=True, assistant_only_loss=True, max_length=seq_len). TRL's default packing (bfd,
  best-fit decreasing too) is padding-free: the batch's --batch bins are flattened into one row of about
  batch x seq_len tokens, which transformers' SDPA attends with a dense block-diagonal mask of that size
  (CPU has no variable-length kernel), so its attention costs about --batch times titanlike's and decides
  the ratio. --trl-packing-strategy wrapped keeps TRL's rows at seq_len tokens cut from the stream of
  conversations, attending across them with plain causal attention (cheaper than titanlike's document mask,
  and not the same training).
- lora: the same, with LoRA r=8, alpha 16, no dropout on q, k, v, o, gate, up and down projections
  (titanlike's lora converter; PEFT's LoraConfig through TRL's peft_config).
- dpo: generated preference pairs (`preference_pairs`: a prompt, two answers of random words), beta 0.1,
  sigmoid loss, the reference a frozen copy of the model as training starts: titanlike's
  `training.objective dpo` with dpo.reference model and dpo.no_packing (one pair per sample, so that both
  sides train --batch pairs a step), TRL's DPOConfig(max_length=seq_len), whose reference is its own second
  copy loaded from the folder. Each pair fills most of seq_len (each side about half of it, nothing is
  truncated), so that padding decides little: titanlike computes --batch rows of seq_len positions (a pair's
  two sides as two documents of a row, its attention over the whole row under a document mask), TRL
  2 x --batch rows padded to the batch's longest side (attention over each side alone: less than
  half of titanlike's attention work).

Figures: trained tokens per CPU second for sft and lora, counted on both sides as the label positions that
bear the loss in each step's batch (titanlike: the loader batch's `labels` != -100, a target per position;
TRL: the collated batch's `labels[:, 1:]` != -100, as transformers shifts them); for dpo the step's CPU time
and pairs per CPU second. Time is the process's CPU time (time.process_time) over the steps after the first
(a warm-up), each step timed from the batch in hand through the optimizer step: titanlike's Trainer._run_step
given its already-loaded batch, TRL's from the callbacks' step begin to step end (its collator runs before
it). Each side of each benchmark runs in a fresh process, titanlike then TRL, round after round (--quick:
one process per side runs all three benchmarks, one round); each reports its peak RSS (its whole run,
setup included). Differences that remain: TRL computes its logging metrics (entropy, token accuracy,
rewards) every step as it ships; TRL's AdamW is torch's default (for-loop on CPU), titanlike's
optimizer.implementation foreach; the two shuffle the packed samples with their own seeds.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_rl import step_callback, write_model  # noqa: E402
from bench_sft import WORDS, conversations  # noqa: E402

BENCHMARKS = ("sft", "lora", "dpo")
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LR = 1e-5


class Clock:
    """CPU seconds, trained tokens and pairs, per step."""

    def __init__(self):
        self.steps, self.tokens, self.pairs = [], [], []

    @contextlib.contextmanager
    def step(self):
        begin = time.process_time()
        yield
        self.steps.append(time.process_time() - begin)

    def batch(self, tokens: int, pairs: int) -> None:
        self.tokens.append(tokens)
        self.pairs.append(pairs)

    def figures(self) -> dict:
        """Over the steps after the first (a warm-up)."""
        seconds, tokens, pairs = sum(self.steps[1:]), sum(self.tokens[1:]), sum(self.pairs[1:])
        timed = len(self.steps) - 1
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        return {"trained_tokens_per_s": tokens / seconds, "step_s": seconds / timed, "pairs_per_s": pairs / seconds,
                "tokens_per_step": tokens / timed, "peak_rss_mib": peak}


def preference_pairs(n: int, seed: int, seq_len: int) -> list[dict]:
    """Conversational pairs (TRL's form, which titanlike reads too) whose two sides together fill about
    50-90% of seq_len tokens: the debug tokenizer spends ~1.1 tokens a word and the template ~10 a side."""
    rng = random.Random(seed)
    longest = max(2, int((seq_len // 2 - 32) / 1.2))
    rows = []
    for _ in range(n):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        chosen, rejected = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(longest // 2, longest)))
                            for _ in range(2))
        rows.append({"prompt": [{"role": "user", "content": prompt}],
                     "chosen": [{"role": "assistant", "content": chosen}],
                     "rejected": [{"role": "assistant", "content": rejected}]})
    return rows


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def run_titanlike(bench: str, args, work: str, dump: str) -> dict:
    from titanlike.config import load_job_config
    from titanlike.models.outputs import IGNORE_INDEX
    from titanlike.train.plan import plan_job
    from titanlike.train.trainer import Trainer

    data = os.path.join(work, "pairs.jsonl" if bench == "dpo" else "conversations.jsonl")
    argv = ["--model.name", "llama3", "--model.flavor", args.flavor, "--training.dataset", "text",
            "--training.dataset_path", data, "--training.split", "100,0,0", "--training.seq_len", str(args.seq_len),
            "--training.local_batch_size", str(args.batch), "--training.global_batch_size", str(args.batch),
            "--training.steps", str(args.steps + 1), "--training.mixed_precision_param", "float32",
            "--training.max_norm", "1.0", "--optimizer.name", "AdamW", "--optimizer.lr", str(LR),
            "--optimizer.weight_decay", "0", "--optimizer.implementation", "foreach",
            "--lr_scheduler.warmup_steps", "0", "--lr_scheduler.min_lr_factor", "1.0",
            "--checkpoint.no_enable", "--debug.seed", "0", "--metrics.no_enable_tensorboard",
            "--metrics.no_enable_jsonl", "--metrics.log_freq", "1000", "--job.dump_folder", dump]
    if bench == "dpo":
        argv += ["--training.objective", "dpo", "--dpo.beta", "0.1", "--dpo.loss_type", "sigmoid",
                 "--dpo.reference", "model", "--dpo.no_packing"]
    else:
        argv += ["--training.objective", "sft"]
    if bench == "lora":
        argv += ["--model.converters", "lora", "--lora.rank", "8", "--lora.alpha", "16", "--lora.dropout", "0",
                 "--lora.target_modules", ",".join(LORA_TARGETS)]
    clock = Clock()
    trainer = Trainer(plan_job(load_job_config(argv), 1))
    run_step = trainer._run_step

    def timed_step(data):
        # The step's batches loaded before the clock starts (TRL's collator also runs before its step begins).
        batches = [next(data) for _ in range(trainer.batches.microbatches(trainer.step))]
        labels = [b["labels"] != IGNORE_INDEX for b in batches]
        # A pair is two documents with trained tokens (data/preferences.py): count those documents per row.
        pairs = sum(len(set(ids[trained].tolist())) // 2 for b, t in zip(batches, labels)
                    for ids, trained in zip(b["document_ids"], t)) if bench == "dpo" else 0
        clock.batch(int(sum(t.sum() for t in labels)), pairs)
        with clock.step():
            return run_step(iter(batches))

    trainer._run_step = timed_step
    try:
        trainer.train()
    finally:
        trainer.close()
    return clock.figures()


def run_trl(bench: str, args, work: str, dump: str) -> dict:
    import datasets
    import transformers

    clock = Clock()
    folder = os.path.join(work, "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    common = dict(output_dir=dump, use_cpu=True, bf16=False, activation_checkpointing=False, seed=0,
                  max_steps=args.steps + 1, learning_rate=LR, lr_scheduler_type="constant", weight_decay=0.0,
                  max_grad_norm=1.0, optim="adamw_torch", per_device_train_batch_size=args.batch,
                  gradient_accumulation_steps=1, max_length=args.seq_len, report_to=[], logging_steps=1000,
                  save_strategy="no", eval_strategy="no", disable_tqdm=True, dataloader_num_workers=0)

    if bench == "dpo":
        from trl import DPOConfig, DPOTrainer

        config = DPOConfig(**common, beta=0.1, loss_type=["sigmoid"])
        data = datasets.load_dataset("json", data_files=os.path.join(work, "pairs.jsonl"), split="train")
        trainer = DPOTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                             callbacks=[step_callback(clock)])
    else:
        from trl import SFTConfig, SFTTrainer

        peft_config = None
        if bench == "lora":
            from peft import LoraConfig

            peft_config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                     task_type="CAUSAL_LM")
        config = SFTConfig(**common, packing=True, packing_strategy=args.trl_packing_strategy, assistant_only_loss=True)
        data = datasets.load_dataset("json", data_files=os.path.join(work, "conversations.jsonl"), split="train")
        trainer = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer,
                             peft_config=peft_config, callbacks=[step_callback(clock)])
    trainer.remove_callback(transformers.PrinterCallback)  # its summary line of the run
    training_step = trainer.training_step

    def counted(model, inputs, *a, **kw):
        # DPO's batch holds the chosen rows, then the rejected ones (completion_mask: the answers' tokens).
        if bench == "dpo":
            clock.batch(int(inputs["completion_mask"][:, 1:].sum()), inputs["input_ids"].shape[0] // 2)
        else:
            clock.batch(int((inputs["labels"][:, 1:] != -100).sum()), 0)
        return training_step(model, inputs, *a, **kw)

    trainer.training_step = counted
    trainer.train()
    return clock.figures()


def child(args) -> int:
    """One side's benchmarks, in this process: one JSON line of figures each."""
    import logging

    import torch

    torch.set_num_threads(1)
    logging.getLogger("titanlike").setLevel(logging.WARNING)
    if args.side == "trl":
        import transformers

        transformers.logging.set_verbosity_error()
        logging.getLogger("trl").setLevel(logging.ERROR)
    run = run_titanlike if args.side == "titanlike" else run_trl
    for bench in args.bench.split(","):
        figures = run(bench, args, args.work, os.path.join(args.work, f"{args.side}_{bench}_{args.round}"))
        print("RESULT " + json.dumps({"bench": bench, **figures}), flush=True)
    return 0


def spawn(side: str, benches: list[str], args, work: str, r: int) -> dict[str, dict]:
    """Run one side's benchmarks in a fresh process; its figures by benchmark."""
    argv = [sys.executable, os.path.abspath(__file__), "--side", side, "--bench", ",".join(benches), "--work", work,
            "--round", str(r), "--flavor", args.flavor, "--seq-len", str(args.seq_len), "--batch", str(args.batch),
            "--steps", str(args.steps), "--trl-packing-strategy", args.trl_packing_strategy]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(argv, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the {side} process of {','.join(benches)} failed (exit {proc.returncode}):\n"
                           + proc.stdout[-3000:] + proc.stderr[-3000:])
    results = [json.loads(line[len("RESULT "):]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return {result.pop("bench"): result for result in results}


def measure(args, benches: list[str], work: str) -> dict[str, dict[str, list[dict]]]:
    """The model and data written under work, then the rounds: each side's figures by benchmark, a list over rounds."""
    import torch
    import transformers
    import trl

    from titanlike.data.chat_template import LLAMA3_TEMPLATE

    # titanlike's llama3 chat template in the folder: TRL renders with it, and its generation tags give TRL's
    # assistant-only loss the tokens titanlike trains (the debug tokenizer has none, so titanlike uses it too).
    write_model(os.path.join(work, "model"), args.flavor, chat_template=LLAMA3_TEMPLATE)
    write_jsonl(os.path.join(work, "conversations.jsonl"), conversations(args.conversations, seed=0))
    write_jsonl(os.path.join(work, "pairs.jsonl"), preference_pairs(max(64, 4 * args.batch * (args.steps + 1)), 0,
                                                                    args.seq_len))
    print(f"# llama3 {args.flavor}, seq {args.seq_len}, batch {args.batch}, {args.steps} steps after a warm-up, TRL's "
          f"SFT packing {args.trl_packing_strategy}; "
          f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}; CPU time at 1 "
          f"thread; rounds of titanlike then TRL, each side in a fresh process", flush=True)
    groups = [benches] if args.quick else [[b] for b in benches]
    results = {b: {"titanlike": [], "trl": []} for b in benches}
    for r in range(args.rounds):
        for group in groups:
            for side in ("titanlike", "trl"):
                for bench, figures in spawn(side, group, args, work, r).items():
                    results[bench][side].append(figures)
                    print(f"round {r + 1} {bench:4s} {side:9s} trained {figures['trained_tokens_per_s']:8.1f} tok/s  "
                          f"step {figures['step_s']:7.3f} s  {figures['pairs_per_s']:6.2f} pairs/s  "
                          f"{figures['tokens_per_step']:6.0f} trained tokens/step  peak RSS "
                          f"{figures['peak_rss_mib']:.0f} MiB", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8, help="samples (sft, lora) or pairs (dpo) per step")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run, after one warm-up step")
    parser.add_argument("--rounds", type=int, default=2, help="paired rounds: titanlike, then TRL")
    parser.add_argument("--only", choices=BENCHMARKS, help="one benchmark (default: all three)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: debugmodel_tiny, seq 128, batch 2, 2 "
                        "steps, 1 round, one process per side")
    parser.add_argument("--conversations", type=int, default=2000)
    parser.add_argument("--trl-packing-strategy", choices=("bfd", "wrapped"), default="bfd",
                        help="TRL's SFT packing: bfd (its default; padding-free, a batch flattened into one row), or "
                        "wrapped (rows of seq_len tokens cut from the stream, attending across conversations)")
    # One side's run in a process of its own (the parent starts these).
    parser.add_argument("--side", choices=("titanlike", "trl"), help=argparse.SUPPRESS)
    parser.add_argument("--bench", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side is not None:
        return child(args)
    if args.quick:
        args.flavor, args.seq_len, args.batch, args.steps, args.rounds = "debugmodel_tiny", 128, 2, 2, 1
        args.conversations = 200
    for name in ("seq_len", "batch", "steps", "rounds"):
        least = 64 if name == "seq_len" else 1
        if getattr(args, name) < least:
            parser.error(f"--{name.replace('_', '-')} {getattr(args, name)} is too small: it must be at least {least}")

    benches = [args.only] if args.only else list(BENCHMARKS)
    with tempfile.TemporaryDirectory(prefix="bench_trl_") as work:
        results = measure(args, benches, work)
    print(f"medians over {args.rounds} round(s) (the ratio: of each round's titanlike / TRL); CPU time, not wall time")
    print(f"{'benchmark':10s} {'figure':18s} {'titanlike':>10s} {'TRL':>10s} {'ratio':>7s}  peak RSS MiB "
          "(titanlike, TRL)")
    for bench in benches:
        ours, theirs = results[bench]["titanlike"], results[bench]["trl"]
        figures = [("pairs_per_s", "pairs/s"), ("step_s", "step_s")] if bench == "dpo" else \
            [("trained_tokens_per_s", "trained_tokens/s")]
        for key, label in figures:
            mine, trls = statistics.median(o[key] for o in ours), statistics.median(t[key] for t in theirs)
            ratio = statistics.median(o[key] / t[key] for o, t in zip(ours, theirs))
            rss = max(o["peak_rss_mib"] for o in ours), max(t["peak_rss_mib"] for t in theirs)
            print(f"{bench:10s} {label:18s} {mine:10.3f} {trls:10.3f} {ratio:6.2f}x  {rss[0]:.0f}, {rss[1]:.0f}")
    print("ratio: titanlike / TRL (tokens/s and pairs/s: > 1, titanlike faster; step_s: < 1, titanlike faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
