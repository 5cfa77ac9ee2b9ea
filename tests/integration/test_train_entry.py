"""train.py end to end: TensorBoard events readable by TensorBoard, clear errors, no hangs."""

import math

import pytest
import torch

from conftest import TINY_JOB, launch, train_in_process


def test_tensorboard_events_have_loss_tag(tmp_path):
    train_in_process([*TINY_JOB, "--training.steps", "3", "--training.local_batch_size", "2",
                      "--metrics.enable_tensorboard", "--job.dump_folder", str(tmp_path)])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # torchtitan's layout: one timestamped folder per launch (beside the job's folder lock, observe/run_lock.py)
    (run,) = [p for p in (tmp_path / "tb").iterdir() if p.is_dir()]
    acc = EventAccumulator(str(run))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("loss", "grad_norm", "lr", "tps", "max_rss"):
        assert tag in tags
    losses = acc.Scalars("loss")
    assert [e.step for e in losses] == [1, 2, 3]
    assert all(math.isfinite(e.value) and e.value > 0 for e in losses)


def _main_in_process(argv: list[str], capsys) -> tuple[int, str, str]:
    """train.py's main in this process (train.py is `sys.exit(main())`): no interpreter to start."""
    import train

    try:
        rc = train.main(argv)
    except SystemExit as e:  # argparse's --help
        rc = e.code or 0
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_help_lists_options(capsys):
    rc, out, _ = _main_in_process(["--help"], capsys)
    assert rc == 0 and "--parallelism.data_parallel_shard_degree" in out


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--training.stepz", "3"], "unknown config key 'training.stepz'; did you mean 'training.steps'?"),
        (["--parallelism.tensor_parallel_degree", "3"], "the world size 1 is not divisible by"),
    ],
)
def test_bad_config_is_one_sentence_without_traceback(argv, fragment, capsys):
    rc, _, err = _main_in_process(argv, capsys)
    assert rc == 2
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"config error: {lines[0].removeprefix('config error: ')}"]
    assert fragment in lines[0]


@pytest.mark.distributed
def test_bad_layout_under_torchrun_fails_fast(tmp_path):
    # 2 ranks cannot be split as 3 shards: every rank exits before any process group exists.
    proc = launch(["--parallelism.data_parallel_shard_degree", "3"], nproc=2, check=False, timeout=120)
    assert proc.returncode != 0
    assert "config error: parallel degrees replicate 1 x shard 3" in proc.stderr
    assert "must equal the world size 2" in proc.stderr


def test_non_finite_loss_stops_training(tmp_path, monkeypatch):
    from titanlike.config import load_job_config
    from titanlike.train.plan import plan_job
    from titanlike.train.trainer import Trainer, TrainingError

    cfg = load_job_config([*TINY_JOB, "--training.local_batch_size", "2", "--job.dump_folder", str(tmp_path)])
    trainer = Trainer(plan_job(cfg, 1))
    run_step = trainer._run_step
    output_weight = dict(trainer.model_parts[0].named_parameters())["output.weight"]

    def nan_logits_at_step_2(data):
        if trainer.step == 2:
            with torch.no_grad():
                output_weight.fill_(float("nan"))  # every logit, so the loss, is nan
        return run_step(data)

    monkeypatch.setattr(trainer, "_run_step", nan_logits_at_step_2)
    with pytest.raises(TrainingError, match="the loss is nan at step 2; stopped before the optimizer step"):
        trainer.train()
    trainer.close()
