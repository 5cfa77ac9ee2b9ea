#!/usr/bin/env python
"""Benchmark of supervised fine-tuning: packed against padded samples (to seq_len, or to the longest
of each microbatch), LoRA and DoRA against full fine-tuning.

    python scripts/bench_sft.py [--flavor debugmodel] [--seq-len 512] [--steps 6] [--conversations 2000]

Generates conversations with a skewed (log-normal) answer length, then runs the trainer's own step
(titanlike.train.Trainer, one process, fp32) on them for each configuration and prints, after one
warm-up step: samples per step, the share of positions holding a conversation, trained (assistant)
tokens/s, conversations/s, step time, trainable parameters and optimizer state, and the process's
peak RSS (CPU) or the peak CUDA memory. All configurations train the same conversations; packing
changes how many fit in a step, LoRA what is trained.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

WORDS = ("the", "king", "river", "stone", "light", "spoke", "unto", "them", "and", "water", "land", "day")


def conversations(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))
        # Log-normal answer lengths: most short, a few long (median ~20 words, 1% over ~200).
        answer = " ".join(rng.choice(WORDS) for _ in range(max(1, int(rng.lognormvariate(3.0, 1.0)))))
        rows.append({"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]})
    return rows


def run(name: str, argv: list[str], steps: int) -> dict:
    import resource

    import torch

    from titanlike.config import load_job_config
    from titanlike.models.outputs import IGNORE_INDEX
    from titanlike.train.plan import plan_job
    from titanlike.train.trainer import Trainer

    trainer = Trainer(plan_job(load_job_config(argv), 1))
    try:
        data = iter(trainer.dataloader)
        cuda = trainer.device.type == "cuda"
        times, trained, conversations_seen, filled, positions = [], 0, 0, 0, 0
        for step in range(steps + 1):
            batch = next(data)
            mb = trainer.prepare(batch)
            if cuda:
                torch.cuda.synchronize()
            begin = time.perf_counter()
            out = trainer.train_step([mb])
            out.loss_sum.item()  # waits for the step
            if step == 0:  # warm-up
                continue
            times.append(time.perf_counter() - begin)
            trained += int((batch["labels"] != IGNORE_INDEX).sum())
            # A sample's last document is padding when none of its targets is trained (every
            # conversation has an assistant turn). Positions: those the step computed (sft.padding
            # longest cuts the microbatch after its last trained position).
            cut = mb.inputs.shape[1]
            for ids, labels in zip(batch["document_ids"], batch["labels"]):
                last = ids == ids[-1]
                pad = int(last[:cut].sum()) if bool((labels[last] == IGNORE_INDEX).all()) else 0
                conversations_seen += len(set(ids.tolist())) - (1 if pad else 0)
                filled += cut - pad
                positions += cut
        seconds = sum(times)
        trainable = sum(p.numel() for p in trainer.model_parts[0].parameters() if p.requires_grad)
        state = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values() for t in s.values()
                    if torch.is_tensor(t))
        peak = (torch.cuda.max_memory_allocated() / 2**20 if cuda
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        return {"config": name, "step_s": seconds / len(times), "trained_tokens_per_s": trained / seconds,
                "conversations_per_s": conversations_seen / seconds, "filled": filled / positions,
                "trainable_params": trainable, "optimizer_state_mib": state / 2**20,
                "peak_mib": peak, "peak_kind": "cuda" if cuda else "max RSS (process so far)"}
    finally:
        trainer.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flavor", default="debugmodel")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--conversations", type=int, default=2000)
    args = parser.parse_args()
    folder = tempfile.mkdtemp(prefix="bench_sft_")
    path = os.path.join(folder, "conversations.jsonl")
    with open(path, "w") as f:
        for row in conversations(args.conversations, seed=0):
            f.write(json.dumps(row) + "\n")
    base = ["--model.flavor", args.flavor, "--training.objective", "sft", "--training.dataset", "text",
            "--training.dataset_path", path, "--training.seq_len", str(args.seq_len), "--training.local_batch_size",
            str(args.batch), "--training.steps", str(args.steps + 1), "--training.mixed_precision_param", "float32",
            "--metrics.no_enable_tensorboard", "--metrics.no_enable_jsonl", "--checkpoint.no_enable",
            "--optimizer.implementation", "foreach", "--training.split", "100,0,0"]
    configs = {
        "full, packed": [],
        "full, padded to seq_len": ["--sft.no_packing"],
        "full, padded to the longest": ["--sft.no_packing", "--sft.padding", "longest"],
        "LoRA r=8 (q,k,v,o), packed": ["--model.converters", "lora"],
        "DoRA r=8 (q,k,v,o), packed": ["--model.converters", "lora", "--lora.use_dora"],
    }
    results = []
    for name, extra in configs.items():
        dump = os.path.join(folder, name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", ""))
        results.append(run(name, [*base, *extra, "--job.dump_folder", dump], args.steps))
        r = results[-1]
        print(f"{r['config']:30s} step {r['step_s'] * 1000:8.1f} ms  trained tok/s {r['trained_tokens_per_s']:9.0f}  "
              f"conv/s {r['conversations_per_s']:7.1f}  filled {r['filled']:.0%}  trainable {r['trainable_params']:,}  "
              f"optimizer state {r['optimizer_state_mib']:.1f} MiB  peak {r['peak_mib']:.0f} MiB ({r['peak_kind']})",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
