"""What the study commands (digits, sde, compress, fid) share: signals, training inside a study, and how a
study command ends.

    def main(argv):
        args = parse_args(argv)                            # every option checked before anything runs
        return run_study("digits", lambda stop: run(args, argv, stop))

    stop.doing("sampling")                                 # a safe point; what the study does from here
    run_dir = train_run(cfg, stop)                         # a training phase of the study
    with saved_when_stopped(stop, result, save): ...       # the report says it was stopped, once more
    stop.done()                                            # measured: the last save completes whatever comes

A signal (SIGTERM, SIGINT = Ctrl-C) stops the whole command, not only its training phase (ffcv_ddpm.stopping: the
handler records it; the study stops at its next safe point: stop.doing(), stop.check() at each row, the end of a
training run). During a training run the trainer's rules hold (ffcv_ddpm.train.StopRequest: the first signal
checkpoints and returns, a second stops at once), and then the study stops too: a study cannot continue a run cut
short, so that run folder is removed rather than left half-made. The last message says what stopped it and what
stays on disk (`stop.kept`), and the exit status is 128 + the signal's number. Bad input and failed trainings end in
one line and exit 2, as in every command.
"""

from __future__ import annotations

import contextlib
import shutil
from pathlib import Path
from typing import Callable

from benchmarks.common import BenchError
from ffcv_ddpm.step import TrainingError
from ffcv_ddpm.stopping import Interrupted, Stop, run_command
from ffcv_ddpm.train import train


class StudyStop(Stop):
    """A study's Stop (ffcv_ddpm.stopping): its "start-up" phase (the next safe point stops the study) is every moment
    outside a training run, and `where` names what the study was doing."""

    def __init__(self, prog: str = "study"):
        super().__init__(prog)


def train_run(cfg, stop: Stop) -> Path:
    """train(cfg) as one phase of a study: the folder of the complete run. A signal during it raises Interrupted
    after the trainer is done with it, and the run's folder is removed (see the module docstring)."""
    stop.doing(f"training ({cfg.train.desc or cfg.preset})")
    stop.run_dir = None
    try:
        run_dir = train(cfg, stop=stop)
        stop.phase = "start-up"
        stop.check()  # the trainer wrote its checkpoint and returned on a signal: the study ends here
    except Interrupted as e:
        removed = ""
        if stop.run_dir is not None and stop.run_dir.exists():
            shutil.rmtree(stop.run_dir, ignore_errors=True)
            removed = f"; removed its unfinished run folder {stop.run_dir}"
        raise Interrupted(e.signum, f"during {stop.where}{removed}") from None
    finally:
        stop.phase = "start-up"  # between and after training runs a signal stops the study at its next safe point
    return run_dir


@contextlib.contextmanager
def saved_when_stopped(stop: Stop, result: dict, save: Callable[[], None]):
    """A signal inside the block: result["stopped"] says so, `save()` writes the report once more (further signals
    wait for it), and the study goes on stopping."""
    try:
        yield
    except Interrupted as e:
        stop.phase = "stopping"
        result["stopped"] = str(e)
        save()
        raise


def run_study(prog: str, body: Callable[[Stop], None]) -> int:
    """body(stop) under the command's Stop; the exit status: 0 done, 2 bad input or a failed training (one line),
    128 + signal when a signal stopped it (one line: what stopped it, what was kept)."""
    return run_command(prog, body, errors=(BenchError, TrainingError, ValueError, FileNotFoundError, OSError))
