"""Handwritten-digit sources that work offline, as 32x32 RGB splits for the .beton writer.

- digits: the UCI handwritten digits bundled in scikit-learn's wheel (1,797 images, 8x8, ink 0..16, 10 classes).
  Ink is scaled to 0..255 (white digit on black), each image upscaled 4x to 32x32 with PIL's bilinear filter and
  copied into the three channels. The split is stated in DIGITS_SPLIT: per class, a seeded permutation puts the
  first 20% (rounded) in test, so both splits keep the class balance (1,438 train / 359 test).
- mnist: the four IDX files of MNIST from a local folder (plain or .gz), 28x28 zero-padded by 2 pixels on every
  side to 32x32 (no resampling), copied into the three channels; its own train/test split (60,000 / 10,000).
"""
from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import numpy as np

from tools.cifar10 import DatasetError, ImageDataset, Split

DIGITS_TEST_FRACTION = 0.2
DIGITS_SPLIT_SEED = 0
DIGITS_SPLIT = (f"stratified: per class, a permutation seeded with {DIGITS_SPLIT_SEED} puts the first "
                f"{DIGITS_TEST_FRACTION:.0%} (rounded) in test, the rest in train; each split in original order")
DIGITS_PREPROCESS = "ink 0..16 -> round(v * 255 / 16), 8x8 -> 32x32 PIL bilinear, gray -> 3 equal channels"
MNIST_PREPROCESS = "28x28 zero-padded by 2 pixels on each side to 32x32, gray -> 3 equal channels"
MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
               "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def _gray_to_rgb(gray: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.repeat(gray[..., None], 3, axis=-1))  # (N, 32, 32) -> (N, 32, 32, 3)


# ---------------------------------------------------------------------------------------------------------------
# scikit-learn's digits

def _sklearn_digits() -> tuple[np.ndarray, np.ndarray]:
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise DatasetError("--source digits needs scikit-learn (pip install -r requirements.txt)") from None
    d = load_digits()
    return d.images, d.target.astype(np.int64)  # (1797, 8, 8) float 0..16, (1797,)


def digits_fingerprint() -> str:
    images, labels = _sklearn_digits()
    h = hashlib.sha256(np.ascontiguousarray(images, dtype="<f8").data)
    h.update(labels.astype("<i8").data)
    return "sha256:" + h.hexdigest()


def upscale_digits(images: np.ndarray) -> np.ndarray:
    """(N, 8, 8) ink 0..16 -> (N, 32, 32, 3) uint8."""
    from PIL import Image

    u8 = np.rint(images * (255 / 16)).astype(np.uint8)
    big = np.stack([np.asarray(Image.fromarray(im).resize((32, 32), Image.Resampling.BILINEAR)) for im in u8])
    return _gray_to_rgb(big)


def digits_split(labels: np.ndarray) -> np.ndarray:
    """Boolean mask of the test images (see DIGITS_SPLIT)."""
    rng = np.random.default_rng(DIGITS_SPLIT_SEED)
    test = np.zeros(len(labels), dtype=bool)
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        test[rng.permutation(idx)[:int(round(DIGITS_TEST_FRACTION * len(idx)))]] = True
    return test


def load_digits() -> ImageDataset:
    import sklearn

    images, labels = _sklearn_digits()
    rgb, test = upscale_digits(images), digits_split(labels)
    info = {"dataset": "UCI ML handwritten digits, as bundled in scikit-learn (sklearn.datasets.load_digits)",
            "scikit_learn": sklearn.__version__, "count": len(labels)}  # split and preprocessing: in the settings
    return ImageDataset(Split(rgb[~test], labels[~test]), Split(rgb[test], labels[test]), source="digits", info=info)


# ---------------------------------------------------------------------------------------------------------------
# MNIST from its IDX files

def _idx_file(folder: Path, name: str) -> Path:
    for candidate in (folder / name, folder / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise DatasetError(f"MNIST folder {folder} has no {name} (or {name}.gz); it needs the four IDX files "
                       f"{', '.join(n for pair in MNIST_FILES.values() for n in pair)}")


def mnist_files(folder: Path) -> list[Path]:
    folder = Path(folder)
    if not folder.is_dir():
        raise DatasetError(f"MNIST folder {folder} does not exist (MNIST_DIR= must hold its four IDX files)")
    return [_idx_file(folder, n) for pair in MNIST_FILES.values() for n in pair]


def mnist_fingerprint(folder: Path) -> str:
    h = hashlib.sha256()
    for p in mnist_files(folder):
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return "sha256:" + h.hexdigest()


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """An IDX array of unsigned bytes: magic 0x00 0x00 0x08 <ndim>, ndim big-endian int32 sizes, then the data."""
    raw = (gzip.decompress if path.suffix == ".gz" else bytes)(path.read_bytes())
    header = 4 + 4 * ndim
    if len(raw) < header or raw[:4] != bytes([0, 0, 8, ndim]):
        raise DatasetError(f"{path} is not an IDX file of unsigned bytes with {ndim} dimension(s) (its first "
                           f"bytes are {raw[:4].hex()}, expected {bytes([0, 0, 8, ndim]).hex()})")
    shape = tuple(int(v) for v in np.frombuffer(raw[4:header], dtype=">i4"))
    if len(raw) - header != int(np.prod(shape)):
        raise DatasetError(f"{path}: the header says {shape} = {int(np.prod(shape))} bytes of data, the file has "
                           f"{len(raw) - header} (truncated or damaged)")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def _mnist_split(folder: Path, split: str) -> Split:
    images_name, labels_name = MNIST_FILES[split]
    images = read_idx(_idx_file(folder, images_name), 3)
    labels = read_idx(_idx_file(folder, labels_name), 1).astype(np.int64)
    if images.shape[1:] != (28, 28):
        raise DatasetError(f"{folder}/{images_name}: expected 28x28 images, found {images.shape[1:]}")
    if len(images) != len(labels):
        raise DatasetError(f"{folder}: {images_name} has {len(images)} images but {labels_name} {len(labels)} labels")
    try:
        return Split(_gray_to_rgb(np.pad(images, ((0, 0), (2, 2), (2, 2)))), labels)
    except DatasetError as e:
        raise DatasetError(f"{folder} ({split}): {e}") from None


def load_mnist(folder: Path) -> ImageDataset:
    folder = Path(folder)
    files = mnist_files(folder)
    info = {"dataset": "MNIST (IDX files)", "path": str(folder), "files": [p.name for p in files],
            "split": "MNIST's own: train-* = train, t10k-* = test"}
    return ImageDataset(_mnist_split(folder, "train"), _mnist_split(folder, "test"), source="mnist", info=info)
