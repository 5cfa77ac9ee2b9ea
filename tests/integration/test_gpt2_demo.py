"""The gpt2 CPU demo preset trains: `python train.py --job.config_file train_configs/gpt2_debug.toml
--training.steps 20` runs in one process and the loss falls."""

from conftest import REPO, launch, read_metrics


def test_gpt2_debug_preset_trains(tmp_path):
    dump = tmp_path / "demo"
    proc = launch(["--job.config_file", str(REPO / "train_configs" / "gpt2_debug.toml"), "--training.steps", "20",
                   "--job.dump_folder", str(dump), "--metrics.enable_jsonl"])
    assert "model gpt2 debugmodel" in proc.stdout + proc.stderr
    losses = [r["loss"] for r in read_metrics(dump)]
    assert len(losses) == 20
    # Measured: 7.67 -> 5.92. Uniform over the 2048-token vocabulary would be ln 2048 = 7.62.
    assert losses[-1] < losses[0] - 1.0, losses
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.8, losses
