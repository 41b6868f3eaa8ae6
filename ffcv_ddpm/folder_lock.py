"""One writer per folder: a run folder (the trainer) or a benchmark's output folder.

    lock_folder(run_dir)        # FolderInUse ("... is in use by process 4242 ...") if another live process has it
    ...
    unlock_folder(run_dir)      # or `with folder_locked(run_dir): ...`

An flock on <folder>/.lock, which holds the holder's pid for the message a second writer gets. The kernel drops an
flock when its process dies, kill -9 included, so a lock file that a dead process left is taken over without a
word. Here in the package rather than in tools/atomic.py (the dataset writers' helpers): the trainer needs it, and
the package does not import tools/.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import time
from pathlib import Path

LOCK_NAME = ".lock"
_held: dict[Path, tuple[int, int]] = {}  # folder -> (fd of its lock file, pid that took it)


class FolderInUse(Exception):
    """Another live process holds the folder's lock; the message (one line) names its pid."""


def lock_folder(folder: Path) -> None:
    """This process as the folder's one writer until unlock_folder (or its exit). The folder must exist. Taking
    it again in the process that holds it does nothing."""
    folder = Path(folder)
    if folder.resolve() in _held:
        return
    path = folder / LOCK_NAME
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise FolderInUse(f"{folder} is in use by process {holder} (its lock {path}); wait until it ends or "
                              "stop it") from None
        # A holder that let go between our open and our flock removed the file we opened (unlock_folder): the
        # lock is ours only if that file is still the one under the name.
        with contextlib.suppress(FileNotFoundError):
            mine, named = os.fstat(fd), os.stat(path)
            if (mine.st_dev, mine.st_ino) == (named.st_dev, named.st_ino):
                break
        os.close(fd)
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    _held[folder.resolve()] = (fd, os.getpid())


def _holder(fd: int) -> str:
    """The pid in a lock file another process holds; it writes it just after its flock: wait a moment for it."""
    for _ in range(50):
        if text := os.pread(fd, 32, 0).decode(errors="replace").strip():
            return text
        time.sleep(0.01)
    return "(its pid not yet written)"


def unlock_folder(folder: Path) -> None:
    """Lets the folder go and removes its lock file (a results folder keeps none). Removed while still locked, so
    a process that opened the old file meanwhile finds it gone and takes a new one."""
    fd, owner = _held.pop(Path(folder).resolve(), (None, None))
    if fd is None:
        return
    if owner == os.getpid():  # not a forked worker's copy of the table: the file is its parent's
        with contextlib.suppress(FileNotFoundError):
            (Path(folder) / LOCK_NAME).unlink()
    os.close(fd)


@atexit.register
def _unlock_all() -> None:
    for folder in list(_held):
        unlock_folder(folder)


@contextlib.contextmanager
def folder_locked(folder: Path):
    lock_folder(folder)
    try:
        yield
    finally:
        unlock_folder(folder)
