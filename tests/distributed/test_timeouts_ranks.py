"""comm.train_timeout_seconds on a real gloo world: rank 0's collective, which its forked peer never joins,
fails after the 1 s train timeout rather than the group's 60 s (titanlike/parallel/timeouts.py). Its
one-process checks: tests/unit/test_timeouts.py."""

import multiprocessing
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from titanlike.parallel.timeouts import set_train_timeout


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
