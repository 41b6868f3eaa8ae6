"""What every benchmark shares: the dataset's file names, a synthetic dataset when none is there, the results folder,
atomic JSON, Markdown and PNG files, Markdown tables and the commit line of a report. What both rooms (benchmarks.speed,
benchmarks.quality) need lives here; what only one room shares stays in it (speed: rows, runner, report, flops, peaks;
quality: study).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ffcv_ddpm import stopping
from tools.atomic import Staged

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
BETON = "cifar10_train_raw.beton"  # what tools.make_dataset writes; the raw (uint8) train split
JPEG_BETON = "cifar10_train_jpg.beton"  # the same split, JPEG-encoded
PNG_TRAIN = Path("png") / "train"  # where `make dataset ... --export-png DATA/png` puts the Kaggle-layout folder


# --data of every command that builds a synthetic dataset when there is none (ensure_dataset).
DATA_HELP = "dataset folder (`make dataset`; a synthetic one is built there if it has none) or a train .beton file"
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


def dataset_files(data: Path) -> tuple[Path, tuple[Path, ...]]:
    """(the train .beton ensure_dataset(data) gives, the files it answers for: that .beton, which it requires or
    builds, and the JPEG one a synthetic build writes beside it). Looks only; a check before ensure_dataset runs
    leaves these to it."""
    data = Path(data)
    if data.suffix == ".beton":
        return data, (data,)
    beton = data / BETON
    return beton, ((beton,) if beton.is_file() else (beton, data / JPEG_BETON))


def ensure_dataset(data: Path, num_synthetic: int) -> tuple[Path, bool]:
    """(train .beton, built now?) for --data given as a dataset folder (its cifar10_train_raw.beton, a synthetic one
    built there first when missing) or as a .beton file (which must exist)."""
    data = Path(data)
    beton, _ = dataset_files(data)
    if data.suffix == ".beton":
        if not data.is_file():
            raise BenchError(f"--data {data} does not exist; run `make dataset` or give a dataset folder")
        return data, False
    if beton.is_file():
        return beton, False
    print(f"bench: NOTE: no {BETON} in {data}/, so building a SYNTHETIC dataset there first "
          f"({num_synthetic} images, tools.make_dataset --source synthetic). Its numbers measure speed only; "
          "run `make dataset` for CIFAR-10.", flush=True)
    cmd = [sys.executable, "-m", "tools.make_dataset", "--source", "synthetic", "--out", str(data),
           "--num-synthetic", str(num_synthetic), "--num-synthetic-test", str(max(64, num_synthetic // 5))]
    if stopping.run(cmd, cwd=REPO).returncode != 0 or not beton.is_file():  # a signal stops it with the command
        raise BenchError(f"building the synthetic dataset failed (command: {' '.join(cmd)})")
    return beton, True


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
