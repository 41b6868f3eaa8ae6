"""SIGTERM and SIGINT (Ctrl-C): one policy for every command, and the child processes it starts.

A signal stops the whole command, its child processes included; the command says in one line what it kept and exits
128 + the signal's number. The trainer keeps its run instead: a signal while it trains ends the step, writes a
checkpoint and exits 0 (ffcv_ddpm.train).

    def main(argv):
        return run_command("bench", lambda stop: work(stop), errors=(BenchError,))   # the one line, 128 + signal
    stop.doing("row 2 of 4")                    # a safe point; what the command does now, for the last line
    stop.kept["report"] = "the report x.json"   # what stays on disk if it stops here (keep(): without a Stop at hand)
    proc = start(cmd, cwd=REPO)                 # a child: its own process group, known to the handler
    out, err = finish(proc, timeout)            # its wait: a safe point; past the timeout all it started is killed
    stop.done()                                 # measured: the last writes complete whatever comes
    catch_early("train", "start-up")            # in a command's module, before its imports (seconds of torch)

The handler never raises on a first signal. Python runs a handler between two bytecodes of whatever the main thread
is doing: a library's internals, an import, a `finally`, a garbage collector's callback. An exception raised inside
a callback is printed ("Exception ignored in ...") and dropped: the trainer trained on after "Interrupted: SIGTERM
during start-up" raised inside numba's `on_disposal` (issue 46). So the handler records the signal and forwards
SIGTERM to the children, and the command raises Interrupted at its safe points (`check()`: each wait for a child,
each phase and row of a command, the trainer's start-up sections), where unwinding is what the code expects. A
second signal means "now": the children are killed and the handler raises where the main thread is; should that
raise be dropped, the first signal still stops the command at its next safe point.

Children run in process groups of their own: a terminal's Ctrl-C reaches the command alone, which stops them in
order: SIGTERM (each stops its own way: a trainer checkpoints, torchrun stops its ranks), up to GRACE_S seconds, then
SIGKILL to everything each one started, torchrun's ranks (in sessions of their own) included.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from typing import Callable

import psutil

from ffcv_ddpm.checks import fail

SIGNALS = (signal.SIGTERM, signal.SIGINT)
GRACE_S = 10.0  # a child's time to stop after its SIGTERM (a trainer's last step and checkpoint) before it is killed
POLL_S = 0.1  # how often a wait for a child looks for a signal


class Interrupted(KeyboardInterrupt):
    """A signal stopped the command: 'SIGTERM during <what it was doing>'; the exit status is 128 + signum."""

    def __init__(self, signum: int, when: str):
        super().__init__(f"{signal.Signals(signum).name} {when}")
        self.signum = signum


_current: Stop | None = None  # the installed Stop: signal handlers are the process's, so one at a time
_children: list = []  # started by start() (or passed to track()) and not yet waited for
_terminated: set[int] = set()  # children sent their SIGTERM (a second one would stop a trainer without checkpoint)
_seen: dict[int, set] = {}  # a child's pid -> its tree at the signal, for end(): found even once orphaned


def catch_early(prog: str, where: str) -> None:
    """For a command's own module, before its heavy imports (seconds of torch): a signal that comes before main
    installs its Stop says so in the command's one line and exits 128 + signum at once (rather than with no word):
    nothing exists yet that would need stopping or removing."""
    def handle(signum, frame):
        with contextlib.suppress(OSError):
            os.write(2, f"{prog}: {signal.Signals(signum).name} during {where}\n".encode())
        os._exit(128 + signum)

    for s in SIGNALS:
        signal.signal(s, handle)


class Stop:
    """The command's SIGTERM/SIGINT while installed (restore() puts the previous handlers back).

    phase: "start-up" (the default: the next safe point raises Interrupted), "running" (the trainer's loop polls
    `signum` between steps and checkpoints), "stopping" (the work is done or its last write is under way: further
    signals are ignored so it completes).
    """

    def __init__(self, prog: str, where: str = "start-up"):
        global _current
        self.prog = prog
        self.signum: int | None = None  # the first signal
        self.phase = "start-up"
        self.where = where  # what the command is doing, for the message of a signal (doing() sets it)
        self.kept: dict[str, str] = {}  # what stays on disk if the command stops now (key: what, value: the words)
        self.say = True  # the line said at once (False: a DDP rank other than 0)
        self._at = 0.0  # when the first signal came (time.monotonic)
        self._ending = False  # stopped() is stopping the children: a further signal kills them, and raises nothing
        self._previous = _current
        self._old = {s: signal.signal(s, self._handle) for s in SIGNALS}
        _current = self

    def _handle(self, signum, frame) -> None:
        if self.phase == "stopping":
            return
        if self.signum is None:
            self.signum, self._at = signum, time.monotonic()
            for child in list(_children):
                _seen[child.pid] = _tree(child)  # first: a child that exits at once would orphan what it started
                _terminate(child)
            if self.say:
                # os.write, not print: the handler may have interrupted a print, and print would then raise.
                with contextlib.suppress(OSError):
                    os.write(1, f"\n{self.prog}: {signal.Signals(signum).name} received; {self.pending()}\n".encode())
            return
        for child in list(_children):
            _kill(child, _seen.get(child.pid, set()))
        if not self._ending:
            raise Interrupted(signum, f"after {signal.Signals(self.signum).name}: stopped at once")

    def pending(self) -> str:
        """What the line said at once tells: a step or a phase may take a while (a CPU step of ddpm-cifar10: 37 s)."""
        if self.phase == "running":
            return "the run stops after this step, with a checkpoint; a second signal stops it at once"
        if _children:
            return (f"stopping {len(_children)} child process(es): SIGTERM, killed after {GRACE_S:g} s; a second "
                    "signal kills them at once")
        return f"stopping at the next safe point (now: {self.where}); a second signal stops at once"

    def check(self) -> None:
        """A safe point: raises Interrupted if a signal came (in the start-up phase; see the class docstring)."""
        if self.signum is not None and self.phase == "start-up":
            raise Interrupted(self.signum, f"during {self.where}")

    def doing(self, where: str) -> None:
        """A safe point, then `where` is what the command does from here (the message of a later signal says it)."""
        self.check()
        self.where = where

    def done(self) -> None:
        """The work is complete: a signal that came is honored now; later ones are ignored, so the last writes
        complete."""
        self.check()
        self.phase = "stopping"

    def stopped(self, e: Interrupted) -> int:
        """The children stopped (bounded: GRACE_S from the signal), the one line, and the exit status."""
        self._ending = True
        end(list(_children))
        self.phase = "stopping"
        print(f"{self.prog}: stopped by {e}. Kept: {'; '.join(self.kept.values()) or 'nothing'}.", file=sys.stderr,
              flush=True)
        return 128 + e.signum

    def restore(self) -> None:
        global _current
        self.phase = "stopping"
        for s, h in self._old.items():
            if h is not None:  # None: a handler not installed from Python, which cannot be put back
                signal.signal(s, h)
        _current = self._previous


def current() -> Stop | None:
    return _current


def check() -> None:
    """For code that has no Stop at hand, the installed Stop's check() (without one: nothing); so doing(), keep()
    and done() below."""
    if _current is not None:
        _current.check()


def doing(where: str) -> None:
    if _current is not None:
        _current.doing(where)


def keep(what: str, words: str) -> None:
    if _current is not None:
        _current.kept[what] = words


def done() -> None:
    if _current is not None:
        _current.done()


def run_command(prog: str, body: Callable[[Stop], int | None], errors: tuple = ()) -> int:
    """body(stop) under a Stop: its exit status (None: 0). A signal: the children stopped, one line
    ('PROG: stopped by SIGTERM during ... Kept: ...'), 128 + signum. An error of `errors`: one line, 2. An error
    while a signal is pending is the signal's doing (a child killed under a wait, a rank's peer gone): said as
    the stop."""
    stop = Stop(prog)
    try:
        rc = body(stop)
        stop.check()  # a signal after the last safe point: the command did its work, and says it was stopped
        return 0 if rc is None else rc
    except Interrupted as e:
        return stop.stopped(e)
    except SystemExit:
        raise
    except BaseException as e:
        if stop.signum is not None:
            return stop.stopped(Interrupted(stop.signum, f"during {stop.where}"))
        if isinstance(e, errors):
            stop.phase = "stopping"
            return fail(prog, str(e))
        raise
    finally:
        stop.phase = "stopping"
        end(list(_children))
        stop.restore()


# ---- children --------------------------------------------------------------------------------------------------

def start(cmd: list[str], **popen_kwargs) -> subprocess.Popen:
    """subprocess.Popen in a process group of its own, known to the signal handler until finish() or end(). A safe
    point first: no child starts after a signal."""
    check()
    proc = subprocess.Popen(cmd, process_group=0, **popen_kwargs)
    _children.append(proc)
    if _current is not None and _current.signum is not None:
        _terminate(proc)  # the signal came while it started
    return proc


def track(processes) -> None:
    """Children started otherwise (multiprocessing.Process: torch.multiprocessing.spawn's), stopped like start()'s;
    they share this process's group, so only their own trees are killed. end() them when done."""
    _children.extend(processes)


def finish(proc: subprocess.Popen, timeout: float | None = None):
    """Waits for a child of start(): communicate()'s (stdout, stderr). A safe point, before and after: a signal
    raises Interrupted. Past `timeout` seconds everything it started is killed and TimeoutExpired raised (with the
    output so far). Leaving early (a signal, an error) ends the child first: no child outlives its wait."""
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            with contextlib.suppress(subprocess.TimeoutExpired):
                out = proc.communicate(timeout=POLL_S)
                break
            check()
            if deadline is not None and time.monotonic() > deadline:
                _kill(proc, set())
                raise subprocess.TimeoutExpired(proc.args, timeout, *proc.communicate())
    except BaseException:
        end([proc])
        raise
    _forget(proc)
    check()
    return out


def run(cmd: list[str], timeout: float | None = None, capture_output: bool = False,
        **popen_kwargs) -> subprocess.CompletedProcess:
    """subprocess.run through start() and finish(): a signal stops the child with the command, a timeout kills all
    it started (subprocess.run kills the child alone: torchrun's ranks lived on)."""
    if capture_output:
        popen_kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc = start(cmd, **popen_kwargs)
    out, err = finish(proc, timeout)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def end(children: list, grace: float | None = None) -> None:
    """Stops `children`: SIGTERM (once), up to `grace` seconds (default GRACE_S) from the first signal or from now,
    then SIGKILL to each one's whole tree (and the process group of a child of start()); reaps them. Bounded: grace
    + a few seconds."""
    if not children:
        return
    grace = GRACE_S if grace is None else grace
    seen = {child.pid: _seen.pop(child.pid, set()) | _tree(child) for child in children}  # before any SIGTERM
    for child in children:
        _terminate(child)
    at = _current._at if _current is not None and _current.signum is not None else time.monotonic()
    deadline = min(at + grace, time.monotonic() + grace)
    while True:
        for child in children:
            seen[child.pid] |= _tree(child)  # a descendant orphaned by its parent's exit is still known
        if all(_exited(child) for child in children) or time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    for child in children:
        _kill(child, seen[child.pid])
    for child in children:
        with contextlib.suppress(Exception):
            child.wait(5) if isinstance(child, subprocess.Popen) else child.join(5)
        _forget(child)


def _forget(child) -> None:
    with contextlib.suppress(ValueError):
        _children.remove(child)
    _terminated.discard(child.pid)
    _seen.pop(child.pid, None)


def _wait_info(child):
    """os.waitid without reaping (a reaped child's pid, and its process group, may be taken by another process, so
    the child is kept a zombie until it is killed): None while it runs, a result once it exited; ChildProcessError
    once it is reaped."""
    if isinstance(child, subprocess.Popen) and child.returncode is not None:
        raise ChildProcessError(child.pid)
    return os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)


def _exited(child) -> bool:
    try:
        return _wait_info(child) is not None
    except ChildProcessError:
        return True


def _reaped(child) -> bool:
    try:
        _wait_info(child)
        return False
    except ChildProcessError:
        return True


def _terminate(child) -> None:
    if child.pid not in _terminated and not _exited(child):
        _terminated.add(child.pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGTERM)


def _tree(child) -> set:
    """The child and its descendants now (psutil.Process objects: each knows its start time, so a later kill cannot
    hit another process that took a pid); nothing once the child is reaped."""
    if _reaped(child):
        return set()
    try:
        root = psutil.Process(child.pid)
        return {root, *root.children(recursive=True)}
    except psutil.Error:
        return set()


def _kill(child, seen: set) -> None:
    """SIGKILL to the child, its descendants (now, and `seen` earlier) and, for a child of start(), its process group
    (while the child is unreaped, its pid holds the group)."""
    procs = _tree(child) | seen
    if isinstance(child, subprocess.Popen) and not _reaped(child):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    deadline = time.monotonic() + 5  # SIGKILL takes effect at once; this waits for the kernel to tear them down
    while time.monotonic() < deadline and any(_running(p) for p in procs if p.pid != child.pid):
        time.sleep(0.01)


def _running(p: psutil.Process) -> bool:
    """Not gone and not a zombie (an orphan's zombie waits for init to reap it, which some containers never do)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
