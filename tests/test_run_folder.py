"""A run folder that no failure breaks or silently rewrites (issue 46), on the CPU with the tiny preset: a resume
that cannot continue the run is refused in one line and leaves the folder as it was; damaged checkpoints are set
aside; one trainer per run folder (and one benchmark per output folder), a dead one's lock taken over."""

import dataclasses
import hashlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, hold_lock, write_beton
from ffcv_ddpm import train as train_mod
from ffcv_ddpm.checkpoint import list_checkpoints
from ffcv_ddpm.folder_lock import LOCK_NAME, FolderInUse, lock_folder, unlock_folder
from ffcv_ddpm.unet import PRESETS
from test_train import read_stats, tiny_cfg

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def beton(small_dataset) -> Path:
    return small_dataset / "cifar10_train_raw.beton"  # with the manifest make_dataset writes beside it


# The runs here read the dataset into memory, in the trainer's process: FFCV's pipeline compiles for a second or more
# in every loader on a CPU (every resume builds one), and the run folder is what these tests check (tests/test_train.py
# resumes FFCV's). No loader worker process either: one holds the lock's file open until it sees its trainer gone
# (torch's DataLoader looks every 5 s), and the lock test resumes a killed trainer's run at once.
MEMORY = ("data.loader=torch-memory", "data.num_workers=0")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, beton) -> Path:
    """A complete 6-step run: stats at steps 2, 4, 6; checkpoints at 4 and 6."""
    return train_mod.train(tiny_cfg(beton, tmp_path_factory.mktemp("runs"), "train.steps=6", *MEMORY))


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of `trained` for one test to change."""
    return Path(shutil.copytree(trained, tmp_path / trained.name))


def snapshot(folder: Path) -> dict:
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns) for p in folder.iterdir()}


def resume(capsys, run: Path, *args: str) -> tuple[int, str, list[str]]:
    """train's command line on `run`: (exit status, stdout, stderr's lines)."""
    capsys.readouterr()  # what came before
    rc = train_mod.main(["--resume", str(run), *args])
    out, err = capsys.readouterr()
    return rc, out, [line for line in err.splitlines() if line.strip()]


def steps(folder: Path) -> list[int]:
    return [int(p.stem.split("-")[1]) for p in list_checkpoints(folder)]


def test_trained_run(trained):
    assert steps(trained) == [4, 6] and [s["step"] for s in read_stats(trained)] == [2, 4, 6]
    assert not (trained / LOCK_NAME).exists()  # the lock goes with the run


# ---- resume: refused in one line before anything is written -----------------------------------------------------

def test_a_shape_changing_override_is_refused_and_the_run_still_resumes(run, capsys):
    before = snapshot(run)
    rc, _, err = resume(capsys, run, "model.base_channels=16", "train.steps=8")
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("train: error: model.base_channels=16 (the run's: 8) changes the model's weights"), err
    assert snapshot(run) == before  # config.json above all: the override was not written into it
    rc, out, err = resume(capsys, run, "train.steps=8")
    assert rc == 0 and err == [] and "resumed from" in out
    assert [s["step"] for s in read_stats(run)] == [2, 4, 6, 8] and steps(run)[-1] == 8


def test_weights_change_names_only_what_changes_the_weights():
    tiny = PRESETS["tiny"]
    assert train_mod.weights_change(tiny, dataclasses.replace(tiny, dropout=0.1, attn_impl="math")) is None
    words = train_mod.weights_change(tiny, dataclasses.replace(tiny, num_classes=10))
    assert words.startswith("model.num_classes=10 (the run's: 0) changes the model's weights") and "absent" in words


@pytest.mark.parametrize("args,words", [
    (("train.steps=4",), "train.steps=4 is below step 6 of"),
    (("--preset", "ddpm-cifar10", "train.steps=8"), "preset 'ddpm-cifar10': "),
    (("--data", "OTHER", "train.steps=8"), "data.path=OTHER: "),
])
def test_a_resume_that_contradicts_the_run_is_refused(args, words, run, tmp_path, capsys):
    other = write_beton(tmp_path / "other.beton", 64, seed=3)  # other images, same shape
    args = [str(other) if a == "OTHER" else a for a in args]
    before = snapshot(run)
    rc, _, err = resume(capsys, run, *args)
    assert rc == 2 and len(err) == 1 and words.replace("OTHER", str(other)) in err[0], err
    assert snapshot(run) == before


def test_the_same_data_moved_to_another_folder_is_accepted(run, small_dataset, tmp_path, capsys):
    moved = Path(shutil.copytree(small_dataset, tmp_path / "moved"))  # the same files: their manifest says so
    rc, out, err = resume(capsys, run, "--data", str(moved), "train.steps=8")
    assert rc == 0 and err == [], err
    assert json.loads((run / "config.json").read_text())["data"]["path"] == str(moved / "cifar10_train_raw.beton")


def test_a_finished_run_says_so_and_changes_nothing(run, capsys):
    before = snapshot(run)
    rc, out, err = resume(capsys, run)
    assert rc == 0 and err == []
    (line,) = [line for line in out.splitlines() if "complete" in line]
    assert line == (f"train: {run} is complete: its newest checkpoint, ckpt-00000006.pt, is at train.steps=6; "
                    "nothing to do (a larger train.steps trains on)")
    assert snapshot(run) == before


# ---- damaged checkpoints --------------------------------------------------------------------------------------

def test_a_damaged_newest_checkpoint_is_set_aside_and_costs_no_good_one_its_slot(run, capsys):
    newest = run / "ckpt-00000006.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # as a disk that filled up elsewhere leaves it
    rc, out, err = resume(capsys, run, "train.steps=8", "train.keep_ckpts=2")
    assert rc == 0 and err == [], err
    assert "renamed to ckpt-00000006.pt.corrupt" in out and "at step 4" in out
    # keep_ckpts=2 over 4, 8 and the damaged 6 would have deleted 4 and kept the one that does not load.
    assert steps(run) == [4, 8] and (run / "ckpt-00000006.pt.corrupt").is_file()
    assert [s["step"] for s in read_stats(run)] == [2, 4, 6, 8]


def test_a_run_whose_checkpoints_all_fail_to_load_is_refused_not_restarted(run, capsys):
    for path in list_checkpoints(run):
        path.write_bytes(b"not a checkpoint")
    kept = {name: (run / name).read_text() for name in ("config.json", "stats.jsonl", "environment.json")}
    for attempt in ("first", "again"):  # again: its checkpoints set aside, the run still is not started anew
        rc, _, err = resume(capsys, run, "train.steps=8")
        assert rc == 2 and len(err) == 1, err
        assert f"no checkpoint of {run} loads" in err[0] and "not started again from step 0" in err[0], err
        assert ("set aside before" in err[0]) == (attempt == "again")
        assert {name: (run / name).read_text() for name in kept} == kept
    assert list_checkpoints(run) == [] and len(list(run.glob("ckpt-*.pt.corrupt"))) == 2


def test_fp16_on_a_cpu_is_refused_before_the_run_folder_exists(beton, tmp_path, capsys):
    out = tmp_path / "runs"
    rc = train_mod.main(["--preset", "tiny", "--data", str(beton), "train.device=cpu", "train.precision=fp16",
                         f"train.out_dir={out}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["train: error: train.precision=fp16 needs a CUDA GPU (GradScaler); use bf16 or fp32 "
                               "on CPU"]
    assert not out.exists()


# ---- one writer per folder ------------------------------------------------------------------------------------

def test_a_folder_lock_names_its_holder_and_is_taken_over_when_it_dies(tmp_path):
    holder = hold_lock(tmp_path)
    try:
        with pytest.raises(FolderInUse, match=rf"{tmp_path} is in use by process {holder.pid} "):
            lock_folder(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert (tmp_path / LOCK_NAME).read_text().strip() == str(holder.pid)  # kill -9 left its file behind
    lock_folder(tmp_path)  # the kernel let go of the dead process's lock: ours now
    assert (tmp_path / LOCK_NAME).read_text().strip() != str(holder.pid)
    unlock_folder(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_resuming_a_run_that_is_still_training_is_refused(beton, tmp_path, capsys):
    proc = subprocess.Popen(
        [sys.executable, "-m", "ffcv_ddpm.train", "--preset", "tiny", "--data", str(beton), "data.batch_size=8",
         *MEMORY, "train.device=cpu", "train.precision=fp32", "train.progress=False",
         "train.sample_every=0", "train.steps=100000", "train.log_every=1", "train.ckpt_every=2",
         f"train.out_dir={tmp_path}"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (runs := list(tmp_path.glob("00000-*"))) or not list_checkpoints(runs[0]):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.05)
        # train.steps=1: the lock is checked first; without one, this would not train on (the run is past step 1).
        rc, _, err = resume(capsys, runs[0], "train.steps=1")
        assert rc == 2 and len(err) == 1 and f"in use by process {proc.pid} " in err[0], err
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stderr.close()
    last = steps(runs[0])[-1]  # then the trainer is gone, its lock file left behind: taken over
    rc, _, err = resume(capsys, runs[0], f"train.steps={last + 2}")
    assert rc == 0 and err == [], err
    logged = [s["step"] for s in read_stats(runs[0])]
    assert logged == list(range(1, last + 3)) and not (runs[0] / LOCK_NAME).exists()
