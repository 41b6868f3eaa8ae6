"""What the study commands (digits, sde, compress, fid) share: signals, training inside a study, and how a
study command ends.

    def main(argv):
        args = parse_args(argv)                            # every option checked before anything runs
        return run_study("digits", lambda stop: run(args, argv, stop))

    run_dir = train_run(cfg, stop)                         # a training phase of the study
    with saved_when_stopped(stop, result, save): ...       # the report says it was stopped, once more

A signal (SIGTERM, SIGINT = Ctrl-C) stops the whole command, not only its training phase. Outside training it stops
at once. During a training run the trainer's rules hold (ffcv_ddpm.train.StopRequest: the first signal checkpoints
and returns, a second stops at once), and then the study stops too: a study cannot continue a run cut short, so that
run folder is removed rather than left half-made. The last message says what stopped it and what stays on disk
(`stop.kept`), and the exit status is 128 + the signal's number. Bad input and failed trainings end in one line and
exit 2, as in every command.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import sys
from pathlib import Path
from typing import Callable

from benchmarks.common import BenchError
from ffcv_ddpm.checks import fail
from ffcv_ddpm.step import TrainingError
from ffcv_ddpm.train import Interrupted, StopRequest, train


class StudyStop(StopRequest):
    """The trainer's StopRequest for a whole study: its "start-up" phase (a signal stops at once) is every moment
    outside a training run, and `where` names what the study was doing."""

    def __init__(self):
        super().__init__()
        self.where = "start-up"  # what the study is doing, for the message of a signal
        self.kept: dict[str, str] = {}  # what stays on disk if the study stops now (key: what, value: the words)

    def _handle(self, signum, frame):
        if self.phase == "start-up":
            raise Interrupted(signum, f"during {self.where}")
        super()._handle(signum, frame)


def train_run(cfg, stop: StudyStop) -> Path:
    """train(cfg) as one phase of a study: the folder of the complete run. A signal during it raises Interrupted
    after the trainer is done with it, and the run's folder is removed (see the module docstring)."""
    stop.where, stop.signal, stop.run_dir = f"training ({cfg.train.desc or cfg.preset})", None, None
    try:
        run_dir = train(cfg, stop=stop)
        if stop.signal is not None:  # the trainer wrote its checkpoint and returned: the study ends here
            raise Interrupted(signal.Signals[stop.signal].value, "")
    except Interrupted as e:
        removed = ""
        if stop.run_dir is not None and stop.run_dir.exists():
            shutil.rmtree(stop.run_dir, ignore_errors=True)
            removed = f"; removed its unfinished run folder {stop.run_dir}"
        raise Interrupted(e.signum, f"during {stop.where}{removed}") from None
    finally:
        stop.phase = "start-up"  # between and after training runs a signal stops the study at once
    return run_dir


@contextlib.contextmanager
def saved_when_stopped(stop: StudyStop, result: dict, save: Callable[[], None]):
    """A signal inside the block: result["stopped"] says so, `save()` writes the report once more (further signals
    wait for it), and the study goes on stopping."""
    try:
        yield
    except Interrupted as e:
        stop.phase = "stopping"
        result["stopped"] = str(e)
        save()
        raise


def run_study(prog: str, body: Callable[[StudyStop], object]) -> int:
    """body(stop) under StudyStop; the exit status: 0 done, 2 bad input or a failed training (one line),
    128 + signal when a signal stopped it (one line: what stopped it, what was kept)."""
    stop = StudyStop()
    try:
        body(stop)
    except (BenchError, TrainingError, ValueError, FileNotFoundError, OSError) as e:
        stop.phase = "stopping"
        return fail(prog, str(e))
    except Interrupted as e:
        stop.phase = "stopping"
        kept = "; ".join(stop.kept.values()) or "nothing"
        print(f"{prog}: stopped by {e}. Kept: {kept}.", file=sys.stderr, flush=True)
        return 128 + e.signum
    finally:
        stop.phase = "stopping"
        stop.restore()
    return 0
