"""Collective timeouts and the NCCL flight recorder ([comm] train_timeout_seconds, trace_buf_size).

A job starts with comm.init_timeout_seconds on its process groups: initialization, compilation and
the first step can take long on some ranks. After the first step every collective should finish
quickly, so `set_train_timeout` shortens the timeout to comm.train_timeout_seconds and a hung rank
fails the job in seconds rather than half an hour (torchtitan does the same).

`configure_flight_recorder` sizes the NCCL flight recorder, the per-rank ring buffer of recent
collectives that torch dumps when a collective times out; it must run before the process group
exists.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from datetime import timedelta

import torch.distributed as dist

logger = logging.getLogger("titanlike")

# torch reads the first of these that is set (TORCH_FR_* is the newer name).
FLIGHT_RECORDER_BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_DUMP_ON_TIMEOUT_VARS = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)
_DUMP_FILE_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def configure_flight_recorder(trace_buf_size: int, dump_folder: str | None = None) -> None:
    """Size the NCCL flight recorder: keep the last `trace_buf_size` collectives per rank (0: off).

    Sets TORCH_NCCL_TRACE_BUFFER_SIZE and TORCH_FR_BUFFER_SIZE in os.environ, so it must run
    before the process group is created. Variables the user already set win: if either buffer
    variable is set, neither is touched. It has effect on NCCL only: gloo (CPU) keeps no flight
    recorder, and on CPU this is harmless.

    dump_folder: where NCCL writes each rank's recorder (files `<dump_folder>/rank_<r>`) when a
    collective times out; with a buffer > 0 and a folder, dump-on-timeout is switched on too.
    """
    if trace_buf_size < 0:
        raise ValueError(f"comm.trace_buf_size must be 0 (off) or more, got {trace_buf_size}")
    if any(var in os.environ for var in FLIGHT_RECORDER_BUFFER_VARS):
        return
    for var in FLIGHT_RECORDER_BUFFER_VARS:
        os.environ[var] = str(trace_buf_size)
    if trace_buf_size > 0 and dump_folder:
        if not any(var in os.environ for var in _DUMP_ON_TIMEOUT_VARS + _DUMP_FILE_VARS):
            os.makedirs(dump_folder, exist_ok=True)
            for var in _DUMP_ON_TIMEOUT_VARS:
                os.environ[var] = "1"
            for var in _DUMP_FILE_VARS:
                os.environ[var] = os.path.join(dump_folder, "rank_")


def set_train_timeout(seconds: float, *, keep: Iterable = (), barrier: bool = True) -> int:
    """Set the timeout of the default process group and of every other group this rank belongs to.

    Call on every rank after the first training step. `keep`: groups left at their timeout (the
    checkpoint's gloo group, whose collectives wait for a slow rank's checkpoint write). With
    `barrier` all ranks first meet under the old timeout, so no rank issues a collective with the
    short timeout while another is still busy with the first step. Returns how many groups were
    changed. Uses torch's private `_set_pg_timeout` (as torchtitan does); without it, logs one
    warning and changes nothing.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return 0
    try:
        from torch.distributed import distributed_c10d as c10d

        set_pg_timeout = c10d._set_pg_timeout
        not_in_group = c10d._rank_not_in_group
        default = c10d._get_default_group()
    except (ImportError, AttributeError) as e:
        logger.warning(f"comm.train_timeout_seconds is not applied: this torch lacks the private API it uses ({e})")
        return 0
    # Every group this process created (DeviceMesh dims, flattened meshes, ...); private as well,
    # so fall back to the default group alone.
    world = getattr(c10d, "_world", None)
    groups = [default, *(g for g in getattr(world, "pg_map", {}) if g is not default)]
    kept = {id(g) for g in keep if g is not None}
    if barrier:
        dist.barrier()
    timeout = timedelta(seconds=seconds)
    changed = 0
    for group in groups:
        if id(group) in kept or not_in_group(group):
            continue
        set_pg_timeout(timeout, group)
        changed += 1
    if dist.get_rank() == 0:
        logger.info(f"comm: collective timeout set to {seconds:g} s on {changed} process group(s)")
    return changed


__all__ = ["FLIGHT_RECORDER_BUFFER_VARS", "configure_flight_recorder", "set_train_timeout"]
