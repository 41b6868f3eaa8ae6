"""Outputs that appear complete or not at all, and processes that clean up after themselves when stopped.

Every output is first written under a temp name beside its final name (".<name>.partial-<pid>": same folder, so the
rename is atomic), fsynced, then renamed. Temp names of this process are registered, so Ctrl-C or `kill` removes them
before exiting; `kill -9` cannot, so the next run removes temp names whose process is gone. "Gone" is decided by a
lock the writing process holds (".writer-<pid>.lock" in the same folder, flock'ed until it and its workers exit), not
by its pid: a killed process that is not reaped yet still has a pid, but the kernel has released its locks.
Shared-memory segments are handled the same way: named ffcv_ddpm_<pid>_<hex> and locked while in use, so a run can
recognise and remove those a killed run left in /dev/shm.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import fcntl
import json
import os
import secrets
import shutil
import signal
import time
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

PARTIAL_TAG = ".partial-"
SHM_PREFIX = "ffcv_ddpm_"  # shared-memory segments of this project: /dev/shm/ffcv_ddpm_<pid>_<hex>
SHM_DIR = Path("/dev/shm")
_pending: set[Path] = set()  # this process's temp outputs, not yet renamed into place or removed
_children: set[int] = set()  # worker processes that may still (re)open those outputs
_locks: dict[Path, int] = {}  # lock file -> fd, held while this process (or a worker it forked) lives
_segments: dict[str, shared_memory.SharedMemory | None] = {}  # ours, by name (None: being created)


def partial_path(final: Path) -> Path:
    """Temp name for `final` in the same folder, tagged with our pid (not registered: see Staged for that).
    Takes this process's writer lock in that folder first, so the next run can tell whether we still live."""
    _hold_lock(final.parent / _lock_name(os.getpid()))
    return final.with_name(f".{final.name}{PARTIAL_TAG}{os.getpid()}")


def _lock_name(pid: int) -> str:
    return f".writer-{pid}.lock"


def _hold_lock(path: Path) -> None:
    if path in _locks or not path.parent.is_dir():
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return  # an unwritable folder: the caller's own write reports it
    fcntl.flock(fd, fcntl.LOCK_EX)  # inherited by forked workers: held until the last of them exits
    _locks[path] = fd


def _locked_by_another(path: Path) -> bool | None:
    """True if a live process holds the lock on `path`, False if none does, None if there is no such file (or it
    is not ours to open: then nothing is removed on its account)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # releases the lock if we took it


def release_locks() -> None:
    """When this process has finished writing (at exit at the latest; forked workers leave with os._exit, so never
    from them) and when it is stopped by a signal."""
    for path in list(_locks):
        _release_lock(path)


def _release_lock(path: Path) -> None:
    fd = _locks.pop(path, None)
    if fd is not None:
        with contextlib.suppress(OSError):
            path.unlink()
            os.close(fd)


atexit.register(release_locks)


def remove_path(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _writer_alive(folder: Path, pid: int) -> bool:
    if pid == os.getpid():
        return False  # not one of our registered outputs (the caller checked): an earlier process with our pid
    locked = _locked_by_another(folder / _lock_name(pid))
    return _pid_alive(pid) if locked is None else locked  # no lock file: a writer that took none (older version)


def remove_stale_partials(folder: Path) -> list[Path]:
    """Remove temp files/folders left by killed runs, and their lock files; those of a live process are kept."""
    removed = []
    for p in folder.glob(f".*{PARTIAL_TAG}*"):
        pid = p.name.rsplit(PARTIAL_TAG, 1)[1]
        if pid.isdigit() and p not in _pending and not _writer_alive(folder, int(pid)):
            remove_path(p)
            removed.append(p)
    for lock in folder.glob(".writer-*.lock"):
        if lock not in _locks and _locked_by_another(lock) is False:
            lock.unlink(missing_ok=True)
    return removed


# ---------------------------------------------------------------------------------------------------------------
# Shared memory

def create_segment(size: int) -> shared_memory.SharedMemory:
    """A shared-memory segment named as this project's and locked while this process (or a worker it forked) lives.
    Free it with release_segment; Ctrl-C/kill unlink it (abort_cleanly); after kill -9, remove_stale_segments."""
    name = f"{SHM_PREFIX}{os.getpid()}_{secrets.token_hex(4)}"
    _segments[name] = None  # known before it exists: a signal while it is being made still removes it
    # SharedMemory would start multiprocessing's resource tracker (a process: tens of ms) after the segment exists;
    # started first, the moment the segment exists but is not registered here shrinks to nothing.
    resource_tracker.ensure_running()
    seg = _segments[name] = shared_memory.SharedMemory(name=name, create=True, size=size)
    _hold_lock(SHM_DIR / seg.name)  # where the segment is a file (Linux): its own lock says whether it is in use
    return seg


def release_segment(seg: shared_memory.SharedMemory) -> None:
    with contextlib.suppress(FileNotFoundError):
        seg.unlink()  # first: it also tells multiprocessing's resource tracker, so it reports no leak
    _segments.pop(seg.name, None)
    fd = _locks.pop(SHM_DIR / seg.name, None)
    if fd is not None:
        os.close(fd)
    # Stopped mid-write, numpy views of the buffer may still exist and close() refuses (BufferError); the mapping
    # then goes with the process, and the name is already gone.
    with contextlib.suppress(BufferError):
        seg.close()


def remove_stale_segments() -> list[str]:
    """Unlink this project's shared-memory segments whose process is gone (left by kill -9)."""
    removed = []
    for p in SHM_DIR.glob(f"{SHM_PREFIX}*") if SHM_DIR.is_dir() else ():
        if p.name not in _segments and _locked_by_another(p) is False:
            p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Staged:
    """Outputs written under registered temp names, renamed into place together by commit().

    Leaving the `with` block without commit() (an exception, KeyboardInterrupt) removes the temp outputs.
    """

    def __init__(self):
        self.pending: list[tuple[Path, Path]] = []  # (temp, final)

    def path(self, final: Path) -> Path:
        tmp = partial_path(final)
        self.pending.append((tmp, final))
        _pending.add(tmp)
        return tmp

    def commit(self) -> None:
        for tmp, _ in self.pending:
            if tmp.is_file():
                fsync_path(tmp)
        for tmp, final in self.pending:
            if tmp.is_dir() and final.exists():
                remove_path(final)  # a folder cannot be replaced in one step; the caller checked that it is ours
            os.replace(tmp, final)
            _pending.discard(tmp)
        for folder in {final.parent for _, final in self.pending}:
            fsync_path(folder)  # so that the renames themselves survive a power cut
        self._done()

    def _done(self) -> None:
        # A folder where this process has no temp output left needs no lock: a results folder keeps no lock file.
        folders = {final.parent for _, final in self.pending}
        self.pending.clear()
        for folder in folders - {tmp.parent for tmp in _pending}:
            _release_lock(folder / _lock_name(os.getpid()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for tmp, _ in self.pending:
            remove_path(tmp)
            _pending.discard(tmp)
        self._done()


def write_json(path: Path, obj: dict) -> None:
    with Staged() as staged:
        staged.path(path).write_text(json.dumps(obj, indent=2) + "\n")
        staged.commit()


# ---------------------------------------------------------------------------------------------------------------
# Stopping

def track_children(pids) -> None:
    """Workers writing our temp outputs: stopped before the outputs are removed (see abort_cleanly)."""
    _children.update(pids)


def untrack_children(pids) -> None:
    _children.difference_update(pids)


def _stop_children(timeout_s: float) -> None:
    """SIGKILL the tracked workers and wait (bounded) until they are gone."""
    pids = list(_children)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while time.monotonic() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0]:
                    break
            except ChildProcessError:  # already reaped
                break
            time.sleep(0.005)


def worker_init() -> None:
    """For worker processes: die with the parent (Linux; no orphan waits for work that never comes) and leave Ctrl-C,
    which reaches the whole process group, to the parent."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def abort_cleanly(message: str):
    """While active, SIGINT and SIGTERM remove this process's temp outputs, print `message` and exit (130 / 143).

    A handler that exits is safer than the default KeyboardInterrupt, which can land inside multiprocessing or a
    fork hook and be swallowed or leave a lock held. Workers are stopped by worker_init's parent-death signal.
    """
    owner = os.getpid()

    def handler(signum, frame):
        if os.getpid() == owner:  # not a freshly forked child that has not yet set up its own handlers
            # Workers first: FFCV's writer workers open the output in append mode, which would re-create a temp
            # file removed under them (seen in CI as a leftover .partial after `kill`).
            _stop_children(timeout_s=2.0)
            # A worker forked but not yet tracked can still re-create a file in the moment before it dies with us:
            # sweep a few times over 0.2 s.
            for _ in range(5):
                for p in list(_pending):
                    remove_path(p)
                time.sleep(0.04)
            for name, seg in list(_segments.items()):
                with contextlib.suppress(Exception):
                    if seg is None:
                        (SHM_DIR / name).unlink(missing_ok=True)
                    else:
                        release_segment(seg)
            release_locks()
            os.write(2, f"\n{message}\n".encode())
        os._exit(128 + signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
