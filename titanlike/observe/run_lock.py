"""One job per output folder: `<folder>/.titanlike.lock`, held with fcntl.flock for the job's life.

Two jobs writing the same folder interleave checkpoint saves, delete each other's in-flight
`step-N.tmp` and append to the same metrics.jsonl. Rank 0 locks every folder the job writes into
(`output_folders`: the dump folder, the checkpoint folder, TensorBoard's, the profiler's, ...)
before anything is written, whether it lies inside the dump folder or not: two jobs that reach one
folder by any paths (one's checkpoint.folder is the other's dump_folder/checkpoint, a symlink)
lock the same file, and the second is refused in one sentence naming the option, the folder and
the holder (pid, host, start time and the job's description, written into the file).

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


class FolderRefused(RuntimeError):
    """An output folder cannot be used (it cannot be created, or another job holds it); the message
    is one sentence for the user."""


class FolderInUse(FolderRefused):
    """Another live job holds the folder's lock; the message is for the user."""


def output_folders(cfg) -> list[tuple[str, str]]:
    """(option, folder) of every folder a job of this config writes into, the dump folder first:
    the checkpoint folder (also with checkpoint.load_only: a relaunch removes a killed save's
    leftovers there), and those of the enabled metrics, profiling and config outputs. Paths are
    as the job joins them (an absolute one leaves the dump folder)."""
    dump, m, p = cfg.job.dump_folder, cfg.metrics, cfg.profiling
    out = [("job.dump_folder", dump)]
    if cfg.checkpoint.enable:
        out.append(("checkpoint.folder", os.path.join(dump, cfg.checkpoint.folder)))
    if m.enable_tensorboard:
        out.append(("metrics.save_tb_folder", os.path.join(dump, m.save_tb_folder)))
    if p.enable_profiling:
        out.append(("profiling.save_traces_folder", os.path.join(dump, p.save_traces_folder)))
    if p.enable_memory_snapshot:
        out.append(("profiling.save_memory_snapshot_folder", os.path.join(dump, p.save_memory_snapshot_folder)))
    if cfg.job.save_config_file:
        out.append(("job.save_config_file", os.path.dirname(os.path.join(dump, cfg.job.save_config_file)) or "."))
    return out


def check_output_folders(cfg) -> None:
    """Before any process group: ValueError (one sentence naming the option) for an output folder no
    job could write, without creating anything: a path too long for the file system, one under an
    existing file, on /proc or /sys, or under a folder this user cannot write. What only creating it
    can tell is refused when the job locks it (lock_folders), in one sentence too."""
    for option, folder in output_folders(cfg):
        problem = _folder_problem(folder)
        if problem is not None:
            raise ValueError(f"{option} {folder} {problem}")


def _folder_problem(folder: str) -> str | None:
    if not folder:
        return "is empty; name a folder"
    path = os.path.abspath(folder)
    if len(os.fsencode(path)) > 4095:
        return f"is too long ({len(os.fsencode(path))} bytes; a path holds at most 4095)"
    long = next((part for part in path.split(os.sep) if len(os.fsencode(part)) > 255), None)
    if long is not None:
        return f"has a name longer than 255 bytes ({long[:24]}...), which no file system holds"
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return "exists and is not a folder" if existing == path else f"cannot be created: {existing} is a file"
    device = os.stat(existing).st_dev
    for pseudo in ("/proc", "/sys"):
        if os.path.isdir(pseudo) and os.stat(pseudo).st_dev == device:
            return f"lies on {pseudo}, which holds no files"
    if not os.access(existing, os.W_OK | os.X_OK):
        return "is not writable" if existing == path else f"cannot be created: {existing} is not writable"
    return None


def lock_folders(folders: list[tuple[str, str]], *, description: str = "") -> list[FolderLock]:
    """Lock each (option, folder), creating it, each folder once however many options name it;
    FolderRefused (nothing left locked) when one cannot be created or another job holds it."""
    locks: list[FolderLock] = []
    seen: set[tuple[int, int]] = set()
    try:
        for option, folder in folders:
            try:
                os.makedirs(folder, exist_ok=True)
                st = os.stat(folder)
            except (OSError, ValueError) as e:  # ValueError: a NUL byte in the path
                why = os.strerror(e.errno) if isinstance(e, OSError) and e.errno else str(e)
                raise FolderRefused(f"{option} {folder} cannot be created or used as a folder ({why})") from None
            if (st.st_dev, st.st_ino) in seen:  # flock twice in one process would refuse itself
                continue
            seen.add((st.st_dev, st.st_ino))
            lock = FolderLock(folder, option=option, description=description)
            lock.acquire()
            locks.append(lock)
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


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

        try:
            os.makedirs(self.folder, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise FolderRefused(f"{self.option} {self.folder} cannot be created or written "
                                f"({os.strerror(e.errno) if e.errno else e})") from None
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
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            os.fsync(fd)
        except OSError as e:  # a full disk: the flock holds all the same, only the holder's name is missing
            logger.warning(f"{self.option} {self.folder}: could not write this job's name into {LOCK_NAME} "
                           f"({os.strerror(e.errno) if e.errno else e}); the folder is locked all the same")
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
