"""Collective timeouts and the flight recorder ([comm] train_timeout_seconds, trace_buf_size).

A job starts with comm.init_timeout_seconds on its process groups: initialization, compilation and
the first step can take long on some ranks. After the first step every collective should finish
quickly, so `set_train_timeout` shortens the timeout to comm.train_timeout_seconds and a hung rank
fails the job in seconds rather than half an hour (torchtitan does the same).

`CollectiveGuard` turns what a rank sees when a collective times out (or when a peer it waits on
has already failed) into a `CollectiveFailure` naming the rank and the step; every rank reports
its own, since each sees the failure differently. Under gloo (CPU) the timeout surfaces as an
exception in the waiting call. Under NCCL torch's watchdog ends the process when a collective
times out; with a flight recorder it first dumps every rank's recent collectives.

`configure_flight_recorder` sizes the flight recorder, the per-rank ring buffer of recent
collectives that NCCL dumps when a collective times out (and `CollectiveGuard` dumps on any
backend that keeps one, gloo included); it must run before the process group exists. Each dump
(`<dump_folder>/rank_<r>`) lists the collectives with their sequence numbers and states, so
comparing the ranks' last entries shows which rank never joined; torch's analyzer compares NCCL
dumps: `python -m torch.distributed.flight_recorder.fr_trace <dump_folder> --prefix rank_` (in
torch 2.13 it stops on gloo dumps, whose entries are all "scheduled": read those directly).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger("titanlike")

# torch reads the first of these that is set (TORCH_FR_* is the newer name).
FLIGHT_RECORDER_BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")
_DUMP_ON_TIMEOUT_VARS = ("TORCH_NCCL_DUMP_ON_TIMEOUT",)
_DUMP_FILE_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")


def configure_flight_recorder(trace_buf_size: int, dump_folder: str | None = None) -> None:
    """Size the flight recorder: keep the last `trace_buf_size` collectives per rank (0: off).

    Sets TORCH_FR_BUFFER_SIZE in os.environ, so it must run before the process group is created.
    Variables the user already set win: if either buffer variable (TORCH_FR_BUFFER_SIZE or its
    deprecated name TORCH_NCCL_TRACE_BUFFER_SIZE) is set, nothing is touched. NCCL keeps the
    recorder, and so does gloo in recent torch (see `dump_flight_recorder`).

    dump_folder: where NCCL writes each rank's recorder (files `<dump_folder>/rank_<r>`) when a
    collective times out; with a buffer > 0 and a folder, NCCL's dump-on-timeout is switched on too.
    """
    if trace_buf_size < 0:
        raise ValueError(f"comm.trace_buf_size must be 0 (off) or more, got {trace_buf_size}")
    if any(var in os.environ for var in FLIGHT_RECORDER_BUFFER_VARS):
        return
    # Only the current names: torch warns that the TORCH_NCCL_* ones are deprecated.
    os.environ[FLIGHT_RECORDER_BUFFER_VARS[0]] = str(trace_buf_size)
    if trace_buf_size > 0 and dump_folder:
        if not any(var in os.environ for var in _DUMP_ON_TIMEOUT_VARS + _DUMP_FILE_VARS):
            os.makedirs(dump_folder, exist_ok=True)
            os.environ[_DUMP_ON_TIMEOUT_VARS[0]] = "1"
            os.environ[_DUMP_FILE_VARS[0]] = os.path.join(dump_folder, "rank_")


def flight_recorder_size() -> int:
    """The flight recorder's size this process runs with (0: off)."""
    for var in FLIGHT_RECORDER_BUFFER_VARS:
        if var in os.environ:
            try:
                return int(os.environ[var])
            except ValueError:
                return 0
    return 0


def dump_flight_recorder(folder: str, rank: int) -> str | None:
    """Write this rank's flight recorder to `<folder>/rank_<rank>` (the file NCCL's own dump on a
    timeout writes; a pickle that torch's fr_trace analyzer reads); returns the path, or None when
    the recorder is off or this torch cannot dump it from Python. Recent torch keeps the recorder
    for gloo too, so CPU jobs get the same per-rank record of their last collectives."""
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
    if dump is None or flight_recorder_size() <= 0:
        return None
    try:
        # Without stack traces: symbolizing them took ~20 s on a busy 2-core machine, and the entries
        # (operation, sizes, sequence numbers, timeout) are what tells the ranks apart.
        data = dump(includeStackTraces=False)
    except (RuntimeError, TypeError) as e:
        logger.warning(f"rank {rank}: the flight recorder could not be dumped: {e}")
        return None
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"rank_{rank}")
    with open(path, "wb") as f:
        f.write(data)
    return path


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


# What gloo's and NCCL's errors say when a collective times out, or when its peer is gone.
_TIMEOUT_WORDS = ("timed out", "timeout")
_LOST_PEER_WORDS = ("connection closed by peer", "connection reset by peer", "broken pipe")


def describe_collective_failure(error: BaseException) -> str | None:
    """'timed out' or 'lost a peer' for an error raised by a collective that timed out or whose
    peer failed; None for any other error. Gloo raises plain RuntimeErrors, so its messages are
    read; torch's DistError (NCCL, the store) is a RuntimeError too."""
    if not (dist.is_available() and dist.is_initialized()) or not isinstance(error, RuntimeError):
        return None
    text = str(error).lower()
    if any(word in text for word in _LOST_PEER_WORDS):
        return "lost a peer"
    # "timed out" alone could be a CUDA kernel's; gloo's messages carry its source path.
    if isinstance(error, dist.DistError) or ("gloo" in text and any(word in text for word in _TIMEOUT_WORDS)):
        return "timed out"
    return None


class CollectiveFailure(RuntimeError):
    """A collective timed out or lost a peer during training; the message names the rank and the step."""


class CollectiveGuard:
    """Around the training loop: a collective that times out or loses its peer raises a
    CollectiveFailure naming this rank and `step()` (the step in progress); `failed` then tells the
    job not to wait on the other ranks at shutdown."""

    def __init__(self, step: Callable[[], int], *, rank: int, timeout_seconds: float,
                 dump_folder: str | None = None):
        self.step, self.rank, self.timeout_seconds = step, rank, timeout_seconds
        self.dump_folder = dump_folder  # where the flight recorder goes on a failure
        self.failed = False

    def __enter__(self) -> CollectiveGuard:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None or isinstance(exc, CollectiveFailure):
            return
        kind = describe_collective_failure(exc)
        if kind is None:
            return
        self.failed = True
        detail = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        if kind == "timed out":
            why = (f"timed out (comm.train_timeout_seconds {self.timeout_seconds:g}): a rank stopped taking part "
                   "(hung, or slower than the timeout allows); a rank that stalls reports its own step when it "
                   "resumes")
        else:
            why = "lost a peer: another rank failed or was stopped first (its own error names the cause)"
        dumped = dump_flight_recorder(self.dump_folder, self.rank) if self.dump_folder else None
        recorder = f"; its last collectives: {dumped}" if dumped else ""
        raise CollectiveFailure(f"rank {self.rank}: a collective in step {self.step()} {why}{recorder} "
                                f"[{detail}]") from exc


__all__ = ["FLIGHT_RECORDER_BUFFER_VARS", "CollectiveFailure", "CollectiveGuard", "configure_flight_recorder",
           "describe_collective_failure", "dump_flight_recorder", "set_train_timeout"]
