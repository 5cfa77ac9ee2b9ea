"""One job per output folder: `<folder>/.titanlike.lock`, held with fcntl.flock for the job's life.

Two jobs writing the same dump folder interleave checkpoint saves, delete each other's in-flight
`step-N.tmp` and append to the same metrics.jsonl. Rank 0 takes the lock before anything is
written; a second job is refused in one sentence naming the holder (pid, host, start time and the
job's description, written into the file).

Why flock: the kernel releases it when the holding process dies, however it dies (SIGKILL, OOM),
so a lock left by a dead job is never a permanent block. The file itself stays (it is never
deleted: deleting it would let two jobs lock two different files of the same name); a clean
exit empties it, so a non-empty file found by a job that gets the lock was left by a job that
died, and the new job says it takes it over.

Network filesystems: Linux emulates flock on NFS with POSIX byte-range locks (NLM, NFSv4), which
do exclude jobs on different hosts, but a lock held by a crashed host lasts until the server's
lease expires (about 90 s); the refusal names that host so the user can judge. Some filesystems
(Lustre mounted without -o flock, some FUSE mounts) do not support flock: the job then warns and
runs unlocked rather than not at all.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import time

logger = logging.getLogger("titanlike")

LOCK_NAME = ".titanlike.lock"


class FolderInUse(RuntimeError):
    """Another live job holds the folder's lock; the message is for the user."""


class FolderLock:
    """`acquire()` or raise FolderInUse; `release()` at the end of the job (idempotent)."""

    def __init__(self, folder: str, *, option: str = "job.dump_folder", description: str = ""):
        self.folder = folder
        self.option = option
        self.description = description
        self.path = os.path.join(folder, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> None:
        import fcntl

        os.makedirs(self.folder, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise FolderInUse(
                    f"{self.option} {self.folder} is in use by another titanlike job ({_describe(holder)}); "
                    f"use another {self.option.split('.')[-1]} or stop that job") from None
            logger.warning(f"{self.option} {self.folder}: this filesystem does not support file locks "
                           f"({os.strerror(e.errno or 0)}), so a second job on this folder would not be detected")
            return
        previous = _read(fd)
        if previous:
            logger.warning(f"{self.option} {self.folder}: taking over the lock of a titanlike job that is gone "
                           f"({_describe(previous)})")
        me = {"host": socket.gethostname(), "pid": os.getpid(),
              "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "description": self.description}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        import fcntl

        try:
            os.ftruncate(fd, 0)  # empty: the next job knows this one ended cleanly
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    @property
    def held(self) -> bool:
        return self._fd is not None


def _read(fd: int) -> dict | None:
    try:
        raw = os.pread(fd, 4096, 0).decode(errors="replace").strip()
    except OSError:
        return None
    if not raw:
        return None
    try:
        info = json.loads(raw)
        return info if isinstance(info, dict) else {"raw": raw}
    except ValueError:
        return {"raw": raw[:200]}


def _describe(info: dict | None) -> str:
    if not info:
        return "details not written yet"
    if "pid" not in info:
        return info.get("raw", "unreadable lock file")
    text = f"pid {info['pid']} on {info.get('host', '?')} since {info.get('since', '?')}"
    if info.get("description"):
        text += f": {info['description']}"
    return text
