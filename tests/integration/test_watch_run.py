"""Watching a run through train.py (one process, CPU): profiler traces, memory snapshots, the
progress line, the end-of-run summary, metrics.jsonl on by default and plotted, a W&B offline run
read back with wandb's own reader (greedy samples as a table too), and no DCP "torch.distributed is disabled" warning per save.

One launch carries every check: W&B alone costs several seconds to start."""

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from conftest import REPO, TINY_JOB, _env

STEPS = 4


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    dump = tmp_path_factory.mktemp("watched")
    # TINY_JOB without its --metrics.enable_jsonl: the JSONL must be on by default.
    job = [a for a in TINY_JOB if a != "--metrics.enable_jsonl"]
    args = [*job, "--training.steps", str(STEPS), "--training.local_batch_size", "2", "--job.dump_folder", str(dump),
            "--metrics.enable_tensorboard", "--profiling.enable_profiling", "--profiling.enable_memory_snapshot",
            "--profiling.profile_freq", "2", "--checkpoint.enable", "--checkpoint.interval", "2",
            "--validation.enable", "--validation.freq", "2", "--validation.steps", "1",
            "--metrics.enable_wandb", "--metrics.wandb_mode", "offline",
            "--validation.sample_prompts", "In the beginning", "--validation.sample_max_tokens", "4"]
    env = _env()
    env.pop("WANDB_DIR", None)
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return dump, proc.stdout + proc.stderr


def test_profiler_traces_and_cpu_memory_snapshots(run):
    dump, log = run
    for step in (2, 4):
        trace = json.loads((dump / "profile_traces" / f"iteration_{step}" / "rank0_trace.json").read_text())
        assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
        memory = json.loads((dump / "memory_snapshot" / f"iteration_{step}" / "rank0_memory.json").read_text())
        params = int(re.search(r"debugmodel: ([\d,]+) parameters", log).group(1).replace(",", ""))
        assert memory["step"] == step and memory["parameters_bytes"] == 4 * params  # fp32
        # AdamW: two fp32 moments per parameter (and a scalar step per tensor).
        assert 2 * 4 * params <= memory["optimizer_states_bytes"] < 2 * 4 * params + 4096
        assert memory["peak_rss_gib"] > 0


def test_progress_lines_summary_and_no_single_process_dcp_warning(run):
    dump, log = run
    assert "torch.distributed is disabled" not in log  # two single-process checkpoint saves
    for step in range(1, STEPS + 1):
        assert re.search(rf"step: +{step}/{STEPS} .* max_rss: [\d.]+GiB  eta: \d+:\d\d:\d\d", log), log[-3000:]
    summary = log[log.index("run summary:"):]
    assert re.match(rf"run summary: {STEPS} step\(s\) \(1 -> {STEPS}\) in \d+:\d\d:\d\d; final loss \d+\.\d{{4}}",
                    summary)
    final = [r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines()) if "validation_loss" in r][-1]
    assert final["step"] == STEPS and f"validation loss: final {final['validation_loss']:.4f} (step {STEPS})" in summary
    # The last save holds the model only (torchtitan's checkpoint.last_save_model_only, on by default).
    assert f"checkpoints:     {dump / 'checkpoint'} (latest: step-{STEPS}, the model only; sample: " \
        f"python scripts/generate.py {dump / 'checkpoint'})" in summary
    assert f"tensorboard --logdir {dump / 'tb'}" in summary
    assert f"python scripts/plot_metrics.py {dump / 'metrics.jsonl'}" in summary
    assert f"profiler traces: {dump / 'profile_traces'}" in summary
    assert f"memory snapshots: {dump / 'memory_snapshot'}" in summary
    assert f"wandb:           {dump / 'wandb'}/offline-run-" in summary


def test_metrics_jsonl_is_on_by_default_and_plots(run):
    dump, _ = run
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, STEPS + 1))
    assert [r["step"] for r in records if "validation_loss" in r] == [2, 4]
    spec = importlib.util.spec_from_file_location("plot_metrics", REPO / "scripts" / "plot_metrics.py")
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    assert plot.main([str(dump / "metrics.jsonl")]) == 0
    assert (dump / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_wandb_offline_run_holds_the_metrics_and_the_config(run):
    dump, _ = run
    runs = list((dump / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    # wandb's own reader of the run's transaction log (run-<id>.wandb), one JSON record per line.
    proc = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(runs[0])],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    config = next(r["run"]["config"]["update"] for r in records if r["type"] == "run")
    assert config["metrics"]["enable_wandb"] is True and config["training"]["steps"] == STEPS
    history = {r["history"]["step"]["num"]: r["history"]["item"] for r in records if r["type"] == "history"}
    ours = {r["step"]: r for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines()) if "loss" in r}
    assert sorted(history) == list(range(1, STEPS + 1))
    for step, item in history.items():
        assert item["loss"] == pytest.approx(ours[step]["loss"]) and item["lr"] == pytest.approx(ours[step]["lr"])
    assert "validation/loss" in history[2] and "validation/loss" in history[4]
    # Greedy samples (validation.sample_prompts): a table of (step, prompt, text) at every validation.
    samples = {r["step"]: r["samples"][0] for r in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())
               if "samples" in r}
    assert sorted(samples) == [2, 4] and samples[4]["prompt"] == "In the beginning"
    for step in (2, 4):  # wandb flattens the table's reference into samples.* keys; the rows are a file of the run
        assert history[step]["samples._type"] == "table-file"
        table = json.loads((runs[0] / "files" / history[step]["samples.path"]).read_text())
        assert table == {"columns": ["step", "prompt", "text"], "data": [[step, *samples[step].values()]]}
