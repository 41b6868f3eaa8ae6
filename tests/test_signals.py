"""SIGTERM and SIGINT (ffcv_ddpm.stopping): a signal stops the whole command, every process it started included, in
one line and with exit status 128 + signal; a signal is never lost, not even inside a garbage collector's callback.

The policy on plain child processes (in this process, seconds), then the trainer's start-up (a signal inside a
cleanup callback; SIGTERM at points across the whole start-up), then each command that starts children, killed as
a user would: bench (its row's process), ddp on gloo (torchrun and its ranks), numerics --parallel (its legs)."""

import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import psutil
import pytest

from conftest import REPO, write_beton
from ffcv_ddpm import stopping

# A child that ignores SIGTERM and starts a grandchild in a session of its own (as torchrun starts its ranks), which
# ignores it too: only SIGKILL, sent to each of them, stops both. It prints the grandchild's pid.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
g = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
print(g.pid, flush=True)
time.sleep(300)
"""


def _running(pid: int, started: float) -> bool:
    """Whether the process `pid` that started at `started` (psutil create_time) still runs (a zombie does not)."""
    try:
        p = psutil.Process(pid)
        return p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _identities(procs) -> list[tuple[int, float]]:
    out = []
    for p in procs:
        try:
            out.append((p.pid, p.create_time()))
        except psutil.Error:
            pass
    return out


def _start_stubborn() -> tuple[subprocess.Popen, psutil.Process]:
    proc = stopping.start([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
    return proc, psutil.Process(int(proc.stdout.readline()))


# ---- the policy on plain processes --------------------------------------------------------------------------------

def test_a_signal_stops_the_children_and_all_they_started_after_the_grace(monkeypatch, capsys):
    """SIGTERM is forwarded; a child that ignores it is killed after GRACE_S with its grandchild, whose own session
    a process-group kill would miss; the last line names what the command was doing and what it kept."""
    monkeypatch.setattr(stopping, "GRACE_S", 1.0)
    procs = []

    def body(stop):
        stop.doing("waiting for the child")
        stop.kept["file"] = "the file x.json"
        proc, grandchild = _start_stubborn()
        procs.extend(_identities([psutil.Process(proc.pid), grandchild]))
        os.kill(os.getpid(), signal.SIGTERM)
        stopping.finish(proc)
        raise AssertionError("finish() returned after a signal")

    t0 = time.monotonic()
    rc = stopping.run_command("demo", body)
    took = time.monotonic() - t0
    assert rc == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines() == [
        "demo: stopped by SIGTERM during waiting for the child. Kept: the file x.json."]
    assert not [p for p in procs if _running(*p)] and len(procs) == 2
    assert 1.0 <= took < 8, took  # the grace, then SIGKILL
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and stopping.current() is None


def test_a_second_signal_kills_the_children_at_once(monkeypatch, capsys):
    monkeypatch.setattr(stopping, "GRACE_S", 60.0)
    procs = []

    def body(stop):
        proc, grandchild = _start_stubborn()
        procs.extend(_identities([psutil.Process(proc.pid), grandchild]))
        os.kill(os.getpid(), signal.SIGTERM)
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()  # Ctrl-C while the children get grace
        stopping.finish(proc)

    t0 = time.monotonic()
    rc = stopping.run_command("demo", body)
    assert rc == 128 + signal.SIGINT and time.monotonic() - t0 < 10
    assert capsys.readouterr().err.splitlines() == ["demo: stopped by SIGINT after SIGTERM: stopped at once. Kept: "
                                                    "nothing."]
    assert not [p for p in procs if _running(*p)] and len(procs) == 2


def test_a_signal_inside_a_cleanup_callback_is_not_lost(capfd, monkeypatch):
    """The issue's case: the signal arrives while a garbage collector's callback runs (numba's on_disposal in the
    trainer). A handler that raises there is dropped: Python prints 'Exception ignored' and goes on. The policy's
    handler records it, and the command's next safe point stops it."""
    dropped = []  # what Python would print as "Exception ignored in ..."
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_value))

    def signal_in_a_callback() -> None:
        def callback():
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(1000):  # the handler runs at one of these bytecodes, inside the callback
                pass
        obj = type("Obj", (), {})()
        weakref.finalize(obj, callback)
        del obj  # the callback runs here

    def raising(signum, frame):
        raise KeyboardInterrupt("raised inside the callback")

    old = signal.signal(signal.SIGTERM, raising)  # what the trainer did before: the exception is dropped
    try:
        signal_in_a_callback()
        went_on = True
    finally:
        signal.signal(signal.SIGTERM, old)
    assert went_on and [str(e) for e in dropped] == ["raised inside the callback"]
    dropped.clear()

    def body(stop):
        stop.doing("the first phase")
        signal_in_a_callback()
        stop.doing("the second phase")
        raise AssertionError("the signal was lost")

    assert stopping.run_command("demo", body) == 128 + signal.SIGTERM
    out, err = capfd.readouterr()
    assert err.splitlines() == ["demo: stopped by SIGTERM during the first phase. Kept: nothing."] and not dropped
    # Said at once: a phase may take minutes before its next safe point.
    assert "demo: SIGTERM received; stopping at the next safe point (now: the first phase)" in out


def test_a_timeout_kills_everything_the_child_started():
    """Without a signal too: subprocess.run's timeout killed the child alone (torchrun's ranks lived on)."""
    with pytest.raises(subprocess.TimeoutExpired) as e:
        stopping.run([sys.executable, "-c", STUBBORN], timeout=1.5, capture_output=True, text=True)
    grandchild = int(e.value.stdout.split()[0])
    deadline = time.monotonic() + 5
    while psutil.pid_exists(grandchild) and psutil.Process(grandchild).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the grandchild outlived the timeout"
        time.sleep(0.05)


def test_errors_are_one_line_and_a_signal_after_the_last_safe_point_still_counts(capsys):
    def bad(stop):
        raise ValueError("no such thing")

    assert stopping.run_command("demo", bad, errors=(ValueError,)) == 2
    assert capsys.readouterr().err.splitlines() == ["demo: error: no such thing"]

    def late(stop):
        stop.doing("the last writes")
        os.kill(os.getpid(), signal.SIGINT)
        return 0

    assert stopping.run_command("demo", late) == 128 + signal.SIGINT
    assert capsys.readouterr().err.splitlines() == ["demo: stopped by SIGINT during the last writes. Kept: nothing."]

    def finished(stop):
        stop.done()  # the work is complete: what comes after is not cut short
        os.kill(os.getpid(), signal.SIGINT)
        return 1

    assert stopping.run_command("demo", finished) == 1
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# ---- the trainer's start-up ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def beton(tmp_path_factory) -> Path:
    return write_beton(tmp_path_factory.mktemp("data") / "train.beton", 64)


def _trainer_args(beton: Path, out: Path) -> list[str]:
    return ["--preset", "tiny", "--data", str(beton), "data.batch_size=8", "data.num_workers=1", "train.device=cpu",
            "train.precision=fp32", "train.progress=False", "train.sample_every=0", "train.steps=1000000",
            "train.log_every=1", "train.ckpt_every=1000000", f"train.out_dir={out}"]


# The signal inside a cleanup callback while the loader is built (where numba's on_disposal ran in issue 46).
_CALLBACK_SCRIPT = """
import os, signal, sys, weakref
from ffcv_ddpm import train as t
real = t.make_loader
def make_loader(*a, **k):
    def callback():
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(1000):
            pass
    obj = type("Obj", (), {})()
    weakref.finalize(obj, callback)
    del obj
    return real(*a, **k)
t.make_loader = make_loader
sys.exit(t.main(sys.argv[1:]))
"""


def test_a_signal_inside_a_cleanup_callback_during_start_up_stops_the_run(beton, tmp_path):
    """Before the fix the trainer printed 'Exception ignored ... Interrupted: SIGTERM during start-up' and trained on
    (here: for a million steps)."""
    proc = subprocess.run([sys.executable, "-c", _CALLBACK_SCRIPT, *_trainer_args(beton, tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)  # `-c` imports from cwd
    assert proc.returncode == 128 + signal.SIGTERM, proc.stdout[-2000:] + proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "train: SIGTERM during start-up, before step 1; removed the run folder" in err[0], err
    assert list(tmp_path.iterdir()) == []


def _sigterm_handled(pid: int) -> bool:
    """Whether `pid` has a handler for SIGTERM yet (its SigCgt mask): from then on a signal is its to handle."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    except OSError:
        pass
    return False


def test_sigterm_anywhere_in_start_up_stops_the_run(beton, tmp_path):
    """SIGTERM at points spread over the whole start-up of `python -m ffcv_ddpm.train` (tiny, CPU): from the moment
    the process has a handler (the imports: seconds), and from the moment its run folder is complete (the loader and
    the model are built next, then the first step). Every try stops within the bound: exit 143 and its line, or, when
    the signal came after the last safe point of start-up, the checkpoint after step 1 and exit 0."""
    tries = [("handler", d) for d in (0.0, 1.0, 2.5)] + [("folder", d) for d in (0.0, 0.5, 1.2, 2.5)]
    bound_s = 120  # a loaded 2-core machine; a lost signal trains for a million steps
    results = [None] * len(tries)

    def one(i: int, event: str, delay: float) -> None:
        out = tmp_path / f"try{i}"
        with open(tmp_path / f"try{i}.out", "w") as log, open(tmp_path / f"try{i}.err", "w") as errs:
            proc = subprocess.Popen([sys.executable, "-m", "ffcv_ddpm.train", *_trainer_args(beton, out)], cwd=REPO,
                                    stdout=log, stderr=errs)
        try:
            ready = ((lambda: _sigterm_handled(proc.pid)) if event == "handler" else
                     (lambda: any(out.glob("*/environment.json"))))
            deadline = time.monotonic() + bound_s
            while not ready():
                assert proc.poll() is None and time.monotonic() < deadline, f"try {i}: never reached {event}"
                time.sleep(0.01)
            time.sleep(delay)
            proc.send_signal(signal.SIGTERM)
            sent = time.monotonic()
            rc = proc.wait(timeout=bound_s)
            results[i] = (rc, time.monotonic() - sent)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    threads = [threading.Thread(target=one, args=(i, *t)) for i, t in enumerate(tries)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    outcomes = []
    for i, ((event, delay), got) in enumerate(zip(tries, results)):
        out, err = (tmp_path / f"try{i}.out").read_text(), (tmp_path / f"try{i}.err").read_text()
        assert got is not None, f"try {i} ({event} + {delay} s) did not stop: {err[-2000:]}"
        rc, took = got
        assert "Traceback" not in err and "Exception ignored" not in err, err
        if rc == 0:
            assert "train: SIGTERM received; checkpoint written at step" in out, out[-2000:]
        else:
            assert rc == 128 + signal.SIGTERM, (rc, err[-2000:])
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("train: SIGTERM during start-up, before step 1"), lines
        outcomes.append(rc)
    assert outcomes.count(128 + signal.SIGTERM) >= len(tries) // 2, outcomes  # the points were in start-up


# ---- the commands that start children ----------------------------------------------------------------------------

def test_sigterm_stops_loaders_between_two_batches_and_its_workers(small_dataset, tmp_path, monkeypatch, capsys):
    """It exited -15 with no word. The signal comes while the loader is built; the first batch (from the torch
    DataLoader's worker process) is the safe point; the worker does not outlive the command."""
    from benchmarks.speed import loaders

    real = loaders.make_loader

    def make_loader(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(loaders, "make_loader", make_loader)
    before = set(_identities(psutil.Process().children(recursive=True)))
    rc = loaders.main(["--data", str(small_dataset), "--quick", "--loaders", "torch-memory", "--workers", "1",
                       "--out", str(tmp_path / "out")])
    assert rc == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines() == ["loaders: stopped by SIGTERM during torch-memory, 1 workers. "
                                                    "Kept: nothing."]
    deadline = time.monotonic() + 10
    while left := [p for p in _identities(psutil.Process().children(recursive=True)) if p not in before
                   and _running(*p)]:
        assert time.monotonic() < deadline, f"left running: {left}"
        time.sleep(0.1)



def _stop_command(cmd: list[str], ready, sig: int, tmp_path: Path, timeout: float = 300) -> tuple[int, str, list]:
    """Starts `cmd`, waits until ready(its descendants) holds, sends `sig` to it alone (`kill PID`, or Ctrl-C on a
    terminal, which reaches the command's process group: its children have groups of their own), waits for it.
    Returns (exit status, its stderr, the identities of every descendant seen before it exited)."""
    with open(tmp_path / "stdout.txt", "w") as out, open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=err)
    seen = set()
    try:
        root = psutil.Process(proc.pid)
        deadline = time.monotonic() + timeout
        while True:
            kids = root.children(recursive=True)
            seen.update(_identities(kids))
            if ready(kids):
                break
            assert proc.poll() is None, (tmp_path / "stderr.txt").read_text()[-3000:]
            assert time.monotonic() < deadline, "the command did not start its children in time"
            time.sleep(0.1)
        time.sleep(1.0)  # into their work
        seen.update(_identities(root.children(recursive=True)))
        proc.send_signal(sig)
        rc = proc.wait(timeout=60)  # the grace (10 s) and the kills are well inside this
    finally:
        if proc.poll() is None:
            for p in psutil.Process(proc.pid).children(recursive=True):
                p.kill()
            proc.kill()
            proc.wait()
    return rc, (tmp_path / "stderr.txt").read_text(), sorted(seen)


def _cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def _assert_stopped(rc: int, err: str, seen: list, sig: int, prefix: str) -> None:
    assert rc == 128 + sig, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(prefix) and ". Kept: " in last, last
    left = [pid for pid, started in seen if _running(pid, started)]
    assert not left and seen, f"left running: {left}"


def test_sigterm_stops_bench_and_its_rows_process(small_dataset, tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.speed.bench", "--table", "quick", "--data", str(small_dataset),
           "--rows", "1", "--iters", "1000000", "--warmup", "0", "--out", str(tmp_path / "out")]
    row = lambda kids: any("benchmarks.speed.jobs row" in _cmdline(p) for p in kids)  # noqa: E731
    rc, err, seen = _stop_command(cmd, row, signal.SIGTERM, tmp_path)
    _assert_stopped(rc, err, seen, signal.SIGTERM, "bench: stopped by SIGTERM during row 1 of 1 (tiny: baseline")


def test_ctrl_c_stops_ddp_torchrun_and_its_ranks(small_dataset, tmp_path):
    """SIGINT printed a KeyboardInterrupt traceback and left torchrun's ranks running."""
    cmd = [sys.executable, "-m", "benchmarks.speed.ddp", "--data", str(small_dataset), "--device", "cpu",
           "--preset", "tiny", "--gpus", "2", "--mode", "per-gpu", "data.batch_size=16", "--steps", "1000000",
           "--log-every", "2", "--out", str(tmp_path / "out")]
    ranks = lambda kids: sum("ffcv_ddpm.train" in _cmdline(p) for p in kids) >= 2  # noqa: E731
    rc, err, seen = _stop_command(cmd, ranks, signal.SIGINT, tmp_path)
    _assert_stopped(rc, err, seen, signal.SIGINT, "ddp: stopped by SIGINT during the point per-GPU, 2 process(es)")


def test_sigterm_stops_numerics_and_its_parallel_legs(small_dataset, tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.speed.numerics", "--data", str(small_dataset), "--preset", "tiny",
           "data.batch_size=16", "--log-every", "5", "train.device=cpu", "data.num_workers=1", "--steps", "1000000",
           "--parallel", "--out", str(tmp_path / "out")]
    legs = lambda kids: sum("ffcv_ddpm.train" in _cmdline(p) for p in kids) >= 2  # noqa: E731
    rc, err, seen = _stop_command(cmd, legs, signal.SIGTERM, tmp_path)
    _assert_stopped(rc, err, seen, signal.SIGTERM,
                    "numerics: stopped by SIGTERM during the legs (reference, candidate)")
    assert err.strip().splitlines()[-1].endswith("Kept: nothing.")  # the legs ran in a temporary folder
