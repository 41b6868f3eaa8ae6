"""Reading the training data: four interchangeable loaders behind one small interface.

    loader = make_loader(DataConfig(path="data/cifar10_train_raw.beton", loader="ffcv"), device)
    loader.set_epoch(epoch)                      # replays that epoch's order (resume)
    for images, labels in loader:                # uint8 (B, 3, H, W) channels_last, int64 (B,), both on `device`
        x = prepare_batch(images, flip=True, channels_last=True)   # float in [-1, 1], eager, before the model

Loaders (DataConfig.loader):
- "ffcv": FFCV Loader over the .beton (raw or JPEG), pipeline ending in ToDevice(non_blocking=True).
- "torch-memory": the raw .beton read once into numpy, then a torch DataLoader over the uint8 arrays.
- "torch-files": a torch DataLoader over a PNG folder (Kaggle layout), PIL decode per image.
- "gpu": the whole uint8 dataset resident on the device; a device randperm and index_select per batch.

Writing the .beton files is tools/' job; this module only reads them.
"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import queue
import warnings
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ffcv_ddpm.env import cpu_count
from ffcv_ddpm.numba_cache import cache_typed_dict

LOADERS = ("ffcv", "torch-files", "torch-memory", "gpu")
ORDERS = ("random", "quasi_random", "sequential")
FLIPS = ("gpu", "cpu", "none")
# Label order of CIFAR-10 (and of the Kaggle trainLabels.csv class names).
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
_MAKE_DATASET_HINT = "create it with `make dataset` (or `python -m tools.make_dataset --help`)"


def default_workers() -> int:
    return max(1, min(8, cpu_count() or 1))


@dataclass
class DataConfig:
    path: str = "data/cifar10_train_raw.beton"  # train .beton (fields 'image', 'label'); read by all but torch-files
    loader: str = "ffcv"          # ffcv | torch-files | torch-memory | gpu
    batch_size: int = 128         # images per batch (per rank when distributed)
    # FFCV: decode threads (<1 = all cores, FFCV's rule); torch: processes (0 = main). Default: 8, or this
    # process's cores if fewer (more threads than numba may start would only be capped, with a warning).
    num_workers: int = field(default_factory=lambda: default_workers())
    order: str = "random"         # random | quasi_random (FFCV page-local shuffle; plain random elsewhere) | sequential
    os_cache: bool = True         # FFCV: page cache via mmap (True) or FFCV's own process cache (False)
    flip: str = "gpu"             # gpu: prepare_batch flips on the device | cpu: flipped inside the loader | none
    png_dir: str | None = None    # torch-files: folder of 1.png..N.png; labels in <folder>Labels.csv beside it
    drop_last: bool = True        # drop the last incomplete batch of each epoch
    seed: int = 0                 # data order (and CPU flips) = f(seed, epoch): a resumed run replays the same order
    pin_memory: bool = True       # torch loaders: page-locked host batches so the copy to CUDA is asynchronous

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the bad field (also called by make_loader: fields may be set after __init__)."""
        self.path = os.fspath(self.path)
        if self.png_dir is not None:
            self.png_dir = os.fspath(self.png_dir)
        for name, choices in (("loader", LOADERS), ("order", ORDERS), ("flip", FLIPS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"data.{name}={getattr(self, name)!r} is not one of {', '.join(choices)}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"data.batch_size={self.batch_size!r} must be a positive integer")
        if self.loader == "gpu" and self.flip == "cpu":
            raise ValueError("data.flip='cpu' does not apply to loader='gpu' (its images never leave the device); "
                             "use flip='gpu'")
        if self.loader == "torch-files" and not self.png_dir:
            raise ValueError("loader='torch-files' needs data.png_dir (a folder of 1.png..N.png, e.g. data/png/train)")


# ---- checks and metadata ---------------------------------------------------------------------------------------

def missing_input(cfg: DataConfig, assume_present: Collection[Path] = ()) -> str | None:
    """What cfg.loader reads that is not on disk -- the .beton, or (torch-files) the PNG folder and its labels CSV --
    as one message that says how to make it; None when all is there. The loaders raise the same message as
    FileNotFoundError when they start; a benchmark asks first, before it starts anything. `assume_present`: paths
    the caller is about to write itself (a benchmark's synthetic dataset)."""
    if cfg.loader == "torch-files":
        return _missing_png(Path(cfg.png_dir), assume_present)
    return _missing_beton(Path(cfg.path), assume_present)


def _missing_beton(path: Path, assume_present: Collection[Path] = ()) -> str | None:
    if path.exists() or path in assume_present:  # a path that is there but no file is _open_beton's ValueError
        return None
    return f"dataset {path} not found; {_MAKE_DATASET_HINT}"


def png_labels(folder: Path) -> Path:
    """The labels CSV of a Kaggle-layout PNG folder: beside it, named after it (png/train -> png/trainLabels.csv)."""
    return folder.parent / f"{folder.name}Labels.csv"


def _missing_png(folder: Path, assume_present: Collection[Path] = ()) -> str | None:
    labels = png_labels(folder)
    folder_there = folder.is_dir() or folder in assume_present
    if folder_there and (labels.is_file() or labels in assume_present):
        return None
    what = (f"labels {labels} of PNG folder {folder}" if folder_there
            else f"PNG folder {folder} (with its labels {labels})")
    return f"{what} not found; {_png_export_hint(folder)}"


def _png_export_hint(folder: Path) -> str:
    """How to write `folder`: tools.make_dataset --export-png DIR writes DIR/train and DIR/test with their CSVs, from
    the source it also writes the .beton files from (the same source, or it rewrites them to match)."""
    export = folder.parent
    data = export.parent if export.name == "png" else "DATA"  # `make dataset-png DATA=D` exports to D/png
    command = f"`python -m tools.make_dataset --source ... --out {data} --export-png {export}`"
    if export.name == "png":
        command = f"`make dataset-png DATA={data} SOURCE=...` or {command}"
    return f"export it with {command}, giving the source the .beton files in {data} were made from"


# The .beton layout as FFCV 1.0 writes it (ffcv.types, format version 2), for the files of this project: an RGB image
# and an integer label per sample. Reading a header this way spares a process FFCV's and numba's import (~0.6 s, every
# trainer with an in-memory loader and every study); a file with any other field type is read by FFCV's own Reader.
_BETON_VERSION = 2
_HEADER = np.dtype([("version", "<u2"), ("num_fields", "<u2"), ("page_size", "<u4"), ("num_samples", "<u8"),
                    ("alloc_table_ptr", "<u8")], align=True)
_FIELD_DESC = np.dtype([("type_id", "<u1"), ("name", ("<u1", 16)), ("arguments", ("<u1", (1024,)))], align=True)
_ALLOC_TABLE = np.dtype([("sample_id", "<u8"), ("ptr", "<u8"), ("size", "<u8")])
_FIELD_TYPES = {0: "FloatField", 1: "IntField", 2: "RGBImageField", 3: "BytesField", 4: "NDArrayField",
                5: "JSONField", 6: "TorchTensorField"}  # ffcv.types.TYPE_ID_HANDLER
_METADATA = {"IntField": np.dtype("<i8"),  # the value itself
             "RGBImageField": np.dtype([("mode", "<u1"), ("width", "<u2"), ("height", "<u2"), ("data_ptr", "<u8")])}
_RAW = 1  # RGBImageField's mode of an image stored as its H*W*3 bytes (ffcv.fields.rgb_image.IMAGE_MODES; JPEG: 0)


@dataclass
class _Beton:
    """What data.py reads of a .beton's header: the fields of ffcv.reader.Reader that it uses."""
    file_name: str
    num_samples: int
    field_names: list[str]
    field_types: dict[str, str]  # field name -> FFCV's field class name
    metadata: np.ndarray         # (num_samples,) one record per sample, field i at "f{i}"
    alloc_table: np.ndarray      # _ALLOC_TABLE records: where each sample's data lies in the file


def _read_header(path: str) -> _Beton | None:
    """The header, fields, metadata and allocation table of a .beton read with numpy; None for anything but a
    well-formed version-2 file of IntField and RGBImageField fields (FFCV's Reader then reads it, or says why not)."""
    size = os.path.getsize(path)
    if size < _HEADER.itemsize:
        return None
    header = np.fromfile(path, dtype=_HEADER, count=1)[0]
    n, fields = int(header["num_samples"]), int(header["num_fields"])
    if header["version"] != _BETON_VERSION or _HEADER.itemsize + fields * _FIELD_DESC.itemsize > size:
        return None
    desc = np.fromfile(path, dtype=_FIELD_DESC, count=fields, offset=_HEADER.itemsize)
    try:
        names = [d["name"].tobytes().decode("ascii").split("\0")[0] for d in desc]  # ffcv.utils' decoding
    except UnicodeDecodeError:
        return None
    types = [_FIELD_TYPES.get(int(t)) for t in desc["type_id"]]
    if any(t not in _METADATA for t in types):
        return None
    meta_type = np.dtype([("", _METADATA[t]) for t in types], align=True)  # ffcv.types.get_metadata_type
    offset = _HEADER.itemsize + desc.nbytes
    if offset + n * meta_type.itemsize > size or int(header["alloc_table_ptr"]) > size:
        return None
    metadata = np.fromfile(path, dtype=meta_type, count=n, offset=offset)
    alloc = np.fromfile(path, dtype=_ALLOC_TABLE, offset=int(header["alloc_table_ptr"]))
    return _Beton(path, n, names, dict(zip(names, types)), metadata, alloc)


def _open_beton(path):
    """The header of a .beton that has an RGB 'image' and an integer 'label' field; clear errors otherwise."""
    p = Path(path)
    if missing := _missing_beton(p):
        raise FileNotFoundError(missing)
    if not p.is_file():
        raise ValueError(f"dataset {p} is not a file; expected an FFCV .beton such as data/cifar10_train_raw.beton")
    reader = _read_header(os.fspath(p))
    if reader is None:
        reader = _ffcv_header(p)
    wanted = {"image": "RGBImageField", "label": "IntField"}
    if any(reader.field_types.get(name) != cls for name, cls in wanted.items()):
        raise ValueError(f"{p} needs fields 'image' (RGBImageField) and 'label' (IntField) but has "
                         f"{reader.field_types}; {_MAKE_DATASET_HINT}")
    if reader.num_samples == 0:
        raise ValueError(f"{p} holds no images; {_MAKE_DATASET_HINT}")
    return reader


def _ffcv_header(p: Path) -> _Beton:
    """_read_header's answer from FFCV's own Reader: every field type FFCV knows, and its errors for a foreign file."""
    cache_typed_dict()
    from ffcv.reader import Reader

    try:
        reader = Reader(str(p))
    except Exception as e:  # FFCV fails in many ways on a foreign file (IndexError, AssertionError, KeyError, ...)
        raise ValueError(f"{p} is not a readable FFCV .beton ({type(e).__name__}: {e}); "
                         f"{_MAKE_DATASET_HINT}") from None
    return _Beton(str(p), int(reader.num_samples), reader.field_names,
                  {name: type(h).__name__ for name, h in reader.handlers.items()}, reader.metadata,
                  reader.alloc_table)


def _image_size(reader) -> tuple[int, int]:
    """(H, W) shared by every image; the decoder (SimpleRGBImageDecoder) requires a single size."""
    meta = reader.metadata[f"f{reader.field_names.index('image')}"]
    heights, widths = np.unique(meta["height"]), np.unique(meta["width"])
    if len(heights) != 1 or len(widths) != 1:
        raise ValueError(f"{reader.file_name} mixes image sizes (heights {heights[:5]}, widths {widths[:5]}); "
                         "this trainer needs one size: rewrite it with tools.make_dataset")
    return int(heights[0]), int(widths[0])


def check_beton(path) -> None:
    """FileNotFoundError / ValueError saying what is wrong with `path` and how to fix it; None when usable."""
    _image_size(_open_beton(path))


def check_dataset(cfg: DataConfig, image_shape: tuple[int, int, int], world_size: int = 1) -> None:
    """Before anything is built or written: the data `cfg` reads exists, its images are `image_shape` (C, H, W) as
    the model is built for, and each rank's share holds a batch. FileNotFoundError / ValueError otherwise."""
    if cfg.loader == "torch-files":
        dataset = _PNGDataset(cfg.png_dir)
        where, num_images, shape = f"PNG folder {cfg.png_dir}", len(dataset), dataset.image_shape
    else:
        reader = _open_beton(cfg.path)
        where, num_images, shape = cfg.path, int(reader.num_samples), (3, *_image_size(reader))
    if shape != tuple(image_shape):
        (c, h, w), (mc, mh, mw) = shape, image_shape
        # Name the field that differs: a channel mismatch is fixed by model.in_channels, not by the image size.
        sets = ([f"model.in_channels={c}"] if c != mc else []) + ([f"model.image_size={h}"] if (h, w) != (mh, mw)
                                                                  and h == w else [])
        fix = ("the model needs square images: resize them" if h != w else f"set {' '.join(sets)}") + \
              " or use data of the model's shape"
        raise ValueError(f"{where} holds {h}x{w} images with {c} channels, but the model is built for {mh}x{mw} "
                         f"with {mc} (model.image_size={mh}, model.in_channels={mc}); {fix}")
    _check_batches_fit(cfg, num_images, world_size)


def _check_batches_fit(cfg: DataConfig, num_images: int, world_size: int) -> None:
    if num_images < world_size:
        raise ValueError(f"{num_images} images cannot be shared by {world_size} ranks; use more data or fewer ranks")
    if cfg.drop_last and num_images // world_size < cfg.batch_size:
        raise ValueError(f"{cfg.loader} loader: data.batch_size={cfg.batch_size} exceeds the "
                         f"{num_images // world_size} images per rank with drop_last=True; "
                         "lower data.batch_size or set data.drop_last=False")


def train_beton(data) -> str:
    """--data as every command takes it: a .beton file, or a dataset folder holding one *_train_raw.beton (what
    tools.make_dataset writes: cifar10_, digits_ or mnist_train_raw.beton)."""
    data = Path(data)
    if data.suffix == ".beton" or not data.is_dir():
        return os.fspath(data)
    found = sorted(data.glob("*_train_raw.beton"))
    if len(found) != 1:
        raise ValueError(f"--data {data}: expected one *_train_raw.beton in that folder, found "
                         f"{', '.join(p.name for p in found) or 'none'}; {_MAKE_DATASET_HINT}, or give the .beton")
    return os.fspath(found[0])


def dataset_info(path) -> dict:
    """What a result should record about its data: counts, image size, and the manifest's source/synthetic flag.

    manifest.json beside the .beton is written by tools.make_dataset; without one, source and synthetic are None
    (unknown), never guessed.
    """
    reader = _open_beton(path)
    height, width = _image_size(reader)
    manifest_path = Path(path).parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else None
    return {
        "path": os.fspath(path),
        "num_images": int(reader.num_samples),
        "height": height,
        "width": width,
        "source": manifest.get("source") if manifest else None,
        "synthetic": manifest.get("synthetic") if manifest else None,
        "manifest": manifest,
    }


# read_beton's last reads in this process: {(path, inode, size, mtime_ns): (images, labels)}. A study reads the same
# small .beton several times (the judge's training, the test set, the floor, each model's trainer), and every FFCV
# Loader compiles its pipeline again (~1 s on a CPU, most of reading the digits). The last reads are kept up to
# READ_CACHE_BYTES of images in all (the digits' two splits: 11 MB; a bigger file is never kept); callers get
# copies, so none can change another's arrays. A file rewritten since (another inode, size or mtime) is read again.
_read_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
READ_CACHE_BYTES = 64 * 2**20


def read_beton(path, num_workers: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """All images (N, H, W, 3) uint8 and labels (N,) int64 of a .beton, in file order (one sequential FFCV pass)."""
    st = os.stat(path)
    key = (os.path.realpath(path), st.st_ino, st.st_size, st.st_mtime_ns)
    if key in _read_cache:
        images, labels = _read_cache[key] = _read_cache.pop(key)  # now the most recent
        return images.copy(), labels.copy()
    images, labels = _read_beton(path, num_workers)
    if images.nbytes <= READ_CACHE_BYTES:
        _read_cache[key] = images.copy(), labels.copy()
        while sum(i.nbytes for i, _ in _read_cache.values()) > READ_CACHE_BYTES:
            del _read_cache[next(iter(_read_cache))]  # the least recently read
    return images, labels


def _read_beton(path, num_workers: int | None) -> tuple[np.ndarray, np.ndarray]:
    threads = torch.get_num_threads()  # before FFCV's import, which sets it to 1
    try:
        reader = _open_beton(path)
        raw = _read_raw(reader)
        return raw if raw is not None else _decode_beton(reader, num_workers)
    finally:
        # FFCV's import and its Loader set torch's intra-op thread count (to 1, to the Loader's worker count:
        # ffcv.pipeline.compiler.Compiler): a one-shot read gives the process its own back (on a busy CPU, 2 threads
        # instead of 1 made every convolution of the tests that followed 10-30x slower).
        torch.set_num_threads(threads)


def _read_raw(reader) -> tuple[np.ndarray, np.ndarray] | None:
    """What _decode_beton reads from a .beton whose images are all stored raw, copied out of the file by numpy: a raw
    image is its H*W*3 bytes at its data_ptr (ffcv.fields.RGBImageField.encode), a label is its metadata. None when
    any image is a JPEG. FFCV's Loader compiles its pipeline with numba for every file (~1 s on a CPU, paid by every
    process with an in-memory loader, every study and every test that reads one); this is a copy."""
    meta = reader.metadata[f"f{reader.field_names.index('image')}"]
    if (meta["mode"] != _RAW).any():
        return None
    height, width = _image_size(reader)
    size = height * width * 3
    data = np.memmap(reader.file_name, dtype=np.uint8, mode="r")
    # Each raw image is one allocation of exactly its bytes, inside the file (the bytes FFCV's reader copies).
    order = np.argsort(reader.alloc_table["ptr"])
    ptrs, sizes = reader.alloc_table["ptr"][order], reader.alloc_table["size"][order]
    at = np.minimum(np.searchsorted(ptrs, meta["data_ptr"]), len(ptrs) - 1)
    if (ptrs[at] != meta["data_ptr"]).any() or (sizes[at] != size).any() or (ptrs[at] + size > len(data)).any():
        raise ValueError(f"{reader.file_name}: an image's bytes are not where its metadata says; "
                         f"{_MAKE_DATASET_HINT}")
    images = np.empty((len(meta), height, width, 3), dtype=np.uint8)
    flat = images.reshape(len(meta), size)  # a view: each row one image
    for i, ptr in enumerate(meta["data_ptr"].tolist()):
        flat[i] = data[ptr:ptr + size]
    return images, reader.metadata[f"f{reader.field_names.index('label')}"].astype(np.int64)


def _decode_beton(reader, num_workers: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Every image and label of the .beton through FFCV's Loader (its JPEG decoder), in file order."""
    cache_typed_dict()
    from ffcv.fields.decoders import IntDecoder, SimpleRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import Squeeze, ToTensor

    n = int(reader.num_samples)
    height, width = _image_size(reader)
    images = np.empty((n, height, width, 3), dtype=np.uint8)
    labels = np.empty(n, dtype=np.int64)
    start = 0
    loader = Loader(reader.file_name, batch_size=min(n, 1024), order=OrderOption.SEQUENTIAL, drop_last=False,
                    num_workers=_ffcv_threads(num_workers or min(cpu_count() or 1, 8)),
                    pipelines={"image": [SimpleRGBImageDecoder(), ToTensor()],
                               "label": [IntDecoder(), ToTensor(), Squeeze(1)]})
    for x, y in loader:  # FFCV reuses its output buffers: copy each batch out before the next one arrives
        images[start:start + len(x)] = x.numpy()
        labels[start:start + len(y)] = y.numpy()
        start += len(x)
    assert start == n, f"read {start} of {n} images from {reader.file_name}"
    return images, labels


# ---- the interface -----------------------------------------------------------------------------------------------

class BatchLoader:
    """Yields (images uint8 (B, 3, H, W) channels_last, labels int64 (B,)) on `device`, one epoch per iteration.

    Each `iter()` runs epoch `self.epoch` and then advances it; `set_epoch(e)` chooses the next epoch to run. The
    order of an epoch depends only on (seed, epoch, rank, world_size), so a resumed run replays the same batches.
    So do the torch loaders' CPU flips; FFCV's CPU flip does not (RandomHorizontalFlip draws from numba's own RNG).
    """

    def __init__(self, cfg: DataConfig, device: torch.device, rank: int, world_size: int,
                 num_images: int, image_shape: tuple[int, int, int]):
        self.cfg, self.device, self.rank, self.world_size = cfg, device, rank, world_size
        self.num_images = num_images      # images in the whole dataset (all ranks)
        self.image_shape = image_shape    # (3, H, W)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        epoch, self.epoch = self.epoch, self.epoch + 1
        return self._epoch_batches(epoch)

    def __len__(self) -> int:
        """Batches per epoch on this rank (the shard is num_images // world_size; see epoch_order)."""
        per_rank = self.num_images // self.world_size
        return per_rank // self.cfg.batch_size if self.cfg.drop_last else -(-per_rank // self.cfg.batch_size)

    def _epoch_batches(self, epoch: int):
        raise NotImplementedError


def endless(loader: BatchLoader, epoch: int | None = None, skip: int = 0):
    """Batches across epoch boundaries, from `epoch` (default: the loader's next one) on, the first `skip` batches of
    that epoch left out (a resumed run). What an epoch's start costs stays inside whatever is timed, as in training.

    On a GPU the next epoch is started while the last batch of the current one is still to be handed out: its
    start-up (FFCV: a stream drain and the first decode of its prefetch thread) then overlaps the GPU's work on that
    batch instead of leaving the GPU idle between epochs (benchmarks/NOTES.md item 10). Not on the CPU: there FFCV's
    decode thread would run beside the step's own CPU kernels, which share its OpenMP runtime, and the losses would
    stop being bit-reproducible (seen: three identical CPU runs, three different curves). The order is the same.
    """
    if epoch is not None:
        loader.set_epoch(epoch)
    it = iter(loader)
    try:
        for _ in range(skip):
            next(it)
        if loader.device.type != "cuda":
            while True:
                yield from it
                it = iter(loader)
        held = next(it)
        while True:
            for batch in it:
                yield held
                held = batch
            it = iter(loader)  # the next epoch starts here, with `held` (this epoch's last batch) not yet used
            yield held
            held = next(it)
    finally:
        if hasattr(it, "close"):  # a generator: its own finally stops the loader's threads
            it.close()


def epoch_order(num_images: int, cfg: DataConfig, epoch: int, rank: int, world_size: int) -> np.ndarray:
    """Indices this rank reads in `epoch`: a seeded permutation (FFCV's RANDOM formula) or file order, sharded.

    Sharding truncates to a multiple of world_size and deals indices round-robin, so ranks get disjoint, equal
    shares (FFCV's distributed mode instead pads with repeats, as torch's DistributedSampler does).
    """
    if cfg.order == "sequential":
        order = np.arange(num_images)
    else:  # quasi_random only saves disk reads in FFCV's page cache; for data in memory it is plain random
        order = np.random.default_rng(cfg.seed + epoch).permutation(num_images)
    per_rank = num_images // world_size
    return order[:per_rank * world_size][rank::world_size]


class _FFCVBatches(BatchLoader):
    def __init__(self, cfg, device, rank, world_size):
        cache_typed_dict()
        from ffcv.fields.decoders import IntDecoder, SimpleRGBImageDecoder
        from ffcv.loader import OrderOption
        from ffcv.transforms import RandomHorizontalFlip, Squeeze, ToDevice, ToTensor, ToTorchImage

        from ffcv_ddpm.ffcv_loader import OrderedLoader

        reader = _open_beton(cfg.path)
        height, width = _image_size(reader)
        super().__init__(cfg, device, rank, world_size, int(reader.num_samples), (3, height, width))
        distributed = world_size > 1
        if distributed:
            _check_process_group(rank, world_size)
            if cfg.order == "quasi_random":
                raise ValueError("FFCV has no distributed QUASI_RANDOM order; use data.order='random'")
        image = [SimpleRGBImageDecoder()]
        if cfg.flip == "cpu":
            image.append(RandomHorizontalFlip())
        # ToTorchImage after the copy: the (B, H, W, 3) buffer is viewed as (B, 3, H, W) in channels_last
        image += [ToTensor(), ToDevice(device, non_blocking=True), ToTorchImage(channels_last=True)]
        label = [IntDecoder(), ToTensor(), ToDevice(device, non_blocking=True), Squeeze(1)]
        order = {"random": OrderOption.RANDOM, "quasi_random": OrderOption.QUASI_RANDOM,
                 "sequential": OrderOption.SEQUENTIAL}[cfg.order]
        self._loader = OrderedLoader(cfg.path, batch_size=cfg.batch_size, num_workers=_ffcv_threads(cfg.num_workers),
                                     os_cache=cfg.os_cache, order=order, distributed=distributed, seed=cfg.seed,
                                     drop_last=cfg.drop_last, pipelines={"image": image, "label": label})
        # FFCV's QUASI_RANDOM shuffles its page table in place, so epoch e's order would depend on the epochs run
        # before it in this process; restoring the table before each epoch makes the order a function of (seed, e).
        pages = getattr(self._loader.traversal_order, "page_to_samples_array", None)
        self._pristine_pages = None if pages is None else pages.copy()

    def __len__(self) -> int:
        return len(self._loader)

    def _epoch_batches(self, epoch):
        """Starts the epoch now (not at the first next()), so that endless() can start it early. No host sync: the
        epoch's copies wait on the GPU for the work queued before it (ffcv_ddpm.ffcv_loader says why)."""
        # FFCV orders epoch e by (seed + e) (RANDOM, distributed sampler) or (seed * 912300 + e) (QUASI_RANDOM) and
        # then advances its own counter; setting the counter is how an epoch is chosen.
        self._loader.next_epoch = epoch
        if self._pristine_pages is not None:
            self._loader.traversal_order.page_to_samples_array[...] = self._pristine_pages
        return _Epoch(iter(self._loader))


class _Epoch:
    """FFCV's epoch iterator, whose prefetch thread starts with it: close() stops that thread and waits for it,
    whether or not a batch was taken (endless() may start an epoch and be closed before reading from it), and so
    does the end of the epoch. Waiting matters: a process exiting while the thread is inside numba's parallel code
    can abort ("terminate called without an active exception", seen once in a 2-rank CPU run on CI)."""

    def __init__(self, batches):
        self._batches = batches

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._batches)
        except StopIteration:
            self.close()
            raise

    def close(self) -> None:
        self._batches.close()  # sets the thread's stop event, which its timed puts look at every 0.5 s
        self._batches.join(timeout=1)
        if self._batches.is_alive():
            # It ends an epoch with an untimed put of None: after the epoch's last batches went into a queue that no
            # one will read, that put waits for good (a run stopped near an epoch's end; 10 s a join and a thread
            # left behind, before). One slot freed lets it finish; a thread still decoding puts one more batch and
            # stops at its next timed put.
            with contextlib.suppress(queue.Empty):
                self._batches.output_queue.get_nowait()
            self._batches.join(timeout=10)

    __del__ = close  # an epoch dropped half-read (as a dropped generator's finally did before)


def _ffcv_threads(requested: int) -> int:
    """FFCV's worker count, capped at the threads numba may start (above that numba refuses with a bare error)."""
    import numba

    limit = numba.config.NUMBA_NUM_THREADS  # the cores this process may use, unless NUMBA_NUM_THREADS says less
    if requested > limit:
        warnings.warn(f"data.num_workers={requested} exceeds the {limit} threads numba may use here; FFCV uses "
                      f"{limit}", stacklevel=3)
        return limit
    return requested


class _EpochSampler(torch.utils.data.Sampler):
    """(index, flip) pairs of one epoch; flips are drawn here so they replay with the order, whatever the workers."""

    def __init__(self, num_images: int, cfg: DataConfig, rank: int, world_size: int):
        self.num_images, self.cfg, self.rank, self.world_size = num_images, cfg, rank, world_size
        self.epoch = 0

    def __iter__(self):
        order = epoch_order(self.num_images, self.cfg, self.epoch, self.rank, self.world_size)
        if self.cfg.flip == "cpu":
            flips = np.random.default_rng([self.cfg.seed, self.epoch, 1]).random(len(order)) < 0.5
        else:
            flips = np.zeros(len(order), dtype=bool)
        return iter(zip(order.tolist(), flips.tolist()))

    def __len__(self):
        return self.num_images // self.world_size


def _maybe_flip(image: np.ndarray, flip: bool) -> np.ndarray:
    # (H, W, 3): reverse W; copy because torch cannot wrap negative strides
    return np.ascontiguousarray(image[:, ::-1]) if flip else image


class _ArrayDataset(torch.utils.data.Dataset):
    def __init__(self, images: np.ndarray, labels: np.ndarray):
        self.images, self.labels = images, labels  # (N, H, W, 3) uint8, (N,) int64

    def __len__(self):
        return len(self.images)

    def __getitem__(self, item):
        index, flip = item
        return _maybe_flip(self.images[index], flip), int(self.labels[index])


class _PNGDataset(torch.utils.data.Dataset):
    """Kaggle CIFAR-10 layout: <dir>/1.png..N.png and <dir>Labels.csv (`id,label`, label a class name)."""

    def __init__(self, png_dir):
        self.dir = Path(png_dir)
        csv_path = png_labels(self.dir)
        if missing := _missing_png(self.dir):
            raise FileNotFoundError(f"{missing}, or set data.png_dir")
        with open(csv_path, newline="") as f:
            rows = list(csv.DictReader(f))
        if not rows or set(rows[0]) != {"id", "label"}:
            raise ValueError(f"{csv_path} must have the header `id,label` and at least one row")
        classes = {name: i for i, name in enumerate(CIFAR10_CLASSES)}
        self.labels = np.full(len(rows), -1, dtype=np.int64)
        for row in rows:
            i, name = int(row["id"]), row["label"]
            if name not in classes or not 1 <= i <= len(rows):
                raise ValueError(f"{csv_path}: row {row} has an id outside 1..{len(rows)} or a label that is not "
                                 f"one of {', '.join(CIFAR10_CLASSES)}")
            self.labels[i - 1] = classes[name]
        if (self.labels < 0).any():
            raise ValueError(f"{csv_path} repeats some ids (ids must be 1..{len(rows)}, each once)")
        from PIL import Image

        with Image.open(self.dir / "1.png") as im:
            self.image_shape = (3, im.height, im.width)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, item):
        from PIL import Image

        index, flip = item
        with Image.open(self.dir / f"{index + 1}.png") as im:
            image = np.array(im.convert("RGB"))  # (H, W, 3) uint8, writable (torch warns on read-only arrays)
        return _maybe_flip(image, flip), int(self.labels[index])


class _TorchBatches(BatchLoader):
    def __init__(self, cfg, device, rank, world_size, dataset, image_shape):
        super().__init__(cfg, device, rank, world_size, len(dataset), image_shape)
        self._sampler = _EpochSampler(len(dataset), cfg, rank, world_size)
        workers = max(cfg.num_workers, 0)
        self._loader = torch.utils.data.DataLoader(
            dataset, batch_size=cfg.batch_size, sampler=self._sampler, num_workers=workers,
            pin_memory=cfg.pin_memory and device.type == "cuda", drop_last=cfg.drop_last,
            persistent_workers=workers > 0)  # workers start once, not every epoch

    def _epoch_batches(self, epoch):
        self._sampler.epoch = epoch
        for images, labels in self._loader:  # (B, H, W, 3) uint8, (B,) int64 on the host
            yield (images.to(self.device, non_blocking=True).permute(0, 3, 1, 2),
                   labels.to(self.device, non_blocking=True))


class _DeviceBatches(BatchLoader):
    def __init__(self, cfg, device, rank, world_size):
        images, labels = read_beton(cfg.path)
        super().__init__(cfg, device, rank, world_size, len(images), (3, *images.shape[1:3]))
        self._images = torch.from_numpy(images).to(device)  # (N, H, W, 3): batches come out channels_last
        self._labels = torch.from_numpy(labels).to(device)

    def _epoch_batches(self, epoch):
        n, b = self.num_images, self.cfg.batch_size
        if self.cfg.order == "sequential":
            order = torch.arange(n, device=self.device)
        else:
            g = torch.Generator(device=self.device)
            g.manual_seed(self.cfg.seed + epoch)
            order = torch.randperm(n, generator=g, device=self.device)
        per_rank = n // self.world_size
        order = order[:per_rank * self.world_size][self.rank::self.world_size]
        for i in range(len(self)):  # len() comes from host-side counts: no device sync
            idx = order[i * b:(i + 1) * b]
            yield self._images.index_select(0, idx).permute(0, 3, 1, 2), self._labels.index_select(0, idx)


def _check_process_group(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(f"world_size={world_size} needs torch.distributed initialised first "
                         "(torch.distributed.init_process_group)")
    if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
        raise ValueError(f"rank/world_size {rank}/{world_size} differ from the process group's "
                         f"{dist.get_rank()}/{dist.get_world_size()}")


def make_loader(cfg: DataConfig, device, *, rank: int = 0, world_size: int = 1) -> BatchLoader:
    """The loader named by cfg.loader, delivering batches onto `device` (this rank's shard when world_size > 1)."""
    cfg.validate()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
    if cfg.loader == "ffcv":
        loader = _FFCVBatches(cfg, device, rank, world_size)
    elif cfg.loader == "gpu":
        loader = _DeviceBatches(cfg, device, rank, world_size)
    elif cfg.loader == "torch-memory":
        images, labels = read_beton(cfg.path)
        loader = _TorchBatches(cfg, device, rank, world_size, _ArrayDataset(images, labels),
                               (3, *images.shape[1:3]))
    else:
        dataset = _PNGDataset(cfg.png_dir)
        loader = _TorchBatches(cfg, device, rank, world_size, dataset, dataset.image_shape)
    _check_batches_fit(cfg, loader.num_images, world_size)
    return loader


# ---- on the device, inside the compiled step ---------------------------------------------------------------------

def flip_images(images: torch.Tensor) -> torch.Tensor:
    """Mirror each image (B, C, H, W) left-right with probability 1/2: a device-side mask, no host sync."""
    mask = torch.rand(images.shape[0], 1, 1, 1, device=images.device) < 0.5
    return torch.where(mask, images.flip(3), images)


def prepare_batch(images: torch.Tensor, *, flip: bool, channels_last: bool) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> float32 in [-1, 1] (0 -> -1, 255 -> 1 exactly), optionally flipped on the device."""
    if images.dtype != torch.uint8:
        raise TypeError(f"prepare_batch expects uint8 images from a loader, got {images.dtype}")
    if flip:
        images = flip_images(images)  # on uint8: a quarter of the bytes the float tensor would move
    # Centre first: inductor turns the division into a multiply by fl(1/127.5), and (+-127.5) * fl(1/127.5) still
    # rounds to exactly +-1, whereas x * fl(1/127.5) - 1 (fused) gives 1.0000001 for 255.
    x = (images.float() - 127.5) / 127.5
    return x.contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
