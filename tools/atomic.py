"""Outputs that appear complete or not at all, and processes that clean up after themselves when stopped.

Every output is first written under a temp name beside its final name (".<name>.partial-<pid>": same folder, so the
rename is atomic), fsynced, then renamed. Temp names of this process are registered, so Ctrl-C or `kill` removes them
before exiting; `kill -9` cannot, so the next run removes temp names whose process is gone.
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import time
from pathlib import Path

PARTIAL_TAG = ".partial-"
_pending: set[Path] = set()  # this process's temp outputs, not yet renamed into place or removed
_children: set[int] = set()  # worker processes that may still (re)open those outputs


def partial_path(final: Path) -> Path:
    """Temp name for `final` in the same folder, tagged with our pid (not registered: see Staged for that)."""
    return final.with_name(f".{final.name}{PARTIAL_TAG}{os.getpid()}")


def remove_path(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # a leftover tagged with our own pid came from an earlier process (or an earlier call): stale
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_partials(folder: Path) -> list[Path]:
    """Remove temp files/folders left by killed runs; those of a process still running are kept."""
    removed = []
    for p in folder.glob(f".*{PARTIAL_TAG}*"):
        pid = p.name.rsplit(PARTIAL_TAG, 1)[1]
        if pid.isdigit() and not _pid_alive(int(pid)):
            remove_path(p)
            removed.append(p)
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
        self.pending.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for tmp, _ in self.pending:
            remove_path(tmp)
            _pending.discard(tmp)
        self.pending.clear()


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
            os.write(2, f"\n{message}\n".encode())
        os._exit(128 + signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
