"""The [comm] options: the training timeout after the first step, and the flight recorder's size."""

import multiprocessing
import os
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from titanlike.parallel import timeouts
from titanlike.parallel.timeouts import configure_flight_recorder, set_train_timeout


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


def _rank(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    set_train_timeout(1)
    if rank == 0:
        begin = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1))  # rank 1 never joins
            queue.put(("no error", 0.0))
        except Exception as e:  # gloo raises RuntimeError / DistBackendError on timeout
            queue.put((f"{type(e).__name__}: {e}"[:300], time.monotonic() - begin))
        queue.close()
        queue.join_thread()  # os._exit would drop what the queue's feeder thread has not sent
    else:
        time.sleep(2.5)  # alive, so rank 0 waits for it rather than seeing it leave
    os._exit(0)  # no destroy_process_group: it would wait on the peer


def test_a_collective_on_gloo_fails_after_the_train_timeout():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("fork")  # no torch re-import: a second or two, not ten
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        kind, seconds = queue.get(timeout=60)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert "timed out" in kind.lower(), kind
    assert 0.5 < seconds < 3.5, f"the all_reduce failed after {seconds:.1f} s, not after the 1 s train timeout"


def test_flight_recorder_size_is_set_unless_the_user_set_it(monkeypatch, tmp_path):
    for var in (*timeouts.FLIGHT_RECORDER_BUFFER_VARS, *timeouts._DUMP_ON_TIMEOUT_VARS, *timeouts._DUMP_FILE_VARS):
        monkeypatch.delenv(var, raising=False)
    configure_flight_recorder(20000, dump_folder=str(tmp_path / "fr"))
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == os.environ["TORCH_FR_BUFFER_SIZE"] == "20000"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "fr" / "rank_")

    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "5")
    configure_flight_recorder(20000)
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "5" and "TORCH_FR_BUFFER_SIZE" not in os.environ

    with pytest.raises(ValueError, match="comm.trace_buf_size must be 0"):
        configure_flight_recorder(-1)
