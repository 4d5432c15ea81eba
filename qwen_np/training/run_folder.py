"""A training run's --out folder: the lock that lets one trainer at a time use it.

Two trainers writing one folder would each overwrite the other's checkpoints: both would report success
and the folder would hold one of the runs. So a trainer holds `train.lock` there for as long as it runs.
The file is created with O_EXCL and holds the trainer's PID (for the message of the one refused); what
marks it held is an flock on it, which the kernel lets go of when the process ends, however it ends. A
lock file whose flock nobody holds was left by a trainer that died without removing it (kill -9, a
crash, a power loss): the next trainer takes it over. (The PID alone could not tell: a dead trainer's
PID may be another process's by now.)
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from ..errors import QwenNPError

LOCK = "train.lock"


@contextmanager
def locked(out: Path) -> Iterator[str | None]:
    """Hold out/train.lock for the block; yields what a dead trainer left in it (its PID, "" if it died before
    writing one), None if there was no lock. Raises QwenNPError naming the PID if a live trainer holds it."""
    path = out / LOCK
    fd, left = _take(path)
    try:
        yield left
    finally:
        path.unlink(missing_ok=True)            # while still held: no trainer can take the file being removed
        os.close(fd)


def _take(path: Path) -> tuple[int, str | None]:
    while True:
        try:
            fd, fresh = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644), True
        except FileExistsError:
            try:
                fd, fresh = os.open(path, os.O_RDWR | os.O_CLOEXEC), False
            except FileNotFoundError:           # its trainer removed it just now: create it again
                continue
        except FileNotFoundError:               # the folder itself: a run that failed there removed it
            raise QwenNPError(f"{path.parent} was removed as this run started (by a train run that "
                              "failed there); start it again", "out") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            raise QwenNPError(f"{path.parent} is in use by another train run (PID {holder or '?'}, holding "
                              f"{path}); wait for it to end, or train into another folder", "out") from None
        if not _same_file(fd, path):            # removed (and maybe made again) between our open and flock
            os.close(fd)
            continue
        left = None if fresh else _read(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd, left


def _read(fd: int) -> str:
    return os.pread(fd, 64, 0).decode("ascii", "replace").strip()


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False
