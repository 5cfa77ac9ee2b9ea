"""Batch-size ramp-up (training.rampup_batch_size, Megatron's --rampup-batch-size): the schedule
(titanlike/data/batch_schedule.py) against Megatron's per-step rule, the loader's samples per step
and rank, resume mid-ramp, the learning rate counted in samples, and the config rules. Through
train.py (1 and 2 ranks, resume mid-ramp): tests/distributed/test_precision_memory.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from titanlike.config import ConfigError, load_job_config
from titanlike.data.batch_schedule import BatchSchedule
from titanlike.data.loader import build_dataloader_from_source


def megatron_batches(global_batch: int, start: int, increment: int, ramp_samples: int, steps: int) -> list[int]:
    """Megatron's RampupBatchsizeNumMicroBatchesCalculator.update, called before every step with the
    samples consumed so far (its floating-point division, on values where it is exact)."""
    per_increment = ramp_samples / ((global_batch - start) // increment)
    consumed, out = 0, []
    for _ in range(steps):
        if consumed > ramp_samples:
            batch = global_batch
        else:
            batch = start + int(consumed / per_increment) * increment
        out.append(batch)
        consumed += batch
    return out


@pytest.mark.parametrize("global_batch, rampup, steps", [
    (12, (4, 4, 24), 12),
    (64, (8, 8, 200), 40),     # several increments, some reached mid-step
    (64, (16, 16, 30), 10),    # increments shorter than a step: the batch jumps past some
    (1536, (32, 32, 1_953_120), 3000),  # GPT-3's ramp (32 -> 1536 over ~4B tokens at 2048 / sample)
])
def test_schedule_is_megatrons_step_by_step(global_batch, rampup, steps):
    schedule = BatchSchedule(global_batch, list(rampup))
    expected = megatron_batches(global_batch, *rampup, steps)
    assert [schedule.batch_size(k) for k in range(steps)] == expected
    consumed = np.concatenate([[0], np.cumsum(expected)])
    assert [schedule.samples_before(k) for k in range(steps + 1)] == consumed.tolist()
    # Every sample maps back to the step that consumes it.
    for k in range(steps):
        for sample in (consumed[k], consumed[k + 1] - 1):
            assert schedule.step_of_sample(int(sample)) == k


def test_ramp_ends_at_the_global_batch_and_stays():
    schedule = BatchSchedule(1536, [32, 32, 1_953_120])
    end = schedule.ramp_steps
    assert schedule.batch_size(end - 1) < 1536 == schedule.batch_size(end) == schedule.batch_size(10**7)
    assert schedule.samples_before(10**7) == schedule.samples_before(end) + (10**7 - end) * 1536
    # The ramp is kept as one segment per increment, not one entry per step.
    assert len(schedule._segments) <= (1536 - 32) // 32 + 1


def test_constant_schedule():
    schedule = BatchSchedule(8)
    assert not schedule.ramps and schedule.batch_size(5) == 8 and schedule.samples_before(5) == 40
    assert schedule.step_of_sample(39) == 4


# The loader: the samples of each step, whatever the layout ------------------------------------


class Windows:
    """Map-style source: global sample i is the window [i, i+1, ..., i+seq]."""

    def __init__(self, n: int, seq: int):
        self.n, self.seq = n, seq

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.arange(i, i + self.seq + 1)


RAMP = [4, 4, 24]  # global 12: batches 4, 4, 4, 8, 8, 12, 12, ...
SEQ = 3


def _loaders(local: int, dp: int, rampup=RAMP, global_batch: int = 12):
    return [build_dataloader_from_source(Windows(10_000, SEQ), seq_len=SEQ, local_batch_size=local,
                                         global_batch_size=global_batch, dp_rank=r, dp_degree=dp, rampup=rampup)
            for r in range(dp)]


def _step_samples(iters, schedule: BatchSchedule, step: int, local: int, dp: int) -> list[int]:
    """The first token of every sample all ranks get at `step` (= the global sample index)."""
    n = schedule.batch_size(step) // (local * dp)
    samples = []
    for it in iters:
        samples += [int(x) for _ in range(n) for x in next(it)["inputs"][:, 0]]
    return samples


@pytest.mark.parametrize("local, dp", [(4, 1), (2, 1), (2, 2), (1, 4)])
def test_every_step_reads_its_batch_of_consecutive_samples_on_any_layout(local, dp):
    schedule = BatchSchedule(12, RAMP)
    iters = [iter(loader) for loader in _loaders(local, dp)]
    for step in range(8):
        start = schedule.samples_before(step)
        assert _step_samples(iters, schedule, step, local, dp) == list(range(start, start + schedule.batch_size(step)))


def test_resume_mid_ramp_same_and_other_layout():
    schedule = BatchSchedule(12, RAMP)
    loaders = _loaders(2, 2)
    iters = [iter(loader) for loader in loaders]
    for step in range(4):  # stop after step 4 of 8 (batch 8, mid-ramp)
        _step_samples(iters, schedule, step, 2, 2)
    states = [loader.state_dict() for loader in loaders]
    straight = [_step_samples(iters, schedule, step, 2, 2) for step in range(4, 8)]

    resumed = _loaders(2, 2)
    for loader, state in zip(resumed, states):
        loader.load_state_dict(state)
    iters = [iter(loader) for loader in resumed]
    assert [_step_samples(iters, schedule, step, 2, 2) for step in range(4, 8)] == straight

    # Another layout (one rank, local batch 4) at that step boundary: rank 0's position carries over.
    (single,) = _loaders(4, 1)
    single.load_state_dict(states[0])
    it = iter(single)
    assert [_step_samples([it], schedule, step, 4, 1) for step in range(4, 8)] == straight


def test_resume_with_another_ramp_is_refused():
    (loader,) = _loaders(4, 1)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    (other,) = _loaders(4, 1, rampup=[4, 8, 24])
    with pytest.raises(ValueError, match="saved with training.rampup_batch_size 4,4,24 but this run's is 4,8,24"):
        other.load_state_dict(state)  # refused as it is loaded, not at the next iter()


# The learning rate counts samples under a ramp-up ----------------------------------------------


def test_learning_rate_counts_samples_during_the_ramp():
    from titanlike.config.schema import LRScheduler
    from titanlike.train.optimizer import build_lr_scheduler, lr_factor

    cfg = LRScheduler(warmup_steps=2, decay_type="linear", min_lr_factor=0.1)
    schedule = BatchSchedule(12, RAMP)
    steps = 10

    def lrs(batches):
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        sched = build_lr_scheduler(opt, cfg, steps, batches)
        out = []
        for _ in range(steps):
            out.append(sched.get_last_lr()[0])
            opt.step()
            sched.step()
        return out

    ramped = lrs(schedule)
    total = schedule.samples_before(steps) / 12
    shape = dict(warmup_steps=2, decay_ratio=None, decay_type="linear", min_lr_factor=0.1)
    assert ramped == [lr_factor(schedule.samples_before(k) / 12, total_steps=total, **shape) for k in range(steps)]
    assert ramped[1] < lr_factor(1, total_steps=steps, **shape)  # a 4-sample step advances a third of a step
    # Without a ramp the schedule is the step-counting one, unchanged.
    assert lrs(BatchSchedule(12)) == lrs(None) == [lr_factor(k, total_steps=steps, **shape) for k in range(steps)]


# Config rules ----------------------------------------------------------------------------------


@pytest.mark.parametrize("args, world, fragment", [
    (["--training.rampup_batch_size", "4,4"], 1,
     "training.rampup_batch_size must be three positive integers start,increment,samples"),
    (["--training.rampup_batch_size", "4,0,24"], 1, "three positive integers"),
    (["--training.rampup_batch_size", "2,4,24"], 2,
     "training.rampup_batch_size start 2 and increment 4 must be multiples of local_batch_size x data-parallel "
     "degree (4)"),
    (["--training.rampup_batch_size", "12,4,24"], 1, "start 12 must be below global_batch_size 12"),
    (["--training.rampup_batch_size", "4,8,24", "--training.global_batch_size", "16"], 1,
     "increment 8 must divide their difference"),
])
def test_bad_ramp_is_one_sentence(args, world, fragment):
    from titanlike.train.plan import plan_job

    cfg = load_job_config(["--training.local_batch_size", "2", "--training.global_batch_size", "12", *args])
    with pytest.raises(ConfigError) as e:
        plan_job(cfg, world_size=world)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_tokens_per_second_count_each_steps_own_batch(monkeypatch):
    import time

    from titanlike.observe.metrics import MetricsLogger

    clock = iter([0.0, 2.0, 3.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    metrics = MetricsLogger(device=torch.device("cpu"), flops_per_token=1.0, tokens_per_step_per_device=1200.0,
                            log_freq=2, is_writer=False)
    metrics.step_done(400.0)  # a ramp-up step of a third of the full batch
    metrics.step_done(800.0)
    assert metrics.log(2, loss=1.0, grad_norm=1.0, lr=1.0)["tps"] == 600.0  # 1200 tokens in 2 s
    metrics.step_done()  # a full step
    assert metrics.log(3, loss=1.0, grad_norm=1.0, lr=1.0)["tps"] == 1200.0
