"""tools/: every source converts through the real code to .beton files that FFCV's Loader reads back exactly; every
bad input is one clear error; interrupted or failed writes never leave a .beton under its final name."""
from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
from PIL import Image

import tools.ffcv_writer
import tools.make_dataset
from conftest import SMALL_TEST, SMALL_TRAIN, make_cifar_tarball, read_beton, write_png_folder
from tools.atomic import SHM_DIR, remove_stale_partials
from tools.cifar10 import (CIFAR10_MD5, CIFAR10_URL, CLASSES, DatasetError, download, load_png_dir, load_synthetic,
                           load_tarball)
from tools.make_dataset import BETON_FILES, MANIFEST, main

REPO = Path(__file__).resolve().parents[1]
# Mean absolute error (0-255 scale) allowed between a JPEG (quality 90) image and its source; measured ~4.7 on the
# synthetic images (they carry fine grain on purpose), so this bound catches colour swaps, shifts, wrong decoders.
JPEG_MAE_BOUND = 8.0


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def betons(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.beton"))


def partials(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob(".*.partial-*"))


def index_by_content(reference: np.ndarray, images: np.ndarray) -> np.ndarray:
    """For each image, the index of the bit-identical image in `reference` (all reference images are distinct)."""
    where = {img.tobytes(): i for i, img in enumerate(reference)}
    assert len(where) == len(reference), "reference images must be distinct to carry an index by content"
    return np.array([where[img.tobytes()] for img in images])


# ---------------------------------------------------------------------------------------------------------------
# The official tarball format: converted, read back by FFCV in both orders

@pytest.fixture(scope="module")
def tarball_case(tmp_path_factory):
    """A 200 + 50 image tarball in the exact CIFAR-10 python format, converted by the CLI entry point."""
    root = tmp_path_factory.mktemp("tarball")
    data = load_synthetic(200, 50, seed=7)
    tarball = make_cifar_tarball(root / "cifar-10-python.tar.gz", data)
    out = root / "data"
    args = ["--source", "tarball", "--tarball", str(tarball), "--out", str(out), "--jpeg-quality", "90",
            "--workers", "2"]
    assert main(args) == 0
    return data, tarball, out, args


def test_a_tarball_that_is_not_the_official_file_gets_a_warning(tarball_case, capsys):
    load_tarball(tarball_case[1])
    (warning,) = [line for line in capsys.readouterr().err.splitlines() if "WARNING" in line]
    assert hashlib.md5(tarball_case[1].read_bytes()).hexdigest() in warning and f"not the official CIFAR-10 " \
        f"tarball's {CIFAR10_MD5}" in warning


def test_tarball_manifest_records_input_counts_and_files(tarball_case):
    data, tarball, out, _ = tarball_case
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["source"] == "tarball" and manifest["synthetic"] is False
    assert manifest["counts"] == {"train": 200, "test": 50}
    assert manifest["input"]["sha256"] == sha256(tarball)
    assert manifest["input"]["md5"] == hashlib.md5(tarball.read_bytes()).hexdigest()
    assert manifest["input"]["official_md5"] is False
    assert manifest["settings"]["jpeg_quality"] == 90
    assert manifest["content_sha256"] == {"train": data.train.sha256(), "test": data.test.sha256()}
    assert sorted(manifest["files"]) == sorted(BETON_FILES) == betons(out)
    for name, entry in manifest["files"].items():
        assert entry["sha256"] == sha256(out / name) and entry["bytes"] == (out / name).stat().st_size
    assert set(manifest["timing_s"]) >= {"read", "write", "total"}
    assert partials(out) == []


@pytest.mark.parametrize("split", ["train", "test"])
def test_raw_beton_is_bit_exact_in_file_order(tarball_case, split):
    data, _, out, _ = tarball_case
    images, labels = read_beton(out / f"cifar10_{split}_raw.beton")
    expected = getattr(data, split)
    assert images.shape == expected.images.shape and images.dtype == np.uint8
    np.testing.assert_array_equal(images, expected.images)
    np.testing.assert_array_equal(labels, expected.labels)
    if split == "train":  # 200 images, 2 writer processes: each fills pages of its own
        from ffcv.reader import Reader
        pointers = Reader(str(out / "cifar10_train_raw.beton")).metadata["f0"]["data_ptr"]
        # Both workers pull from one queue, so on a loaded machine one of them may take every chunk (seen on CI):
        # one page per worker that took work, never more pages than workers.
        assert 1 <= len(np.unique(pointers // tools.make_dataset.PAGE_SIZE)) <= 2


@pytest.mark.parametrize("split", ["train", "test"])
def test_jpeg_beton_is_close_in_file_order(tarball_case, split):
    data, _, out, _ = tarball_case
    images, labels = read_beton(out / f"cifar10_{split}_jpg.beton")
    expected = getattr(data, split)
    assert images.shape == expected.images.shape
    np.testing.assert_array_equal(labels, expected.labels)
    mae = np.abs(images.astype(np.int16) - expected.images).mean(axis=(1, 2, 3))
    assert mae.max() < JPEG_MAE_BOUND, f"JPEG error {mae.max():.2f} above {JPEG_MAE_BOUND}"
    assert mae.mean() > 0.5, "the *_jpg.beton holds (nearly) lossless images: is it really JPEG?"


def test_random_order_is_a_permutation_of_the_same_samples(tarball_case):
    data, _, out, _ = tarball_case
    images, labels = read_beton(out / "cifar10_train_raw.beton", order="random", seed=3)
    perm = index_by_content(data.train.images, images)  # also proves each image is bit-exact
    assert sorted(perm) == list(range(len(data.train)))
    assert not np.array_equal(perm, np.arange(len(perm))), "random order came back sequential"
    np.testing.assert_array_equal(labels, data.train.labels[perm])

    # JPEG: match against the file-order decode (decoding is deterministic), then check labels follow the images.
    jpg_seq, _ = read_beton(out / "cifar10_train_jpg.beton")
    jpg_rand, jpg_labels = read_beton(out / "cifar10_train_jpg.beton", order="random", seed=3)
    perm_jpg = index_by_content(jpg_seq, jpg_rand)
    assert sorted(perm_jpg) == list(range(len(data.train)))
    assert not np.array_equal(perm_jpg, np.arange(len(perm_jpg)))
    np.testing.assert_array_equal(jpg_labels, data.train.labels[perm_jpg])


def test_second_run_verifies_and_does_nothing(tarball_case, capsys):
    _, _, out, args = tarball_case
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert main(args) == 0
    assert "nothing to do" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before


def test_rebuilds_when_settings_or_files_change(tmp_path, capsys):
    args = ["--source", "synthetic", "--num-synthetic", "64", "--num-synthetic-test", "16", "--out", str(tmp_path)]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args + ["--jpeg-quality", "50"]) == 0
    assert "settings.jpeg_quality changed: 90 -> 50" in capsys.readouterr().out
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert manifest["files"]["cifar10_train_jpg.beton"]["jpeg_quality"] == 50

    with open(tmp_path / "cifar10_test_raw.beton", "ab") as f:  # damage one file: the check must notice
        f.write(b"\0")
    assert main(args + ["--jpeg-quality", "50"]) == 0
    assert "cifar10_test_raw.beton does not match its sha256" in capsys.readouterr().out
    (tmp_path / "cifar10_train_jpg.beton").unlink()
    assert main(args + ["--jpeg-quality", "50"]) == 0
    assert "cifar10_train_jpg.beton is missing" in capsys.readouterr().out
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    assert all(sha256(tmp_path / n) == e["sha256"] for n, e in manifest["files"].items())
    assert main(args + ["--jpeg-quality", "50"]) == 0
    assert "nothing to do" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------------
# PNG folders (Kaggle layout) and the export to it

@pytest.fixture(scope="module")
def png_data():
    return load_synthetic(40, 12, seed=5)


def test_png_folder_converts_bit_exact(tmp_path, png_data):
    root = write_png_folder(tmp_path / "kaggle", png_data)
    out = tmp_path / "data"
    assert main(["--source", "png", "--png-dir", str(root), "--out", str(out)]) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["source"] == "png" and manifest["counts"] == {"train": 40, "test": 12}
    assert manifest["input"]["test_split"] == "test/ + testLabels.csv"
    assert manifest["content_sha256"] == {"train": png_data.train.sha256(), "test": png_data.test.sha256()}
    images, labels = read_beton(out / "cifar10_train_raw.beton")
    np.testing.assert_array_equal(images, png_data.train.images)
    np.testing.assert_array_equal(labels, png_data.train.labels)


def test_png_folder_without_test_labels_holds_out_the_last_images(tmp_path, png_data):
    root = write_png_folder(tmp_path / "kaggle", png_data, with_test=False)
    for holdout in ("10", 0.25):
        data = load_png_dir(root, holdout=holdout)
        np.testing.assert_array_equal(data.train.images, png_data.train.images[:30])
        np.testing.assert_array_equal(data.test.images, png_data.train.images[30:])
        np.testing.assert_array_equal(data.test.labels, png_data.train.labels[30:])
    for bad in ("40", "0", "1.5"):
        with pytest.raises(DatasetError, match="--png-holdout"):
            load_png_dir(root, holdout=bad)
    out = tmp_path / "data"
    assert main(["--source", "png", "--png-dir", str(root), "--out", str(out), "--png-holdout", "10"]) == 0
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["counts"] == {"train": 30, "test": 10}
    assert "last 10 of 40 train images" in manifest["input"]["test_split"]


def test_export_png_round_trips_and_is_idempotent(tmp_path, capsys):
    export = tmp_path / "png"
    args = ["--source", "synthetic", "--num-synthetic", "30", "--num-synthetic-test", "10", "--seed", "2",
            "--out", str(tmp_path / "data"), "--export-png", str(export), "--workers", "1"]
    assert main(args) == 0
    expected = load_synthetic(30, 10, seed=2)
    assert sorted(p.name for p in (export / "train").iterdir()) == sorted(f"{i}.png" for i in range(1, 31))
    lines = (export / "trainLabels.csv").read_text().splitlines()
    assert lines[0] == "id,label" and lines[1] == f"1,{CLASSES[expected.train.labels[0]]}" and len(lines) == 31
    with Image.open(export / "test" / "10.png") as im:
        assert (im.format, im.mode, im.size) == ("PNG", "RGB", (32, 32))
    back = load_png_dir(export)  # the --source png reader takes the export as it is
    assert back.train.sha256() == expected.train.sha256() and back.test.sha256() == expected.test.sha256()
    capsys.readouterr()
    assert main(args) == 0
    assert "PNG export is up to date" in capsys.readouterr().out
    assert partials(tmp_path) == []

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not an export")
    (tmp_path / "data2").mkdir()
    assert main(args[:-4] + ["--out", str(tmp_path / "data2"), "--export-png", str(foreign)]) == 2
    assert "was not written by this tool" in capsys.readouterr().err
    assert (foreign / "notes.txt").is_file() and betons(tmp_path / "data2") == []  # refused before any writing


# ---------------------------------------------------------------------------------------------------------------
# Synthetic data and the shared fixture

def test_synthetic_is_deterministic_structured_and_recorded(small_dataset, small_dataset_arrays):
    a, b, c = load_synthetic(300, 60, seed=0), load_synthetic(300, 60, seed=0), load_synthetic(300, 60, seed=1)
    assert a.train.sha256() == b.train.sha256() and a.test.sha256() == b.test.sha256()
    assert a.train.sha256() != c.train.sha256()
    assert np.bincount(a.train.labels).tolist() == [30] * 10
    x = a.train.images.astype(np.float32)
    assert x.std() > 30, "synthetic images are (nearly) constant"
    neighbour_corr = np.corrcoef(x[:, :, :-1].ravel(), x[:, :, 1:].ravel())[0, 1]
    assert neighbour_corr > 0.7, f"no spatial structure (neighbour correlation {neighbour_corr:.2f}): pure noise?"
    assert np.abs(np.diff(x, axis=2)).mean() > 2, "no texture: JPEG would be near-lossless"
    jpeg_mae = np.mean([np.abs(cv2.imdecode(cv2.imencode(".jpg", im, [cv2.IMWRITE_JPEG_QUALITY, 90])[1], 1)
                               .astype(np.int16) - im).mean() for im in a.train.images[:50]])
    assert 1 < jpeg_mae < JPEG_MAE_BOUND

    manifest = json.loads((small_dataset / MANIFEST).read_text())
    assert manifest["source"] == "synthetic" and manifest["synthetic"] is True
    assert manifest["counts"] == {"train": SMALL_TRAIN, "test": SMALL_TEST}
    assert betons(small_dataset) == sorted(BETON_FILES)
    images, labels = read_beton(small_dataset / "cifar10_test_raw.beton")
    np.testing.assert_array_equal(images, small_dataset_arrays.test.images)
    np.testing.assert_array_equal(labels, small_dataset_arrays.test.labels)


# ---------------------------------------------------------------------------------------------------------------
# Download: MD5-checked, atomic, and one clear message when offline

class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture
def http_server(tmp_path):
    """(folder it serves, base URL) of an HTTP server on 127.0.0.1."""
    root = tmp_path / "www"
    root.mkdir()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield root, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_official_source_constants():
    assert CIFAR10_URL == "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
    assert CIFAR10_MD5 == "c58f30108f718f92721af3b95e74349a"


def test_download_checks_md5_then_renames(http_server, tmp_path):
    www, base = http_server
    payload = np.random.default_rng(0).integers(0, 256, 3_000_000, dtype=np.uint8).tobytes()  # several chunks
    (www / "file.tar.gz").write_bytes(payload)
    dest = tmp_path / "cache" / "file.tar.gz"
    dest.parent.mkdir()
    assert download(dest, url=f"{base}/file.tar.gz", md5=hashlib.md5(payload).hexdigest()) == dest
    assert dest.read_bytes() == payload and partials(dest.parent) == []
    (www / "file.tar.gz").unlink()  # a verified file on disk is reused, not fetched again
    assert download(dest, url=f"{base}/file.tar.gz", md5=hashlib.md5(payload).hexdigest()) == dest


def test_download_checksum_mismatch_removes_the_partial_file(http_server, tarball_case, tmp_path, capsys):
    www, base = http_server
    (www / "cifar-10-python.tar.gz").write_bytes(tarball_case[1].read_bytes())  # a valid tarball, but not the official
    out = tmp_path / "data"
    assert main(["--source", "download", "--url", f"{base}/cifar-10-python.tar.gz", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"expected {CIFAR10_MD5}" in err and "partial file was removed" in err
    assert sorted(p.name for p in out.iterdir()) == []  # no tarball, no partial, no .beton, no manifest


def test_offline_download_is_one_clear_message(tmp_path):
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/cifar-10-python.tar.gz"
    proc = subprocess.run([sys.executable, "-m", "tools.make_dataset", "--source", "download", "--url", url,
                           "--out", str(tmp_path / "data")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert url in err and "CIFAR=" in err and "SOURCE=synthetic" in err and "PNG_DIR=" in err
    assert list((tmp_path / "data").iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------
# Bad input: one clear error each, nothing written

def _tarball_with_member(path: Path, name: str, payload: bytes) -> Path:
    import io
    import tarfile
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    return path


def test_truncated_corrupt_or_incomplete_tarball(tarball_case, tmp_path, capsys):
    import pickle
    data, good, _, _ = tarball_case
    blob = good.read_bytes()
    cases = {
        "truncated.tar.gz": (lambda p: p.write_bytes(blob[: len(blob) // 2]), "truncated or corrupt"),
        "garbage.tar.gz": (lambda p: p.write_bytes(os.urandom(5000)), "truncated or corrupt"),
        "incomplete.tar.gz": (lambda p: make_cifar_tarball(p, data, skip=("data_batch_3",)), "has no data_batch_3"),
        "tampered.tar.gz": (lambda p: _tarball_with_member(p, "data_batch_1", pickle.dumps({b"data": print})),
                            "unexpected object builtins.print"),
    }
    for name, (make, message) in cases.items():
        path = tmp_path / name
        make(path)
        out = tmp_path / f"out_{name}"
        assert main(["--source", "tarball", "--tarball", str(path), "--out", str(out)]) == 2, name
        err = capsys.readouterr().err
        assert message in err and str(path) in err, err
        assert betons(out) == [] and partials(out) == []


@pytest.fixture
def png_root(tmp_path, png_data):
    return write_png_folder(tmp_path / "kaggle", png_data, with_test=False)


def _rewrite_labels(root: Path, edit) -> None:
    csv_path = root / "trainLabels.csv"
    csv_path.write_text("\n".join(edit(csv_path.read_text().splitlines())) + "\n")


@pytest.mark.parametrize("case, message", [
    ("wrong_size", "train/3.png: expected a 32x32 RGB PNG, found a 33x32 RGB"),
    ("wrong_mode_rgba", "train/5.png: expected a 32x32 RGB PNG, found a 32x32 RGBA"),
    ("wrong_mode_gray", "train/6.png: expected a 32x32 RGB PNG, found a 32x32 L"),
    ("not_a_png", "train/8.png: cannot be read as a PNG"),
    ("missing_row", "trainLabels.csv has no row for 1 PNG file(s):"),
    ("missing_file", "trainLabels.csv lists 1 id(s) with no train/<id>.png: 7"),
    ("unknown_class", "trainLabels.csv line 3: expected '<id>,<class name>'"),
    ("no_header", "trainLabels.csv: the first line must be the header 'id,label'"),
    ("empty_folder", "has no train/ + trainLabels.csv"),
    ("no_pngs", "contains no PNG files"),
])
def test_bad_png_folder_names_what_is_wrong(png_root, case, message):
    train = png_root / "train"
    if case == "wrong_size":
        Image.fromarray(np.full((32, 33, 3), 90, np.uint8)).save(train / "3.png")
    elif case == "wrong_mode_rgba":
        Image.fromarray(np.full((32, 32, 4), 90, np.uint8)).save(train / "5.png")
    elif case == "wrong_mode_gray":
        Image.fromarray(np.full((32, 32), 90, np.uint8)).save(train / "6.png")
    elif case == "not_a_png":
        (train / "8.png").write_bytes(b"\x89PNG but not really")
    elif case == "missing_row":
        _rewrite_labels(png_root, lambda lines: lines[:-1])
    elif case == "missing_file":
        (train / "7.png").unlink()
    elif case == "unknown_class":
        _rewrite_labels(png_root, lambda lines: lines[:2] + ["2,dragon"] + lines[3:])
    elif case == "no_header":
        _rewrite_labels(png_root, lambda lines: lines[1:])
    elif case == "empty_folder":
        png_root = png_root.parent / "empty"
        png_root.mkdir()
    elif case == "no_pngs":
        for p in train.iterdir():
            p.unlink()
    with pytest.raises(DatasetError) as err:
        load_png_dir(png_root)
    assert message in str(err.value)
    if case == "missing_row":
        assert str(train / "40.png") in str(err.value)  # names the file that has no label


@pytest.mark.parametrize("case", ["no folders", "no pngs"])
def test_empty_png_folder_is_one_line_without_a_progress_fragment(tmp_path, capsys, case):
    root = tmp_path / "kaggle"
    (root / "train").mkdir(parents=True)
    if case == "no pngs":
        (root / "trainLabels.csv").write_text("id,label\n")
    else:
        (root / "train").rmdir()
    assert main(["--source", "png", "--png-dir", str(root), "--out", str(tmp_path / "data")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("make_dataset: error: ") and err.count("\n") == 1 and "\r" not in err, repr(err)


def test_bad_png_folder_through_the_cli(png_root, tmp_path, capsys):
    Image.fromarray(np.full((32, 33, 3), 90, np.uint8)).save(png_root / "train" / "3.png")
    out = tmp_path / "data"
    assert main(["--source", "png", "--png-dir", str(png_root), "--out", str(out)]) == 2
    last = capsys.readouterr().err.strip().split("\r")[-1].splitlines()[-1]  # after the progress bars
    assert last.startswith("make_dataset: error: ") and str(png_root / "train" / "3.png") in last
    assert betons(out) == []


def test_an_output_under_a_file_fails_before_any_work(tmp_path, monkeypatch, capsys):
    def must_not_load(*args, **kwargs):
        raise AssertionError("the source was read before the output folder was checked")
    monkeypatch.setattr(tools.make_dataset, "load_source", must_not_load)
    blocker = tmp_path / "a_file"
    blocker.write_text("a regular file, so nothing can be created under it (even by root)")
    with pytest.raises(SystemExit) as e:
        main(["--source", "synthetic", "--out", str(blocker / "data")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"--out {blocker / 'data'}: is under {blocker}, which is a file" in err


def test_conflicting_arguments_are_rejected():
    with pytest.raises(SystemExit):
        tools.make_dataset.parse_args(["--source", "synthetic", "--tarball", "x.tar.gz"])
    with pytest.raises(SystemExit):
        tools.make_dataset.parse_args(["--jpeg-quality", "0"])


# ---------------------------------------------------------------------------------------------------------------
# Interrupted and failed writes

SMALL = ["--source", "synthetic", "--num-synthetic", "200", "--num-synthetic-test", "40"]


def test_failing_writer_worker_keeps_the_previous_files(tmp_path, monkeypatch):
    assert main(SMALL + ["--out", str(tmp_path)]) == 0
    before = {name: sha256(tmp_path / name) for name in BETON_FILES}
    original = tools.ffcv_writer.ArrayDataset.__getitem__

    def failing(self, i):
        if i == 150:
            raise ValueError("injected failure while writing")
        return original(self, i)
    monkeypatch.setattr(tools.ffcv_writer.ArrayDataset, "__getitem__", failing)  # forked workers inherit it
    with pytest.raises(RuntimeError, match="writer worker died"):
        main(SMALL + ["--out", str(tmp_path), "--jpeg-quality", "70"])
    assert {name: sha256(tmp_path / name) for name in BETON_FILES} == before  # untouched: complete old files
    assert partials(tmp_path) == [] and not (tmp_path / MANIFEST).exists()  # so the next run rebuilds


def test_ctrl_c_during_write_leaves_no_beton(tmp_path, monkeypatch, capsys):
    original, calls = tools.ffcv_writer.write_beton, []

    def interrupted_on_third(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return original(*args, **kwargs)
    monkeypatch.setattr(tools.ffcv_writer, "write_beton", interrupted_on_third)
    assert main(SMALL + ["--out", str(tmp_path)]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert len(calls) == 3 and all(".partial-" in Path(p).name for p in calls)  # written under temp names only
    assert betons(tmp_path) == [] and partials(tmp_path) == [] and not (tmp_path / MANIFEST).exists()


def _start_big_conversion(out: Path) -> subprocess.Popen:
    """A conversion long enough to be caught mid-write; returns once its first temp .beton exists."""
    proc = subprocess.Popen([sys.executable, "-m", "tools.make_dataset", "--source", "synthetic", "--num-synthetic",
                             "20000", "--num-synthetic-test", "100", "--workers", "1", "--out", str(out)],
                            cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    deadline = time.monotonic() + 120
    while not list(out.glob(".cifar10_*.partial-*")):
        assert proc.poll() is None, f"conversion ended before it could be interrupted: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "no temp .beton appeared within 120 s"
        time.sleep(0.01)
    return proc


def _live_members(pgid: int) -> list[int]:
    """Pids of the processes in group `pgid` that are still running (zombies excluded)."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


def _group_ends(pgid: int, timeout: float = 30) -> list[int]:
    """Waits until no process of group `pgid` runs (workers die with their parent); returns those still running."""
    deadline = time.monotonic() + timeout
    while (live := _live_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return live


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_kill_mid_write_leaves_no_beton_and_next_run_cleans_up(tmp_path, capsys):
    proc = _start_big_conversion(tmp_path)
    proc.kill()  # kill -9 of the CLI alone: its FFCV writer workers must not live on as orphans
    proc.wait(timeout=60)
    proc.stderr.close()
    assert _group_ends(proc.pid) == [], "writer workers outlived the killed CLI"
    assert betons(tmp_path) == [] and not (tmp_path / MANIFEST).exists()
    left = partials(tmp_path)
    assert left, "SIGKILL cannot clean up: the temp file should still be there for the next run"
    assert main(SMALL + ["--out", str(tmp_path)]) == 0
    assert f"removed {len(left)} partial file(s)" in capsys.readouterr().out
    assert partials(tmp_path) == [] and betons(tmp_path) == sorted(BETON_FILES)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
@pytest.mark.parametrize("how", ["kill", "ctrl-c"])
def test_stopped_mid_write_cleans_up_itself(tmp_path, how):
    proc = _start_big_conversion(tmp_path)
    segments = _wait_for_segments(proc)  # before the signal: on a loaded machine it could come before the mapping
    if how == "kill":
        proc.send_signal(signal.SIGTERM)  # plain `kill <pid>`: the CLI alone
    else:
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the CLI and its workers
    _, err = proc.communicate(timeout=60)  # to EOF: also what multiprocessing's resource tracker writes there
    assert proc.returncode == 128 + (signal.SIGTERM if how == "kill" else signal.SIGINT), err
    assert "interrupted" in err and "Traceback" not in err
    assert "leaked" not in err, err  # "resource_tracker: There appear to be 1 leaked shared_memory objects"
    assert betons(tmp_path) == [] and partials(tmp_path) == []
    assert _group_ends(proc.pid) == [], "writer workers outlived the stopped CLI"
    assert [s for s in segments if (SHM_DIR / s).exists()] == []


def _wait_for_segments(proc: subprocess.Popen, timeout: float = 60) -> list[str]:
    """Names of the shared-memory segments the writer process has mapped (its FFCV metadata; not multiprocessing's
    semaphores, which are unlinked as soon as they are made), once there is one."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        maps = Path(f"/proc/{proc.pid}/maps").read_text()
        names = sorted({line.split("/dev/shm/", 1)[1].split()[0] for line in maps.splitlines()
                        if "/dev/shm/" in line and "(deleted)" not in line and "/dev/shm/sem." not in line})
        if names:
            return names
        time.sleep(0.01)
    raise AssertionError("the writer mapped no shared memory")


@pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs Linux /dev/shm")
def test_kill9_of_the_group_leaves_a_segment_the_next_run_removes(tmp_path, capsys):
    proc = _start_big_conversion(tmp_path)
    segments = _wait_for_segments(proc)
    os.killpg(proc.pid, signal.SIGKILL)  # the CLI, its workers and multiprocessing's resource tracker
    proc.wait(timeout=60)
    proc.stderr.close()
    assert _group_ends(proc.pid) == []
    assert all((SHM_DIR / s).exists() for s in segments)  # nothing could unlink it
    assert main(SMALL + ["--out", str(tmp_path)]) == 0
    assert "shared-memory segment(s) left by a killed run" in capsys.readouterr().out
    assert [s for s in segments if (SHM_DIR / s).exists()] == []


_WRITER = """
import sys, time
from pathlib import Path
from tools.atomic import partial_path
partial_path(Path(sys.argv[1]) / "x.beton").write_bytes(b"x")
print("ready", flush=True)
time.sleep(600)
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_partials_of_a_killed_writer_are_stale_before_it_is_reaped(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.kill()
    stat = Path(f"/proc/{proc.pid}/stat")
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":  # dead, not reaped: its pid still answers kill 0
        time.sleep(0.01)
    try:
        (partial,) = partials(tmp_path)
        assert remove_stale_partials(tmp_path) == [tmp_path / partial]
        assert list(tmp_path.iterdir()) == []  # its lock file is gone too
    finally:
        proc.wait()


def test_stale_partials_of_live_processes_are_kept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".cifar10_train_raw.beton.partial-{dead.pid}"
    live = tmp_path / f".cifar10_test_raw.beton.partial-{os.getppid()}"
    stale.write_bytes(b"x")
    live.write_bytes(b"x")
    assert remove_stale_partials(tmp_path) == [stale]
    assert live.exists() and not stale.exists()
