"""The [comm] options: the training timeout after the first step, a failed collective reported with
its step, and the flight recorder (its size, its dump). The whole path through train.py with a
stalled rank: tests/distributed/test_hangs.py; a collective on two forked gloo ranks failing after the
train timeout: tests/distributed/test_timeouts_ranks.py."""

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from titanlike.parallel import timeouts
from titanlike.parallel.timeouts import (
    CollectiveFailure,
    CollectiveGuard,
    configure_flight_recorder,
    describe_collective_failure,
    dump_flight_recorder,
    set_train_timeout,
)


def _timeout(group) -> timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=300))
    yield
    dist.destroy_process_group()


def test_set_train_timeout_changes_every_group_but_the_kept_ones(one_rank_group):
    mesh_group, checkpoint_group = dist.new_group(backend="gloo"), dist.new_group(backend="gloo")
    before = _timeout(checkpoint_group)
    assert set_train_timeout(7, keep=[checkpoint_group]) == 2
    assert _timeout(c10d._get_default_group()) == timedelta(seconds=7)
    assert _timeout(mesh_group) == timedelta(seconds=7)
    assert _timeout(checkpoint_group) == before != timedelta(seconds=7)
    t = torch.ones(2)
    dist.all_reduce(t)  # collectives still work
    assert t.tolist() == [1.0, 1.0]


def test_missing_private_api_warns_once_and_changes_nothing(one_rank_group, monkeypatch, caplog):
    monkeypatch.delattr(c10d, "_set_pg_timeout")
    with caplog.at_level("WARNING", logger="titanlike"):
        assert set_train_timeout(7) == 0
    assert len(caplog.records) == 1 and "train_timeout_seconds is not applied" in caplog.text
    assert _timeout(c10d._get_default_group()) == timedelta(seconds=300)


def test_without_a_process_group_it_does_nothing():
    assert not dist.is_initialized()
    assert set_train_timeout(7) == 0


def test_flight_recorder_size_is_set_unless_the_user_set_it(monkeypatch, tmp_path):
    for var in (*timeouts.FLIGHT_RECORDER_BUFFER_VARS, *timeouts._DUMP_ON_TIMEOUT_VARS, *timeouts._DUMP_FILE_VARS):
        monkeypatch.delenv(var, raising=False)
    configure_flight_recorder(20000, dump_folder=str(tmp_path / "fr"))
    # Only the current names: torch warns about the deprecated TORCH_NCCL_TRACE_BUFFER_SIZE.
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == "20000" and "TORCH_NCCL_TRACE_BUFFER_SIZE" not in os.environ
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "fr" / "rank_")
    assert timeouts.flight_recorder_size() == 20000

    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "5")
    configure_flight_recorder(20000)
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "5" and "TORCH_FR_BUFFER_SIZE" not in os.environ

    with pytest.raises(ValueError, match="comm.trace_buf_size must be 0"):
        configure_flight_recorder(-1)


def test_collective_errors_are_told_apart_from_others(one_rank_group):
    gloo_timeout = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                                "3000ms for recv operation to complete")
    gloo_peer = RuntimeError("[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:8626")
    assert describe_collective_failure(gloo_timeout) == "timed out"
    assert describe_collective_failure(gloo_peer) == "lost a peer"
    assert describe_collective_failure(dist.DistBackendError("NCCL watchdog")) == "timed out"
    assert describe_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) is None
    assert describe_collective_failure(RuntimeError("CUDA error: the launch timed out and was terminated")) is None
    assert describe_collective_failure(ValueError("timed out")) is None


def test_guard_names_rank_and_step_and_dumps_the_flight_recorder(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")  # read when the group is created
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for _ in range(3):
            dist.all_reduce(torch.ones(2))
        step = 7
        guard = CollectiveGuard(lambda: step, rank=0, timeout_seconds=5, dump_folder=str(tmp_path / "comm_traces"))
        with pytest.raises(CollectiveFailure) as failure:
            with guard:
                raise RuntimeError("[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                                   "5000ms for recv operation to complete")
        message = str(failure.value)
        assert message.startswith("rank 0: a collective in step 7 timed out (comm.train_timeout_seconds 5)")
        assert "Timed out waiting 5000ms" in message and guard.failed
        path = tmp_path / "comm_traces" / "rank_0"
        assert f"its last collectives: {path}" in message
        # torch's flight-recorder dump (a pickle torch wrote a moment ago): this rank's collectives.
        import pickle

        record = pickle.loads(path.read_bytes())
        names = [e["profiling_name"] for e in record["entries"]]
        assert names.count("gloo:all_reduce") >= 3

        # Other errors pass through untouched, and leave the guard as it was.
        other = CollectiveGuard(lambda: step, rank=0, timeout_seconds=5)
        with pytest.raises(KeyError):
            with other:
                raise KeyError("x")
        assert not other.failed
        # With the recorder off there is nothing to dump.
        monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
        assert dump_flight_recorder(str(tmp_path / "off"), 0) is None and not (tmp_path / "off").exists()
    finally:
        dist.destroy_process_group()
