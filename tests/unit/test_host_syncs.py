"""The training step never waits for the device on a step that does not log: no .item(), .tolist(),
.cpu(), bool/int/float of a tensor from the start of such a step to the start of the next one.

On CPU nothing is asynchronous, so the test counts the calls that would synchronize a GPU instead of
timing anything. The one host read the loop makes on every step, the previous step's flags (finite,
stop signals), goes through a pinned copy and an event on CUDA and is read as host memory
(numpy), which waits for that past step only: it is not one of the counted calls.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import TINY_JOB

SYNCS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__")


@contextlib.contextmanager
def counting_syncs(counter: dict):
    originals = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def wrap(name):
        original = originals[name]

        def counted(self, *args, **kwargs):
            if counter["on"]:
                counter["calls"].append(name)
            return original(self, *args, **kwargs)

        return counted

    for name in SYNCS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def syncs_per_step(tmp_path, *extra: str) -> tuple[dict[int, list[str]], set[int]]:
    """Run 8 steps logging every 4th; returns the counted calls of each step (from its start to the
    next step's start) and the steps the host reads at once."""
    from titanlike.config import load_job_config
    from titanlike.train.trainer import Trainer
    from titanlike.train.plan import plan_job

    cfg = load_job_config([*TINY_JOB, "--model.flavor", "debugmodel_tiny", "--training.steps", "8",
                           "--metrics.log_freq", "4", "--training.local_batch_size", "2",
                           "--job.dump_folder", str(tmp_path), *extra])
    trainer = Trainer(plan_job(cfg, 1))
    counter = {"on": False, "calls": []}
    per_step: dict[int, list[str]] = {}
    run_step = trainer._run_step

    def observed(data):
        if trainer.step > 1:
            per_step[trainer.step - 1] = counter["calls"]
        counter["calls"] = []
        counter["on"] = True
        return run_step(data)

    trainer._run_step = observed
    try:
        with counting_syncs(counter):
            trainer.train()
        counter["on"] = False
        per_step[trainer.step] = counter["calls"]
    finally:
        trainer.close()
    return per_step, {s for s in per_step if trainer._reads_at(s)}


def test_no_host_sync_on_steps_that_do_not_log(tmp_path):
    per_step, read = syncs_per_step(tmp_path)
    assert read == {1, 4, 8}
    quiet = {s: calls for s, calls in per_step.items() if s not in read}
    assert sorted(quiet) == [2, 3, 5, 6, 7]
    assert all(not calls for calls in quiet.values()), quiet
    # The counter sees reads at all: a log step reads its values.
    assert per_step[4]


@pytest.mark.parametrize("option", ["--training.skip_nonfinite_steps=1"])
def test_host_syncs_stay_off_with_options_that_change_the_step(tmp_path, option):
    per_step, read = syncs_per_step(tmp_path, option)
    assert all(not per_step[s] for s in per_step if s not in read), per_step
