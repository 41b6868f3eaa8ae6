"""Write CIFAR-10 (or handwritten digits) as FFCV .beton files (train/test x raw/JPEG) plus manifest.json;
optionally a PNG folder.

    python -m tools.make_dataset --source download --out data            # official tarball, MD5-checked
    python -m tools.make_dataset --source tarball --tarball cifar-10-python.tar.gz
    python -m tools.make_dataset --source png --png-dir kaggle_cifar10/    # train/1.png ... + trainLabels.csv
    python -m tools.make_dataset --source synthetic --num-synthetic 256 --num-synthetic-test 64 --out /tmp/d
    python -m tools.make_dataset --source synthetic --export-png data/png  # also the PNG-folder layout
    python -m tools.make_dataset --source digits                         # scikit-learn's digits -> data/digits/
    python -m tools.make_dataset --source mnist --mnist-dir ~/mnist       # MNIST's IDX files -> data/mnist/

CIFAR-10 sources write cifar10_{train,test}_{raw,jpg}.beton (default folder data/); digits and mnist write
digits_* / mnist_* into data/digits and data/mnist, so that each folder's manifest describes one dataset.

Every output appears under its final name only when complete (temp name in the same folder, fsync, rename), and a
second run with the same inputs and settings checks the files against the manifest and does nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import platform
import sys
import threading
import time
from pathlib import Path

from ffcv_ddpm.checks import Parser, at_least, fail, in_range, matches, option
from tools.atomic import (Staged, abort_cleanly, release_locks, remove_stale_partials,
                          remove_stale_segments, write_json)
from tools.cifar10 import (CIFAR10_MD5, CIFAR10_URL, TARBALL_NAME, ImageDataset, DatasetError, export_png_dir,
                           load_source, png_fingerprint, synthetic_fingerprint, synthetic_spec, tarball_fingerprint)
from tools.digits import (DIGITS_PREPROCESS, DIGITS_SPLIT, MNIST_PREPROCESS, digits_fingerprint, load_digits,
                          load_mnist, mnist_fingerprint)

TOOL_VERSION = "1"  # bump when the written files change for the same input: old manifests then trigger a rebuild
MANIFEST = "manifest.json"
EXPORT_MARKER = "export.json"
SPLITS = ("train", "test")
WRITE_MODES = ("raw", "jpg")
SOURCES = ("download", "tarball", "png", "synthetic", "digits", "mnist")
DIGIT_SOURCES = ("digits", "mnist")  # each its own dataset name, files and default folder; the rest are CIFAR-10
PAGE_SIZE = 1 << 23  # FFCV's default .beton page (8 MiB)


def dataset_name(source: str) -> str:
    return source if source in DIGIT_SOURCES else "cifar10"


def beton_name(split: str, write_mode: str, dataset: str = "cifar10") -> str:
    return f"{dataset}_{split}_{write_mode}.beton"


def beton_files(dataset: str = "cifar10") -> tuple[str, ...]:
    return tuple(beton_name(s, m, dataset) for s in SPLITS for m in WRITE_MODES)


BETON_FILES = beton_files()
DATASETS = tuple(dict.fromkeys(map(dataset_name, SOURCES)))  # cifar10, digits, mnist: the files' name prefixes


def held_datasets(folder: Path) -> dict[str, str]:
    """{dataset: the file that says so} for each dataset `folder` holds: its manifest's, and any whose .beton files
    are there (a folder an older version wrote two into has both)."""
    held = {}
    manifest = folder / MANIFEST
    try:
        recorded = json.loads(manifest.read_text())
    except (OSError, ValueError):
        recorded = None  # none, or unreadable: the .beton names still tell
    if isinstance(recorded, dict) and recorded.get("source") in SOURCES:
        held[recorded.get("dataset") or dataset_name(recorded["source"])] = str(manifest)
    for dataset in DATASETS:
        if dataset not in held and (found := [n for n in beton_files(dataset) if (folder / n).is_file()]):
            held[dataset] = str(folder / found[0])
    return held


def check_one_dataset(folder: Path, dataset: str, writer: str) -> None:
    """DatasetError (one line) if `folder` holds a dataset other than `dataset`, which `writer` would write there:
    a folder holds one dataset, so that its manifest describes its files and --data finds one train .beton."""
    others = {d: why for d, why in held_datasets(folder).items() if d != dataset}
    if others:
        held = ", ".join(f"{d} ({why})" for d, why in others.items())
        raise DatasetError(f"{folder} holds another dataset, {held}; {writer} would write {dataset} beside it, and a "
                           f"folder holds one dataset: give {dataset} a folder of its own")


def default_workers() -> int:
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def _holdout(text: str) -> str:
    """--png-holdout, checked but kept as the text given (the manifest records it)."""
    option(float, matches("a fraction in (0, 1) or a whole count >= 1",
                          lambda v: 0 < v < 1 or (v >= 1 and v == int(v))))(text)
    return text


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(prog="python -m tools.make_dataset", doc=__doc__,
               epilog="This command writes the dataset folder (--out) that the others read with --data; it takes no "
                      "KEY=VALUE overrides (no run config).")
    p.add_argument("--source", choices=SOURCES, default="download", help="where the images come from")
    p.add_argument("--out", type=Path, help="folder for the .beton files and manifest (default: data, or "
                                            "data/digits and data/mnist for those sources)")
    p.add_argument("--jpeg-quality", type=option(int, in_range(1, 100)), default=90,
                   help="JPEG quality (1-100) of the *_jpg.beton files")
    p.add_argument("--tarball", type=Path, help=f"local {TARBALL_NAME} (--source tarball)")
    p.add_argument("--png-dir", type=Path, help="Kaggle-layout PNG folder (--source png)")
    p.add_argument("--mnist-dir", type=Path, help="folder of MNIST's four IDX files, plain or .gz (--source mnist)")
    p.add_argument("--png-holdout", type=_holdout, default="0.2",
                   help="PNG folder without test/ + testLabels.csv: test = the last N train images (a count) or "
                        "this fraction of them (0.2 of Kaggle's 50,000 = 10,000)")
    p.add_argument("--num-synthetic", type=option(int, at_least(1)), default=50_000, help="synthetic train images")
    p.add_argument("--num-synthetic-test", type=option(int, at_least(1)), default=10_000, help="synthetic test images")
    p.add_argument("--seed", type=option(int, at_least(0)), default=0, help="synthetic data seed")
    p.add_argument("--export-png", type=Path, metavar="DIR",
                   help="also write the images in the Kaggle PNG layout (train/1.png ... + trainLabels.csv, "
                        "test/ + testLabels.csv) for the PyTorch-DataLoader baseline")
    p.add_argument("--workers", type=option(int, at_least(1)), default=default_workers(),
                   help="processes for decoding and writing")
    p.add_argument("--force", action="store_true", help="rebuild even if the manifest says the files are current")
    p.add_argument("--url", default=CIFAR10_URL, help="download URL (a mirror of the same file: MD5 is checked)")
    args = p.parse_args(argv)
    if args.tarball is not None and args.source != "tarball":
        p.error(f"--tarball (CIFAR=) is only read with --source tarball, not {args.source}")
    if args.png_dir is not None and args.source != "png":
        p.error(f"--png-dir (PNG_DIR=) is only read with --source png, not {args.source}")
    if args.mnist_dir is not None and args.source != "mnist":
        p.error(f"--mnist-dir (MNIST_DIR=) is only read with --source mnist, not {args.source}")
    if args.export_png is not None and args.source in DIGIT_SOURCES:
        p.error("--export-png writes CIFAR-10's Kaggle layout (class names in the CSV); not for digit sources")
    if args.out is None:
        args.out = Path("data") / (args.source if args.source in DIGIT_SOURCES else "")
    # Every path before any work: a bad one used to fail after the four .beton files were written (--export-png), or
    # leave an empty --out folder behind (it was made first).
    p.check_paths(inputs=[("--tarball", args.tarball, "file", f"CIFAR= must point to {TARBALL_NAME}"),
                          ("--png-dir", args.png_dir, "folder"),
                          ("--mnist-dir", args.mnist_dir, "folder")],
                  outputs=[("--out", args.out), ("--export-png", args.export_png),
                           ("--export-png", args.export_png and args.export_png.parent)])  # replaced there
    return args


# ---------------------------------------------------------------------------------------------------------------
# Files that appear complete or not at all

def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------------
# What a run would produce, and whether the files on disk already are that

def input_fingerprint(args) -> str:
    """Identity of the input, computed without decoding it."""
    if args.source == "download":
        return f"md5:{CIFAR10_MD5}"  # the official file: its MD5 is checked on download
    if args.source == "tarball":
        if args.tarball is None:
            raise DatasetError("--source tarball needs a file: make dataset CIFAR=/path/to/cifar-10-python.tar.gz")
        return tarball_fingerprint(args.tarball)
    if args.source == "png":
        if args.png_dir is None:
            raise DatasetError("--source png needs a folder: make dataset PNG_DIR=/path/to/folder")
        return png_fingerprint(args.png_dir)
    if args.source == "digits":
        return digits_fingerprint()
    if args.source == "mnist":
        if args.mnist_dir is None:
            raise DatasetError("--source mnist needs a folder: make dataset SOURCE=mnist MNIST_DIR=/path/to/idx-files")
        return mnist_fingerprint(args.mnist_dir)
    return synthetic_fingerprint(synthetic_spec(args.num_synthetic, args.num_synthetic_test, args.seed))


def wanted_state(args, fingerprint: str) -> dict:
    """Everything that decides the content of the files: equal states mean a rebuild would write the same data."""
    settings = {"jpeg_quality": args.jpeg_quality, "page_size": PAGE_SIZE,
                "fields": {"image": "RGBImageField (raw | jpg)", "label": "IntField"}}
    if args.source == "png":
        settings["png_holdout"] = str(args.png_holdout)
    if args.source == "digits":
        settings.update(split=DIGITS_SPLIT, preprocess=DIGITS_PREPROCESS)
    if args.source == "mnist":
        settings["preprocess"] = MNIST_PREPROCESS
    return {"tool_version": TOOL_VERSION, "source": args.source, "synthetic": args.source == "synthetic",
            "input_fingerprint": fingerprint, "settings": settings}


def _first_difference(have: dict, want: dict, prefix: str = "") -> str | None:
    """'settings.jpeg_quality changed: 90 -> 75' for the first key of `want` whose value `have` does not share."""
    for key, value in want.items():
        old = have.get(key)
        if isinstance(value, dict) and isinstance(old, dict):
            if (diff := _first_difference(old, value, f"{prefix}{key}.")) is not None:
                return diff
        elif old != value:
            return f"{prefix}{key} changed: {old!r} -> {value!r}"
    return None


def why_stale(out: Path, wanted: dict) -> str | None:
    """None if the manifest in `out` matches `wanted` and every file matches its recorded sha256; else the reason."""
    path = out / MANIFEST
    if not path.is_file():
        return f"no {MANIFEST} in {out}"
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        return f"{path} is unreadable ({e})"
    if (diff := _first_difference(manifest, wanted)) is not None:
        return diff
    for name in beton_files(dataset_name(wanted["source"])):
        entry = manifest.get("files", {}).get(name)
        if entry is None or not (out / name).is_file():
            return f"{name} is missing"
        if sha256_file(out / name) != entry.get("sha256"):
            return f"{name} does not match its sha256 in {MANIFEST} (changed or damaged)"
    return None


# ---------------------------------------------------------------------------------------------------------------

def convert(data: ImageDataset, out: Path, wanted: dict, jpeg_quality: int, workers: int, read_s: float) -> dict:
    """Write the four .beton files (all or none) and then the manifest describing them; returns the manifest."""
    from tools.ffcv_writer import write_beton  # noqa: PLC0415 (imports FFCV and torch: only when writing)
    t0 = time.perf_counter()
    files = {}
    with Staged() as staged:
        for split_name in SPLITS:
            split = getattr(data, split_name)
            for mode in WRITE_MODES:
                name = beton_name(split_name, mode, dataset_name(wanted["source"]))
                write_beton(staged.path(out / name), split, mode, jpeg_quality, workers, PAGE_SIZE,
                            desc=f"write {name}")
                files[name] = {"split": split_name, "write_mode": mode, "count": len(split),
                               **({"jpeg_quality": jpeg_quality} if mode == "jpg" else {})}
        write_s = time.perf_counter() - t0
        staged.commit()
    t1 = time.perf_counter()
    for name, entry in files.items():
        entry.update(sha256=sha256_file(out / name), bytes=(out / name).stat().st_size)
    manifest = {
        **wanted,
        "dataset": dataset_name(wanted["source"]),  # the prefix of the file names
        "input": data.info,
        "counts": {s: len(getattr(data, s)) for s in SPLITS},
        "content_sha256": {s: getattr(data, s).sha256() for s in SPLITS},  # of the decoded arrays
        "image": {"shape": [32, 32, 3], "dtype": "uint8", "layout": "HWC RGB"},
        "files": files,
        "timing_s": {"read": round(read_s, 2), "write": round(write_s, 2),
                     "checksum": round(time.perf_counter() - t1, 2),
                     "total": round(read_s + time.perf_counter() - t0, 2)},
        "workers": workers,
        "machine": {"cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                    "python": platform.python_version(), "platform": platform.platform()},
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    write_json(out / MANIFEST, manifest)
    return manifest


def check_export_folder(folder: Path) -> None:
    """The export replaces `folder` as a whole: refused unless it is missing, empty or an earlier export."""
    if folder.is_dir() and not (folder / EXPORT_MARKER).is_file() and any(folder.iterdir()):
        raise DatasetError(f"--export-png: {folder} exists and was not written by this tool (no {EXPORT_MARKER}); "
                           f"remove it or choose another folder")


def export_png(data: ImageDataset, folder: Path, workers: int) -> None:
    """The PNG-folder layout of `data` in `folder`, replaced as a whole; skipped if its marker says it is current."""
    marker = folder / EXPORT_MARKER
    want = {"tool_version": TOOL_VERSION, "source": data.source, "synthetic": data.synthetic,
            "counts": {s: len(getattr(data, s)) for s in SPLITS},
            "content_sha256": {s: getattr(data, s).sha256() for s in SPLITS}}  # the pixels and labels written
    check_export_folder(folder)
    if marker.is_file():
        try:
            if json.loads(marker.read_text()) == want:
                print(f"{folder}: PNG export is up to date - nothing to do")
                return
        except ValueError:
            pass  # our marker, damaged: rewrite the folder
    t0 = time.perf_counter()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with Staged() as staged:
        tmp = staged.path(folder)
        export_png_dir(data, tmp, workers=workers)
        (tmp / EXPORT_MARKER).write_text(json.dumps(want, indent=2) + "\n")
        staged.commit()
    print(f"{folder}: wrote {len(data.train)} train + {len(data.test)} test PNGs in "
          f"{time.perf_counter() - t0:.1f} s")


def run(args) -> int:
    out: Path = args.out  # checked writable by parse_args; made once the input is checked too
    check_one_dataset(out, dataset_name(args.source), f"--source {args.source}")
    stale = remove_stale_partials(out)
    if args.export_png is not None:
        stale += remove_stale_partials(args.export_png.parent)
        if args.source == "png" and args.export_png.resolve() == args.png_dir.resolve():
            raise DatasetError("--export-png must differ from --png-dir (the export replaces its folder)")
        check_export_folder(args.export_png)  # before the .beton files are written, not after
    if stale:
        print(f"removed {len(stale)} partial file(s) left by an interrupted run: {', '.join(p.name for p in stale)}")
    if segments := remove_stale_segments():
        print(f"removed {len(segments)} shared-memory segment(s) left by a killed run: {', '.join(segments)}")
    t0 = time.perf_counter()
    wanted = wanted_state(args, input_fingerprint(args))
    out.mkdir(parents=True, exist_ok=True)
    files = beton_files(dataset_name(args.source))
    reason = "--force" if args.force else why_stale(out, wanted)
    if reason is None:
        print(f"{out}: {len(files)} .beton files match {MANIFEST} ({args.source}) - nothing to do")
        if args.export_png is None:
            return 0
    if args.source == "digits":
        data = load_digits()
    elif args.source == "mnist":
        data = load_mnist(args.mnist_dir)
    else:
        data = load_source(args.source, tarball=args.tarball, png_dir=args.png_dir, cache_dir=out, url=args.url,
                           png_holdout=args.png_holdout, num_train=args.num_synthetic,
                           num_test=args.num_synthetic_test, seed=args.seed, workers=args.workers)
    read_s = time.perf_counter() - t0
    if reason is not None:
        print(f"{out}: writing .beton files ({reason})")
        (out / MANIFEST).unlink(missing_ok=True)  # no manifest may describe a half-replaced set of files
        manifest = convert(data, out, wanted, args.jpeg_quality, args.workers, read_s)
        t = manifest["timing_s"]
        print(f"{out}: wrote {', '.join(files)} + {MANIFEST}: {len(data.train)} train + {len(data.test)} test "
              f"images{' (SYNTHETIC)' if data.synthetic else ''} in {t['total']:.1f} s (read {t['read']} s, "
              f"write {t['write']} s, checksum {t['checksum']} s; {args.workers} workers)")
    if args.export_png is not None:
        export_png(data, args.export_png, args.workers)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    stoppable = (abort_cleanly("make_dataset: interrupted - temp files removed, no .beton was left half-written")
                 if threading.current_thread() is threading.main_thread() else contextlib.nullcontext())
    try:
        with stoppable:
            return run(args)
    except DatasetError as e:
        return fail("make_dataset", str(e))
    except KeyboardInterrupt:  # raised by code rather than a signal: the `with` blocks have removed the temp files
        print("make_dataset: interrupted - temp files removed, no .beton was left half-written", file=sys.stderr)
        return 130
    finally:
        release_locks()


if __name__ == "__main__":
    sys.exit(main())
