"""make dataset SOURCE=digits | mnist: scikit-learn's digits and MNIST IDX files through the real converter, read back
by FFCV exactly; every bad input is one clear error."""
from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import tools.make_dataset
from conftest import read_beton
from tools.cifar10 import DatasetError
from tools.digits import MNIST_FILES, digits_split, load_digits, load_mnist, read_idx, upscale_digits
from tools.make_dataset import MANIFEST, beton_files, main


def test_digits_betons_hold_all_1797_images_split_by_class(digits_dataset, capsys):
    digits_out = digits_dataset
    assert sorted(p.name for p in digits_out.glob("*.beton")) == sorted(beton_files("digits"))
    manifest = json.loads((digits_out / MANIFEST).read_text())
    assert manifest["source"] == manifest["dataset"] == "digits" and manifest["synthetic"] is False
    assert manifest["counts"] == {"train": 1438, "test": 359}
    assert "stratified" in manifest["settings"]["split"] and "bilinear" in manifest["settings"]["preprocess"]
    expected = load_digits()
    for split in ("train", "test"):
        images, labels = read_beton(digits_out / f"digits_{split}_raw.beton")
        want = getattr(expected, split)
        np.testing.assert_array_equal(images, want.images)
        np.testing.assert_array_equal(labels, want.labels)
    test_counts = np.bincount(expected.test.labels, minlength=10)
    train_counts = np.bincount(expected.train.labels, minlength=10)
    assert test_counts.min() >= 35 and np.allclose(test_counts / (test_counts + train_counts), 0.2, atol=0.01)
    assert main(["--source", "digits", "--out", str(digits_out)]) == 0
    assert "nothing to do" in capsys.readouterr().out


# ---- one dataset per folder (issue 46): another kind is refused in one line, its manifest never overwritten ----

@pytest.fixture
def folders(small_dataset, digits_dataset, tmp_path) -> dict[str, Path]:
    """Copies of a CIFAR-10 (synthetic) and a digits dataset folder, for a test that might write into them."""
    return {kind: Path(shutil.copytree(src, tmp_path / kind))
            for kind, src in (("cifar10", small_dataset), ("digits", digits_dataset))}


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.name.endswith((".beton", ".json"))}


def error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("source,into", [("digits", "cifar10"), ("synthetic", "digits"), ("mnist", "digits")])
def test_make_dataset_writes_no_other_dataset_into_a_folder(source, into, folders, tmp_path, capsys):
    folder, before = folders[into], files(folders[into])
    extra = {"synthetic": ["--num-synthetic", "64", "--num-synthetic-test", "16"],
             "mnist": ["--mnist-dir", str(tmp_path)]}.get(source, [])
    assert main(["--source", source, "--out", str(folder), *extra]) == 2
    wants = "cifar10" if source == "synthetic" else source
    assert error_lines(capsys) == [f"make_dataset: error: {folder} holds another dataset, {into} ({folder / MANIFEST}"
                                   f"); --source {source} would write {wants} beside it, and a folder holds one "
                                   f"dataset: give {wants} a folder of its own"]
    assert files(folder) == before


def test_without_a_manifest_the_beton_names_tell_the_dataset(small_dataset, tmp_path, capsys):
    shutil.copy(small_dataset / "cifar10_train_raw.beton", tmp_path)
    assert main(["--source", "digits", "--out", str(tmp_path)]) == 2
    (line,) = error_lines(capsys)
    assert f"holds another dataset, cifar10 ({tmp_path / 'cifar10_train_raw.beton'})" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cifar10_train_raw.beton"]


def test_the_benchmarks_build_no_dataset_into_another_ones_folder(folders, tmp_path, capsys):
    """bench --data DIGITS would build a synthetic CIFAR-10 there (and record the digits as synthetic); the digits
    report with --data CIFAR would build the digits there: both stop in one line, the folder untouched."""
    from benchmarks.common import BenchError, ensure_dataset
    from benchmarks.quality import digits

    before = {kind: files(folder) for kind, folder in folders.items()}
    with pytest.raises(BenchError, match=f"{folders['digits']} holds another dataset, digits "):
        ensure_dataset(folders["digits"], 64)
    out, work = tmp_path / "out", tmp_path / "work"
    with pytest.raises(SystemExit) as stopped:  # refused while parsing, before any work (issue 46: inputs first)
        digits.main(["--data", str(folders["cifar10"]), "--out", str(out), "--work", str(work), "--preset", "tiny",
                     "--steps", "2", "model.num_classes=10", "train.device=cpu"])
    assert stopped.value.code == 2
    (line,) = error_lines(capsys)
    assert line.startswith(f"digits: error: --data {folders['cifar10']}: holds another dataset "), line
    assert {kind: files(folder) for kind, folder in folders.items()} == before
    assert not out.exists() and not work.exists()


def test_digits_preprocessing():
    images = np.zeros((2, 8, 8))
    images[0] = 16  # full ink everywhere
    images[1, :, 3:5] = 16  # a vertical bar
    up = upscale_digits(images)
    assert up.shape == (2, 32, 32, 3) and up.dtype == np.uint8
    assert (up[0] == 255).all()
    assert (up[..., 0] == up[..., 1]).all() and (up[..., 1] == up[..., 2]).all()  # gray in three channels
    bar = up[1, :, :, 0].mean(axis=0)  # column profile of the bar: bright in the middle, black at the sides
    assert bar[14:18].min() == 255 and bar[:8].max() == 0 and bar[24:].max() == 0
    labels = np.repeat(np.arange(10), 10)
    test = digits_split(labels)
    assert test.sum() == 20 and all(test[labels == c].sum() == 2 for c in range(10))
    np.testing.assert_array_equal(test, digits_split(labels))  # seeded: the same split every time


def test_default_folders_keep_one_dataset_each(tmp_path):
    assert tools.make_dataset.parse_args(["--source", "digits"]).out == Path("data/digits")
    assert tools.make_dataset.parse_args(["--source", "mnist", "--mnist-dir", str(tmp_path)]).out == Path("data/mnist")
    assert tools.make_dataset.parse_args(["--source", "synthetic"]).out == Path("data")
    for bad in (["--source", "digits", "--mnist-dir", "x"], ["--source", "digits", "--export-png", "p"]):
        with pytest.raises(SystemExit):
            tools.make_dataset.parse_args(bad)


# ---------------------------------------------------------------------------------------------------------------
# MNIST from IDX files the test writes

def write_idx(path: Path, array: np.ndarray) -> Path:
    header = bytes([0, 0, 8, array.ndim]) + np.asarray(array.shape, dtype=">i4").tobytes()
    payload = header + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    path.write_bytes(gzip.compress(payload) if path.suffix == ".gz" else payload)
    return path


def fake_mnist(rng, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Strokes on black: a bright bar at a random row and column per image, plus faint noise."""
    images = rng.integers(0, 30, (n, 28, 28)).astype(np.uint8)
    for k in range(n):
        r, c = rng.integers(4, 24, 2)
        images[k, r:r + 3, 4:24] = 250
        images[k, 4:24, c:c + 2] = 200
    return images, rng.integers(0, 10, n).astype(np.uint8)


@pytest.fixture()
def mnist_dir(tmp_path) -> tuple[Path, dict]:
    rng = np.random.default_rng(3)
    folder = tmp_path / "mnist"
    folder.mkdir()
    arrays = {"train": fake_mnist(rng, 120), "test": fake_mnist(rng, 30)}
    for split, (images_name, labels_name) in MNIST_FILES.items():
        write_idx(folder / f"{images_name}.gz", arrays[split][0])  # gzipped, as distributed
        write_idx(folder / labels_name, arrays[split][1])  # and plain, as after gunzip
    return folder, arrays


def test_mnist_idx_files_convert_bit_exact(mnist_dir, tmp_path):
    folder, arrays = mnist_dir
    out = tmp_path / "out"
    assert main(["--source", "mnist", "--mnist-dir", str(folder), "--out", str(out), "--workers", "1"]) == 0
    assert sorted(p.name for p in out.glob("*.beton")) == sorted(beton_files("mnist"))
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["dataset"] == "mnist" and manifest["counts"] == {"train": 120, "test": 30}
    for split, (want_images, want_labels) in arrays.items():
        images, labels = read_beton(out / f"mnist_{split}_raw.beton")
        np.testing.assert_array_equal(labels, want_labels)
        for c in range(3):
            np.testing.assert_array_equal(images[:, 2:30, 2:30, c], want_images)  # padded, not resampled
        border = np.ones((32, 32), bool)
        border[2:30, 2:30] = False
        assert (images[:, border] == 0).all()


@pytest.mark.parametrize("case, message", [
    ("missing", "has no t10k-labels-idx1-ubyte (or t10k-labels-idx1-ubyte.gz)"),
    ("magic", "is not an IDX file of unsigned bytes with 1 dimension(s)"),
    ("truncated", "truncated or damaged"),
    ("count", "has 30 images but t10k-labels-idx1-ubyte 29 labels"),
    ("label", "labels must be in 0..9"),
])
def test_bad_mnist_folder_is_one_clear_error(mnist_dir, tmp_path, capsys, case, message):
    folder, arrays = mnist_dir
    labels_file = folder / MNIST_FILES["test"][1]
    if case == "missing":
        labels_file.unlink()
    elif case == "magic":
        labels_file.write_bytes(b"\x00\x00\x0d\x01" + labels_file.read_bytes()[4:])  # 0x0d: float, not ubyte
    elif case == "truncated":
        labels_file.write_bytes(labels_file.read_bytes()[:-5])
    elif case == "count":
        write_idx(labels_file, arrays["test"][1][:29])
    else:
        write_idx(labels_file, np.full(30, 12, np.uint8))
    with pytest.raises(DatasetError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_mnist(folder)
    out = tmp_path / "out"
    assert main(["--source", "mnist", "--mnist-dir", str(folder), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("make_dataset: error: ") and message in err[0]
    assert list(out.glob("*.beton")) == []


def test_mnist_without_folder_or_files(tmp_path, capsys):
    assert main(["--source", "mnist", "--out", str(tmp_path / "o")]) == 2
    assert "MNIST_DIR=" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # refused with the arguments, before anything is read or made
        main(["--source", "mnist", "--mnist-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert e.value.code == 2 and "no such folder" in capsys.readouterr().err and not (tmp_path / "o").exists()
    assert read_idx(write_idx(tmp_path / "x.gz", np.arange(6, dtype=np.uint8).reshape(2, 3)), 2).tolist() == \
        [[0, 1, 2], [3, 4, 5]]
