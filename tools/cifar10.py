"""CIFAR-10 sources: each returns the whole dataset as numpy arrays, ready for the .beton writer.

Sources: the official python tarball (downloaded and MD5-checked, or a local copy), a folder of PNGs in the Kaggle
layout (train/1.png ... + trainLabels.csv), and deterministic synthetic data. Every failure a user can cause raises
DatasetError with a message that says what was wrong and how to fix it; the CLI prints it without a traceback.
"""
from __future__ import annotations

import csv
import hashlib
import http.client
import json
import pickle
import sys
import tarfile
import urllib.error
import urllib.request
import zlib
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tools.atomic import Staged, worker_init

CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
CIFAR10_MD5 = "c58f30108f718f92721af3b95e74349a"
TARBALL_NAME = "cifar-10-python.tar.gz"
CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
IMAGE_SHAPE = (32, 32, 3)
TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
# Bump when the synthetic images change for the same seed: the manifest then no longer matches and data is rebuilt.
SYNTHETIC_VERSION = 1


class DatasetError(Exception):
    """A problem with the user's input or environment; its message is the whole story (no traceback needed)."""


@dataclass
class Split:
    images: np.ndarray  # (N, 32, 32, 3) uint8, HWC, RGB
    labels: np.ndarray  # (N,) int64 class indices into CLASSES

    def __post_init__(self):
        check_arrays(self.images, self.labels, "split")

    def __len__(self) -> int:
        return len(self.labels)

    def sha256(self) -> str:
        """Checksum of the decoded content: equal for the same images from any source (tarball, PNG export)."""
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(self.images).data)
        h.update(self.labels.astype("<i8").data)
        return h.hexdigest()


@dataclass
class ImageDataset:
    """A train and a test split of 32x32 RGB images with labels 0..9 (CIFAR-10, or digits from tools.digits)."""
    train: Split
    test: Split
    source: str  # "download" | "tarball" | "png" | "synthetic" | "digits" | "mnist"
    info: dict = field(default_factory=dict)  # what was read (path, checksums, split rule); goes into the manifest

    @property
    def synthetic(self) -> bool:
        return self.source == "synthetic"


def check_arrays(images: np.ndarray, labels: np.ndarray, what: str) -> None:
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != IMAGE_SHAPE:
        raise DatasetError(f"{what}: expected uint8 images of shape (N, 32, 32, 3), got {images.dtype} "
                           f"{images.shape}")
    if labels.shape != (len(images),) or labels.dtype != np.int64:
        raise DatasetError(f"{what}: expected {len(images)} int64 labels, got {labels.dtype} {labels.shape}")
    if len(labels) and (labels.min() < 0 or labels.max() >= len(CLASSES)):
        raise DatasetError(f"{what}: labels must be in 0..{len(CLASSES) - 1}, found {labels.min()}..{labels.max()}")


def file_digests(path: Path, desc: str | None = None) -> dict:
    """MD5 (what CIFAR-10 publishes) and SHA-256 of a file, in one pass."""
    md5, sha = hashlib.md5(), hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, tqdm(total=size, unit="B", unit_scale=True, desc=desc, disable=desc is None,
                                     leave=False) as bar:
        while chunk := f.read(1 << 20):
            md5.update(chunk)
            sha.update(chunk)
            bar.update(len(chunk))
    return {"md5": md5.hexdigest(), "sha256": sha.hexdigest(), "bytes": size}


# ---------------------------------------------------------------------------------------------------------------
# Download

def offline_message(url: str, reason: str) -> str:
    return (f"could not download CIFAR-10 from {url} ({reason}). Alternatives: a local copy of the tarball "
            f"(make dataset CIFAR=/path/to/{TARBALL_NAME}), a PNG folder in the Kaggle layout (make dataset "
            f"PNG_DIR=/path/to/folder), or synthetic data (make dataset SOURCE=synthetic).")


def download(dest: Path, url: str = CIFAR10_URL, md5: str = CIFAR10_MD5, timeout: float = 30.0) -> Path:
    """Stream `url` into a temp file beside `dest`, check its MD5, then rename it to `dest`.

    A file already at `dest` with the right MD5 is reused. On any failure (network, checksum, Ctrl-C) the partial
    file is removed and nothing exists at `dest`.
    """
    if dest.exists():
        if file_digests(dest, desc=f"verify {dest.name}")["md5"] == md5:
            return dest
        print(f"{dest} does not have the expected MD5 {md5}: downloading it again")
        dest.unlink()
    digest = hashlib.md5()
    with Staged() as staged:
        tmp = staged.path(dest)
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp, open(tmp, "wb") as out:
                total = int(resp.headers.get("Content-Length") or 0) or None
                with tqdm(total=total, unit="B", unit_scale=True, desc=f"download {dest.name}") as bar:
                    while chunk := resp.read(1 << 20):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        except urllib.error.HTTPError as e:
            raise DatasetError(offline_message(url, f"HTTP {e.code} {e.reason}")) from None
        except urllib.error.URLError as e:
            raise DatasetError(offline_message(url, str(e.reason))) from None
        except (TimeoutError, ConnectionError, http.client.HTTPException, ValueError) as e:  # ValueError: bad URL
            raise DatasetError(offline_message(url, f"{type(e).__name__}: {e}")) from None
        except OSError as e:  # not the network: the disk
            raise DatasetError(f"writing the download to {dest.parent} failed ({e.strerror or e})") from None
        if digest.hexdigest() != md5:
            raise DatasetError(f"the file downloaded from {url} has MD5 {digest.hexdigest()}, expected {md5}; the "
                               f"partial file was removed. Run the command again, or download it yourself and pass "
                               f"it with CIFAR=/path/to/{TARBALL_NAME}.")
        staged.commit()
    return dest


# ---------------------------------------------------------------------------------------------------------------
# The official python tarball

class _ArrayUnpickler(pickle.Unpickler):
    """The CIFAR-10 batches are pickles: load them without letting a tampered file run code (only numpy arrays)."""
    ALLOWED = {("_codecs", "encode"), ("numpy", "ndarray"), ("numpy", "dtype"),
               ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct")}

    def find_class(self, module, name):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"unexpected object {module}.{name} in a CIFAR-10 batch")
        return super().find_class(module, name)


def _decode_batch(raw: dict, where: str) -> Split:
    """One batch dict (keys b'data': (N, 3072) uint8 rows of R, G, B planes; b'labels': N ints) -> Split."""
    if not isinstance(raw, dict) or b"data" not in raw or b"labels" not in raw:
        raise DatasetError(f"{where} is not a CIFAR-10 batch (no b'data' / b'labels' entries)")
    data, labels = raw[b"data"], np.asarray(raw[b"labels"], dtype=np.int64)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072:
        raise DatasetError(f"{where}: b'data' must be a uint8 array of shape (N, 3072), got "
                           f"{getattr(data, 'dtype', type(data))} {getattr(data, 'shape', '')}")
    if labels.shape != (len(data),):
        raise DatasetError(f"{where}: {len(data)} images but {labels.size} labels")
    images = np.ascontiguousarray(data.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1))  # CHW rows -> NHWC
    try:
        return Split(images, labels)
    except DatasetError as e:
        raise DatasetError(f"{where}: {e}") from None


def load_tarball(path: Path) -> ImageDataset:
    """Decode the CIFAR-10 python tarball straight from the archive (nothing is extracted to disk)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"tarball {path} does not exist (expected the CIFAR-10 python version, {TARBALL_NAME})")
    digests = file_digests(path, desc=f"checksum {path.name}")
    batches: dict[str, Split] = {}
    label_names = None
    try:
        # Stream mode ("r|*"): one sequential pass, with a progress bar on the compressed bytes read.
        with tqdm.wrapattr(open(path, "rb"), "read", total=digests["bytes"], desc=f"decode {path.name}",
                           leave=False) as raw, tarfile.open(fileobj=raw, mode="r|*") as tar:
            for member in tar:
                name = member.name.rsplit("/", 1)[-1]
                if not member.isfile() or name not in (*TRAIN_BATCHES, TEST_BATCH, "batches.meta"):
                    continue
                obj = _ArrayUnpickler(tar.extractfile(member), encoding="bytes").load()
                if name == "batches.meta":
                    label_names = tuple(n.decode() if isinstance(n, bytes) else n
                                        for n in obj.get(b"label_names", ()))
                else:
                    batches[name] = _decode_batch(obj, f"{path}:{member.name}")
    except (tarfile.TarError, EOFError, zlib.error, OSError, pickle.UnpicklingError, ValueError, KeyError,
            AttributeError, IndexError) as e:
        raise DatasetError(f"tarball {path} is truncated or corrupt ({type(e).__name__}: {e}). Delete it and "
                           f"download it again (make dataset), or use another copy (CIFAR=path).") from None
    missing = [n for n in (*TRAIN_BATCHES, TEST_BATCH) if n not in batches]
    if missing:
        raise DatasetError(f"tarball {path} has no {', '.join(missing)}: is it the CIFAR-10 python version "
                           f"({TARBALL_NAME}), complete?")
    if label_names is not None and label_names != CLASSES:
        raise DatasetError(f"tarball {path}: batches.meta names the classes {label_names}, not CIFAR-10's {CLASSES}")
    train = Split(np.concatenate([batches[n].images for n in TRAIN_BATCHES]),
                  np.concatenate([batches[n].labels for n in TRAIN_BATCHES]))
    info = {"path": str(path), **digests, "official_md5": digests["md5"] == CIFAR10_MD5}
    if not info["official_md5"]:
        print(f"WARNING: {path} has MD5 {digests['md5']}, not the official CIFAR-10 tarball's {CIFAR10_MD5}; it is "
              "used as given and the manifest records official_md5: false", file=sys.stderr)
    return ImageDataset(train, batches[TEST_BATCH], source="tarball", info=info)


def tarball_fingerprint(path: Path) -> str:
    return "sha256:" + file_digests(Path(path), desc=f"checksum {Path(path).name}")["sha256"]


# ---------------------------------------------------------------------------------------------------------------
# A folder of PNGs, Kaggle layout: train/1.png ... train/N.png + trainLabels.csv (id,label with class names)

def _png_ids(folder: Path) -> dict[int, Path]:
    ids = {}
    for p in folder.iterdir():
        if p.suffix.lower() == ".png":
            if not p.stem.isdigit():
                raise DatasetError(f"{p}: PNG names must be numeric ids (1.png, 2.png, ...) matching the labels file")
            ids[int(p.stem)] = p
    return ids


def _read_labels(csv_path: Path) -> dict[int, int]:
    labels: dict[int, int] = {}
    with open(csv_path, newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if header is None or [h.strip() for h in header] != ["id", "label"]:
            raise DatasetError(f"{csv_path}: the first line must be the header 'id,label', found {header}")
        for lineno, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != 2 or not row[0].strip().isdigit() or row[1].strip() not in CLASSES:
                raise DatasetError(f"{csv_path} line {lineno}: expected '<id>,<class name>' with a class among "
                                   f"{', '.join(CLASSES)}; found {','.join(row)!r}")
            i = int(row[0])
            if i in labels:
                raise DatasetError(f"{csv_path} line {lineno}: id {i} appears twice")
            labels[i] = CLASSES.index(row[1].strip())
    return labels


def _list_png_split(root: Path, split: str) -> tuple[list[Path], np.ndarray] | None:
    """Files (sorted by id) and labels of root/<split>/ + root/<split>Labels.csv; None if either is absent."""
    folder, csv_path = root / split, root / f"{split}Labels.csv"
    if not folder.is_dir() or not csv_path.is_file():
        return None
    files, labels = _png_ids(folder), _read_labels(csv_path)
    if not files:
        raise DatasetError(f"{folder} contains no PNG files")
    if not labels:
        raise DatasetError(f"{csv_path} has a header but no rows")
    no_label, no_file = sorted(files.keys() - labels.keys()), sorted(labels.keys() - files.keys())
    if no_label:
        raise DatasetError(f"{csv_path} has no row for {len(no_label)} PNG file(s): "
                           f"{', '.join(str(files[i]) for i in no_label[:5])}{' ...' if len(no_label) > 5 else ''}")
    if no_file:
        raise DatasetError(f"{csv_path} lists {len(no_file)} id(s) with no {split}/<id>.png: "
                           f"{', '.join(map(str, no_file[:5]))}{' ...' if len(no_file) > 5 else ''}")
    ids = sorted(files)
    return [files[i] for i in ids], np.array([labels[i] for i in ids], dtype=np.int64)


def _read_pngs(paths: list[Path]) -> np.ndarray:
    from PIL import Image, UnidentifiedImageError
    out = np.empty((len(paths), *IMAGE_SHAPE), dtype=np.uint8)
    for k, p in enumerate(paths):
        try:
            with Image.open(p) as im:
                if im.format != "PNG" or im.mode != "RGB" or im.size != IMAGE_SHAPE[1::-1]:
                    raise DatasetError(f"{p}: expected a 32x32 RGB PNG, found a {im.size[0]}x{im.size[1]} "
                                       f"{im.mode} {im.format} (convert it, or re-export the folder)")
                out[k] = np.asarray(im)
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
            raise DatasetError(f"{p}: cannot be read as a PNG ({e})") from None
    return out


def _parallel_chunks(fn, items: list, workers: int, desc: str, chunk: int = 512, unit: str = "img") -> list:
    """fn over consecutive chunks of items (processes if workers > 1), with a progress bar; results in order."""
    parts = [items[i:i + chunk] for i in range(0, len(items), chunk)]
    bar = tqdm(total=len(items), desc=desc, unit=unit, leave=False)
    try:
        if workers <= 1 or len(parts) == 1:
            results = []
            for part in parts:
                results.append(fn(part))
                bar.update(len(part))
            return results
        with ProcessPoolExecutor(workers, initializer=worker_init) as pool:
            results = []
            for part, res in zip(parts, pool.map(fn, parts)):
                results.append(res)
                bar.update(len(part))
            return results
    finally:
        bar.close()


def _parse_holdout(holdout: str | float | int, n: int, where: Path) -> int:
    value = float(holdout)
    count = int(value) if value >= 1 else int(round(value * n))
    if value <= 0 or (value >= 1 and value != int(value)) or not 0 < count < n:
        raise DatasetError(f"{where} has no test/ + testLabels.csv, so the test split is held out of its {n} train "
                           f"images; --png-holdout {holdout} does not leave both splits non-empty (give a fraction "
                           f"in (0, 1) or a count below {n})")
    return count


def _png_layout(root: Path) -> tuple[tuple, tuple | None]:
    """(files, labels) of train/ and of test/ (None if absent); DatasetError if the layout is not Kaggle's."""
    if not root.is_dir():
        raise DatasetError(f"PNG folder {root} does not exist")
    train = _list_png_split(root, "train")
    if train is None:
        raise DatasetError(f"PNG folder {root} has no train/ + trainLabels.csv (expected the Kaggle layout: "
                           f"train/1.png ... train/N.png and trainLabels.csv with the header 'id,label')")
    return train, _list_png_split(root, "test")


def png_fingerprint(root: Path) -> str:
    """SHA-256 over every labels file and PNG of the layout (names and bytes), in a fixed order."""
    root = Path(root)
    _png_layout(root)  # a wrong layout is one error line, before any progress bar starts
    h = hashlib.sha256()
    paths = sorted(p for p in root.glob("*Labels.csv")) + sorted(
        (p for split in ("train", "test") if (root / split).is_dir() for p in (root / split).glob("*.png")),
        key=lambda p: (p.parent.name, int(p.stem) if p.stem.isdigit() else -1, p.name))
    for p in tqdm(paths, desc=f"checksum {root.name}", unit="file", leave=False):
        h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes())
    return "sha256:" + h.hexdigest()


def load_png_dir(root: Path, holdout: str | float | int = 0.2, workers: int = 1) -> ImageDataset:
    """Read a Kaggle-layout PNG folder. Without test/ + testLabels.csv (the real Kaggle set has no test labels), the
    test split is the last `holdout` train images by id: a fraction in (0, 1) or a count (0.2 of 50,000 = 10,000)."""
    root = Path(root)
    train, test = _png_layout(root)
    files = train[0] + (test[0] if test else [])
    images = np.concatenate(_parallel_chunks(_read_pngs, files, workers, desc=f"decode {root.name}"))
    n_train = len(train[0])
    info = {"path": str(root)}
    if test:
        train_split = Split(images[:n_train], train[1])
        test_split = Split(images[n_train:], test[1])
        info["test_split"] = "test/ + testLabels.csv"
    else:
        n_test = _parse_holdout(holdout, n_train, root)
        cut = n_train - n_test
        train_split = Split(images[:cut], train[1][:cut])
        test_split = Split(images[cut:], train[1][cut:])
        info["test_split"] = (f"no test/ + testLabels.csv: the last {n_test} of {n_train} train images by id "
                              f"(--png-holdout {holdout})")
    return ImageDataset(train_split, test_split, source="png", info=info)


def export_png_dir(data: ImageDataset, root: Path, workers: int = 1) -> None:
    """Write data in the Kaggle layout that load_png_dir reads (into `root`, which must not exist yet)."""
    root = Path(root)
    for split_name, split in (("train", data.train), ("test", data.test)):
        folder = root / split_name
        folder.mkdir(parents=True)
        paths = [folder / f"{i + 1}.png" for i in range(len(split))]
        jobs = [(p, split.images[i]) for i, p in enumerate(paths)]
        _parallel_chunks(_write_pngs, jobs, workers, desc=f"export {split_name} PNGs")
        with open(root / f"{split_name}Labels.csv", "w", newline="") as f:
            w = csv.writer(f, lineterminator="\n")
            w.writerow(["id", "label"])
            w.writerows((i + 1, CLASSES[label]) for i, label in enumerate(split.labels.tolist()))


def _write_pngs(jobs: list) -> None:
    from PIL import Image
    for path, image in jobs:
        Image.fromarray(image).save(path, format="PNG")


# ---------------------------------------------------------------------------------------------------------------
# Synthetic: deterministic, CIFAR-shaped, with structure and texture (so JPEG has something real to lose)

_SYNTH_CHUNK = 1000  # images per RNG stream: fixed, so the output depends only on (seed, split, counts)


def _class_colors() -> np.ndarray:
    hue = np.arange(len(CLASSES)) / len(CLASSES) * 2 * np.pi
    rgb = np.stack([np.cos(hue), np.cos(hue - 2 * np.pi / 3), np.cos(hue + 2 * np.pi / 3)], axis=1)
    return (127.5 + 90 * rgb).astype(np.float32)  # (10, 3): one dominant colour per class


def _synthetic_chunk(rng: np.random.Generator, labels: np.ndarray) -> np.ndarray:
    n, f32 = len(labels), np.float32
    yy, xx = np.meshgrid(np.linspace(0, 1, 32, dtype=f32), np.linspace(0, 1, 32, dtype=f32), indexing="ij")

    def per_image(low, high, k=1):  # k random values per image, shaped (n, k, 1, 1) to broadcast over 32x32
        return rng.uniform(low, high, (n, k)).astype(f32)[:, :, None, None]

    # Background: a linear gradient from the class colour to a random colour, along a random direction.
    theta = per_image(0, 2 * np.pi)
    t = np.cos(theta) * (xx - 0.5) + np.sin(theta) * (yy - 0.5) + 0.5  # (n, 1, 32, 32), roughly in [0, 1]
    c0 = _class_colors()[labels][:, :, None, None] * per_image(0.6, 1.1)
    img = c0 + (per_image(0, 255, 3) - c0) * t  # (n, 3, 32, 32)
    # Two soft blobs ("objects") of random colour, size and place.
    for _ in range(2):
        cy, cx, sigma = per_image(0.15, 0.85), per_image(0.15, 0.85), per_image(0.06, 0.22)
        weight = np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * sigma ** 2)) * per_image(0.5, 0.95)
        img += (per_image(0, 255, 3) - img) * weight
    # Stripes at a random frequency and angle (mid-frequency texture) and fine grain (what JPEG mostly loses).
    phi, freq = per_image(0, np.pi), per_image(2, 8)
    img += np.sin(2 * np.pi * freq * (np.cos(phi) * xx + np.sin(phi) * yy) + per_image(0, 2 * np.pi)) * per_image(5, 25)
    img += (rng.random(img.shape, dtype=f32) - 0.5) * 20  # uniform grain, std ~6
    np.rint(img, out=img)
    np.clip(img, 0, 255, out=img)
    return img.astype(np.uint8).transpose(0, 2, 3, 1)  # -> (n, 32, 32, 3)


def _synthetic_jobs(jobs: list) -> np.ndarray:
    return np.concatenate([_synthetic_chunk(np.random.default_rng(key), labels) for key, labels in jobs])


def _synthetic_split(n: int, seed: int, split_id: int, workers: int = 1) -> Split:
    labels = np.random.default_rng([seed, split_id]).permutation(np.arange(n) % len(CLASSES)).astype(np.int64)
    jobs = [([seed, split_id, k], labels[start:start + _SYNTH_CHUNK])
            for k, start in enumerate(range(0, n, _SYNTH_CHUNK))]
    name = ("train", "test")[split_id]
    parts = _parallel_chunks(_synthetic_jobs, jobs, workers, desc=f"generate synthetic {name}", chunk=1,
                             unit="chunk")
    return Split(np.concatenate(parts), labels)


def synthetic_spec(num_train: int = 50_000, num_test: int = 10_000, seed: int = 0) -> dict:
    return {"num_train": num_train, "num_test": num_test, "seed": seed, "generator_version": SYNTHETIC_VERSION}


def synthetic_fingerprint(spec: dict) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def load_synthetic(num_train: int = 50_000, num_test: int = 10_000, seed: int = 0, workers: int = 1) -> ImageDataset:
    """Deterministic CIFAR-shaped data: balanced labels, class-coloured gradients, blobs, stripes and grain."""
    if num_train < 1 or num_test < 1:
        raise DatasetError(f"synthetic data needs at least one train and one test image, got {num_train}/{num_test}")
    spec = synthetic_spec(num_train, num_test, seed)
    return ImageDataset(_synthetic_split(num_train, seed, 0, workers), _synthetic_split(num_test, seed, 1, workers),
                   source="synthetic", info=dict(spec))


# ---------------------------------------------------------------------------------------------------------------

def load_source(source: str, *, tarball: Path | None = None, png_dir: Path | None = None,
                cache_dir: Path | None = None, url: str = CIFAR10_URL, png_holdout: str | float = 0.2,
                num_train: int = 50_000, num_test: int = 10_000, seed: int = 0, workers: int = 1) -> ImageDataset:
    """The whole dataset from one source, as arrays. 'download' keeps the tarball in cache_dir for the next run."""
    if source == "download":
        if cache_dir is None:
            raise ValueError("source 'download' needs cache_dir (where the tarball is kept)")
        path = download(Path(cache_dir) / TARBALL_NAME, url=url)
        data = load_tarball(path)
        data.source = "download"
        data.info["url"] = url
        return data
    if source == "tarball":
        if tarball is None:
            raise DatasetError("source 'tarball' needs a path: make dataset CIFAR=/path/to/cifar-10-python.tar.gz")
        return load_tarball(Path(tarball))
    if source == "png":
        if png_dir is None:
            raise DatasetError("source 'png' needs a folder: make dataset PNG_DIR=/path/to/folder")
        return load_png_dir(Path(png_dir), holdout=png_holdout, workers=workers)
    if source == "synthetic":
        return load_synthetic(num_train, num_test, seed, workers)
    raise DatasetError(f"unknown source {source!r}: use download, tarball, png or synthetic")

