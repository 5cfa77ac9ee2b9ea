"""scripts/bench_rl.py, the GRPO benchmark against TRL, so that its GPU run (issue 48) needs no debugging there.

- Its GPU path as a program on CPU (--dtype bfloat16 --quick --trl-side generate: the bf16 job, the mismatch
  read from the job's logged metrics, TRL's rollout alone): the table's figures are finite and positive. About
  6 s of CPU (the tiny model, one round of a warm-up and one timed step per side).
- What only a GPU runs of it, its meter (a synchronized wall clock, the peak memory reset before each side),
  against torch.cuda's functions stood in for: each one it calls exists and is called when meant.
- The stand-in for TRL where trl is absent generates as a real GRPOTrainer does: the same GenerationConfig
  (every field), the same model generation config, the same left-padded ids and mask of the same prompt rows,
  and in bf16 the same forward (accelerate's autocast and fp32 outputs).
  About 6 s of CPU (trl's import and a trainer's construction).
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def bench_rl():
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import bench_rl
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return bench_rl


def test_the_gpu_path_runs_on_cpu_and_prints_finite_figures():
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "bench_rl.py"), "--device", DEVICE, "--dtype",
                           "bfloat16", "--quick", "--trl-side", "generate"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    medians = {line.split()[1]: line for line in proc.stdout.splitlines() if line.startswith("median ")
               and "rounds," not in line}
    ours = medians["compiled" if DEVICE == "cuda" else "titanlike"]
    figures = [float(re.search(pattern, ours).group(1)) for pattern in
               (r"rollout\s+(\S+) tok/s", r"step\s+(\S+) s", r"generating\s+(\S+)%", r"mismatch\s+(\S+)")]
    theirs = medians["trl-gen"]
    figures.append(float(re.search(r"rollout\s+(\S+) tok/s", theirs).group(1)))
    ratio = re.search(r"rollout tokens/s (\S+)x TRL's, whole step n/a", proc.stdout)
    assert ratio, proc.stdout
    figures.append(float(ratio.group(1)))
    assert all(math.isfinite(f) and f > 0 for f in figures), proc.stdout
    assert re.search(r"step\s+n/a s", theirs), theirs  # TRL's rollout alone has no step


def test_the_gpu_meter_calls_cuda_when_meant(bench_rl, monkeypatch):
    calls = []
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a, name=name: calls.append(name))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    meter = bench_rl.Meter("cuda")
    begin = meter.now()
    meter.fresh()
    assert meter.now() >= begin
    assert calls == ["synchronize", "empty_cache", "reset_peak_memory_stats", "synchronize"]
    assert meter.peak_gib() == 3.0 and meter.describe() == "a GPU, wall time"
    cpu = bench_rl.Meter("cpu")
    cpu.now()
    cpu.fresh()
    assert cpu.peak_gib() is None and calls[4:] == []


def test_the_stand_in_generates_as_grpo_trainer(bench_rl, tmp_path, monkeypatch):
    pytest.importorskip("trl")
    args = bench_rl.parse_args(["--quick", "--device", DEVICE, "--dtype", "bfloat16", "--trl-side", "trainer"])
    folder, prompts = str(tmp_path / "model"), str(tmp_path / "prompts.jsonl")
    bench_rl.write_model(folder, args.flavor, device=DEVICE, dtype=args.dtype)
    bench_rl.write_prompts(prompts, 20)
    trainer = bench_rl.trl_trainer(args, folder, prompts, str(tmp_path / "trl"))

    # The stand-in's own run, its model's generate calls recorded.
    calls, models = [], []
    load = bench_rl.load_trl_model

    def recorded(*a):
        model, tokenizer = load(*a)
        generate = model.generate
        model.generate = lambda **kw: calls.append(kw) or generate(**kw)
        models.append(model)
        return model, tokenizer

    monkeypatch.setattr(bench_rl, "load_trl_model", recorded)
    figures = bench_rl.run_generate(args, folder, prompts, str(tmp_path / "stand_in"))
    assert len(calls) == args.steps + 1 and figures["rollout_tokens_per_s"] > 0
    assert calls[0]["generation_config"].to_dict() == trainer.generation_config.to_dict()
    assert models[0].generation_config.to_dict() == trainer.model.generation_config.to_dict()  # its pad id
    assert models[0].config.pad_token_id == trainer.model.config.pad_token_id
    assert models[0].dtype == trainer.model.dtype == torch.bfloat16

    # TRL's inputs for the stand-in's first batch of prompt rows, from its own tokenizing and padding; a longer
    # prompt added so that the left padding shows.
    texts = [*bench_rl.rollout_prompts(args, prompts)[0], "add: 10 + 23 = 33, and then"]
    seen = {}

    def captured(**kw):
        seen.update(kw)
        return torch.cat([kw["input_ids"], kw["input_ids"][:, :1]], dim=1)

    trainer.model.generate = captured
    trainer._generate_single_turn(*trainer._tokenize_prompts(texts), args.generations)
    assert seen["generation_config"] is trainer.generation_config
    tokenizer = bench_rl.load_trl_model(args, folder)[1]
    mine = bench_rl.trl_inputs(tokenizer, texts)
    assert set(seen) == {"input_ids", "attention_mask", "generation_config"}
    for name in ("input_ids", "attention_mask"):
        assert torch.equal(seen[name].cpu(), mine[name]), name
    assert mine["attention_mask"][0, 0] == 0  # left-padded: the shorter prompts start with padding
    first = bench_rl.trl_inputs(tokenizer, texts[:-1])
    assert torch.equal(calls[0]["input_ids"].cpu(), first["input_ids"])
    assert torch.equal(calls[0]["attention_mask"].cpu(), first["attention_mask"])

    # bf16: the stand-in's forward is the one accelerate's prepare gives TRL's model (bf16 autocast, outputs fp32).
    prepared = trainer.accelerator.prepare_model(trainer.model)
    batch = {name: value.to(DEVICE) for name, value in bench_rl.trl_inputs(tokenizer, texts).items()}
    with torch.no_grad():
        theirs, mine = prepared(**batch).logits, models[0](**batch).logits
    assert theirs.dtype == mine.dtype == torch.float32 and torch.equal(theirs, mine)
