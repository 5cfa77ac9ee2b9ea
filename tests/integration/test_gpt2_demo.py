"""The gpt2 CPU demo preset trains: `python train.py --job.config_file train_configs/gpt2_debug.toml
--training.steps 20` runs in one process and the loss falls. It runs in the test process
(conftest.train_here): nothing here is about the process itself."""

from conftest import REPO, read_metrics, train_here


def test_gpt2_debug_preset_trains(tmp_path):
    dump = tmp_path / "demo"
    run = train_here(["--job.config_file", str(REPO / "train_configs" / "gpt2_debug.toml"), "--training.steps", "20",
                      "--job.dump_folder", str(dump), "--metrics.enable_jsonl"])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "model gpt2 debugmodel" in run.stderr
    losses = [r["loss"] for r in read_metrics(dump)]
    assert len(losses) == 20
    # Measured: 7.67 -> 5.92. Uniform over the 2048-token vocabulary would be ln 2048 = 7.62.
    assert losses[-1] < losses[0] - 1.0, losses
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.8, losses
