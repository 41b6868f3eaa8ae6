"""What every benchmark shares: the dataset's file names, a synthetic dataset when none is there, the results folder
(and its lock), atomic JSON, Markdown and PNG files, Markdown tables and the commit line of a report. What both rooms
(benchmarks.speed, benchmarks.quality) need lives here; what only one room shares stays in it (speed: rows, runner,
report, flops, peaks; quality: study).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ffcv_ddpm.checks import BadValue, check_input, check_out_dir
from ffcv_ddpm import stopping
from tools.atomic import Staged

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
BETON = "cifar10_train_raw.beton"  # what tools.make_dataset writes; the raw (uint8) train split
JPEG_BETON = "cifar10_train_jpg.beton"  # the same split, JPEG-encoded
PNG_TRAIN = Path("png") / "train"  # where `make dataset ... --export-png DATA/png` puts the Kaggle-layout folder


# The quick start's dataset folder, the one --data folder that is made when it does not exist (a typo elsewhere,
# --data dat, must not become a new synthetic dataset). Recognised by where it is, not by whether --data was typed:
# `make bench` and the README's `--data data` are the quick start too.
DEFAULT_DATA = Path("data")
# --data of every command that builds a synthetic dataset when there is none (ensure_dataset).
DATA_HELP = (f"dataset folder (`make dataset`) or a train .beton file; a folder without one gets a synthetic dataset "
             f"(one that does not exist: only {DEFAULT_DATA}/, the quick start)")
DEVICE_HELP = "auto | cpu | cuda | cuda:N (as train.device)"


class BenchError(Exception):
    """A user-facing problem (bad arguments, missing data); printed as one line without a traceback."""


def results_dir(device_name: str | None) -> Path:
    """benchmarks/results/<card>/ (`cpu` without CUDA), where a benchmark writes unless told --out."""
    from benchmarks.speed.peaks import card_slug

    return RESULTS / card_slug(device_name)


def results_here() -> Path:
    """results_dir of the card this process sees (the first CUDA device; `cpu` without one): the Makefile's default
    --out for a command that requires one."""
    import torch

    return results_dir(torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)


def results_out(out: Path | None, device_name: str | None, sub: str = "") -> Path:
    """Where a benchmark writes: --out, else benchmarks/results/<card>/<sub>; checked writable (check_out_dir)
    before the work whose result goes there (BenchError if not), and created by the writer."""
    path = out or results_dir(device_name) / sub
    try:
        check_out_dir(path, "--out" if out else "the results folder")
    except BadValue as e:
        raise BenchError(str(e)) from None
    return path


def dataset_files(data: Path) -> tuple[Path, tuple[Path, ...]]:
    """(the train .beton ensure_dataset(data) gives, the files it answers for: that .beton, which it requires or
    builds, and the JPEG one a synthetic build writes beside it). Looks only; a check before ensure_dataset runs
    leaves these to it."""
    data = Path(data)
    if data.suffix == ".beton":
        return data, (data,)
    beton = data / BETON
    return beton, ((beton,) if beton.is_file() else (beton, data / JPEG_BETON))


def check_data(data: Path) -> None:
    """--data is a train .beton, a folder holding cifar10_train_raw.beton, or a folder ensure_dataset may build one in
    (an existing folder, or the quick start's data/: writable); BenchError otherwise. Looks only: run before any
    work."""
    data = Path(data)
    beton, _ = dataset_files(data)
    try:
        if data.suffix == ".beton":
            check_input(data, "--data", "file", "run `make dataset` or give a dataset folder")
        elif not beton.is_file():
            if data.resolve() != DEFAULT_DATA.resolve():
                check_input(data, "--data", "folder", f"make it with `make dataset OUT={data}`, or leave --data out "
                                                      f"for the quick start's synthetic dataset in {DEFAULT_DATA}/")
            check_out_dir(data, "--data")  # the synthetic dataset is written there
    except BadValue as e:
        raise BenchError(str(e)) from None


def ensure_dataset(data: Path, num_synthetic: int) -> tuple[Path, bool]:
    """(train .beton, built now?) for --data given as a dataset folder (its cifar10_train_raw.beton, a synthetic one
    built there first when missing; a folder that does not exist only if it is the quick start's data/) or as a
    .beton file (which must exist)."""
    data = Path(data)
    beton, _ = dataset_files(data)
    check_data(data)
    if data.suffix == ".beton" or beton.is_file():
        return beton, False
    from tools.cifar10 import DatasetError
    from tools.make_dataset import check_one_dataset

    try:  # a digits folder, say: CIFAR-10 files and manifest written into it would make it hold two
        check_one_dataset(data, "cifar10", f"a synthetic build for --data (the speed benchmarks read {BETON})")
    except DatasetError as e:
        raise BenchError(str(e)) from None
    print(f"bench: NOTE: no {BETON} in {data}/, so building a SYNTHETIC dataset there first "
          f"({num_synthetic} images, tools.make_dataset --source synthetic). Its numbers measure speed only; "
          "run `make dataset` for CIFAR-10.", flush=True)
    cmd = [sys.executable, "-m", "tools.make_dataset", "--source", "synthetic", "--out", str(data.absolute()),
           "--num-synthetic", str(num_synthetic), "--num-synthetic-test", str(max(64, num_synthetic // 5))]
    if stopping.run(cmd, cwd=REPO).returncode != 0 or not beton.is_file():  # a signal stops it with the command
        raise BenchError(f"building the synthetic dataset failed (command: {' '.join(cmd)})")
    return beton, True


def lock_output(folder: Path) -> None:
    """`folder` (made if missing) is this command's output folder alone until ffcv_ddpm.folder_lock.unlock_folder or
    the process's end: two commands writing one folder at once would each time the other's load, and the last to
    finish would replace the other's files. BenchError (one line, naming the other's pid) if another holds it."""
    from ffcv_ddpm.folder_lock import FolderInUse, lock_folder

    folder.mkdir(parents=True, exist_ok=True)
    try:
        lock_folder(folder)
    except FolderInUse as e:
        raise BenchError(str(e)) from None


def write_text(path: Path, text: str) -> None:
    """The whole file or nothing (a temp name, fsync, rename): a run stopped mid-write keeps the previous file."""
    with Staged() as staged:
        staged.path(path).write_text(text)
        staged.commit()


def write_json(path: Path, obj, indent: int = 1) -> None:
    write_text(path, json.dumps(obj, indent=indent, default=str) + "\n")


def pyplot():
    """matplotlib.pyplot drawing to files only (the Agg backend: no display on a GPU machine), imported on first use
    so that a command that draws nothing never pays for it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, dpi: int) -> Path:
    """`fig` as a PNG at `path`, whole or not at all (as write_text), then closed."""
    with Staged() as staged:
        fig.savefig(staged.path(path), dpi=dpi, format="png")
        staged.commit()
    pyplot().close(fig)
    return path


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def commit_text(env: dict, width: int = 10) -> str:
    """The commit as a report prints it: shortened, '(dirty)', or '(declared, not verified)' when it came from
    FFCV_DDPM_COMMIT rather than from git (ffcv_ddpm.env.git_state)."""
    commit = env.get("commit")
    if not commit:
        return "unknown"
    note = (" (declared, not verified)" if str(env.get("commit_source", "")).startswith("declared")
            else " (dirty)" if env.get("dirty") else "")
    return commit[:width] + note


def parse_variant(text: str, example: str) -> tuple[str, tuple[str, ...]]:
    """--variant NAME:KEY=VALUE[,KEY=VALUE...] (benchmarks.speed.levers, benchmarks.speed.ddp) as (name, overrides);
    ValueError saying what to write, with `example`. Spaces separate overrides, and so does a comma before the next
    KEY=: a value may hold commas (model.norm_plan=1024,16384,4)."""
    import re

    name, sep, rest = text.partition(":")
    overrides = tuple(o for part in rest.split() for o in re.split(r",(?=[A-Za-z_][\w.]*=)", part) if o)
    if not sep or not name.strip() or not overrides or not all("=" in o for o in overrides):
        raise ValueError(f"--variant {text!r}: write NAME:KEY=VALUE[,KEY=VALUE...], e.g. {example}")
    return name.strip(), overrides
