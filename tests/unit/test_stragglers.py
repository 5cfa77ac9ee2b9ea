"""The straggler report ([metrics] straggler_factor): which ranks' data or optimizer time is above
the factor x the median over ranks. A slowed rank in a real 2-rank run: tests/distributed/test_hangs.py."""

import time

import pytest
import torch

from titanlike.observe.stragglers import StragglerDetector, format_stragglers, slow_ranks


@pytest.mark.parametrize("times, factor, min_excess, slow", [
    ([1.0, 1.1, 0.9, 3.0], 1.5, 0.0, [3]),  # median 1.05: only rank 3 is above 1.575
    ([1.0, 1.0, 1.0, 1.0], 1.5, 0.0, []),
    ([1.0, 2.0, 1.0, 1.0, 1.6], 1.5, 0.0, [1, 4]),
    ([0.001, 0.001, 0.004], 1.5, 0.01, []),  # 4x slower, but by 3 ms: below the floor
    ([0.0, 0.0, 0.02], 1.5, 0.01, [2]),  # a median of 0 still names a rank above the floor
    ([], 1.5, 0.0, []),
])
def test_slow_ranks(times, factor, min_excess, slow):
    assert slow_ranks(times, factor, min_excess) == slow


def test_one_process_times_its_data_and_optimizer_steps():
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    detector = StragglerDetector(factor=1.5, device=torch.device("cpu"))
    detector.watch(optimizer)

    def slow_batches():
        for _ in range(3):
            time.sleep(0.05)
            yield torch.randn(2, 8)

    for step, batch in enumerate(detector.timed(slow_batches()), start=1):
        model(batch).sum().backward()
        optimizer.step()
    # One rank is its own median: nobody is slow, and the phases were timed (read before report resets them).
    assert detector._host["data"] >= 0.15 and detector._host["optimizer"] > 0
    assert detector.report(3) == []
    assert detector._host == {"data": 0.0, "optimizer": 0.0}


def test_disabled_detector_times_nothing():
    detector = StragglerDetector(factor=0, device=torch.device("cpu"))
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    detector.watch(optimizer)
    assert not optimizer._optimizer_step_pre_hooks
    assert list(detector.timed(iter([1, 2]))) == [1, 2] and detector.report(2) == []


def test_report_line_names_rank_phase_and_ratio():
    line = format_stragglers(20, [(3, "optimizer", 0.041, 0.0122), (5, "data", 0.3, 0.0)], 1.5)
    assert line == ("stragglers at step 20 (> 1.5x the median over ranks): rank 3 optimizer 41.0 ms/step "
                    "(median 12.2 ms, 3.4x); rank 5 data 300.0 ms/step (median 0.0 ms)")


@pytest.mark.parametrize("factor, ok", [(0, True), (1.5, True), (1.0, False), (0.5, False), (-1, False)])
def test_straggler_factor_is_off_or_above_one(factor, ok):
    from titanlike.config import ConfigError, load_job_config
    from titanlike.config.validate import validate_values

    cfg = load_job_config(["--metrics.straggler_factor", str(factor)])
    if ok:
        validate_values(cfg)
    else:
        with pytest.raises(ConfigError, match=r"metrics.straggler_factor must be 0 \(off\) or above 1"):
            validate_values(cfg)
