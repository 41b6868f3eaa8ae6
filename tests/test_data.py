"""Loaders read back exactly what the .beton (or PNG folder) holds, in a replayable order; conversion and checks."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from ffcv.fields import IntField, RGBImageField
from ffcv.writer import DatasetWriter
from PIL import Image

from conftest import IndexedArrays, write_beton
from ffcv_ddpm.data import (CIFAR10_CLASSES, BatchLoader, DataConfig, check_beton, dataset_info, endless,
                            epoch_order, make_loader, prepare_batch)

# numba's dispatcher finalizer raises KeyError when a discarded FFCV Loader's pipeline is garbage-collected
# (libffcv/ffcv#167); harmless, and only noise here where many loaders are built and dropped.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <finalize object:pytest.PytestUnraisableExceptionWarning")

N, H, W = 100, 16, 24  # H != W so a transposed axis cannot pass
CPU = torch.device("cpu")


def write_dataset(folder: Path, n: int = N, height: int = H, width: int = W, seed: int = 0,
                  formats=("raw",)) -> tuple[np.ndarray, np.ndarray]:
    """Random non-zero images in the layout of `make dataset`: <folder>/cifar10_train_<fmt>.beton for each format,
    and the Kaggle PNG layout in <folder>/png (train/1.png.. + trainLabels.csv)."""
    rng = np.random.default_rng(seed)
    images = rng.integers(1, 256, (n, height, width, 3), dtype=np.uint8)
    labels = rng.integers(0, 10, n).astype(np.int64)
    for fmt in formats:
        fields = {"image": RGBImageField(write_mode=fmt), "label": IntField()}
        DatasetWriter(str(folder / f"cifar10_train_{fmt}.beton"), fields, num_workers=1).from_indexed_dataset(
            IndexedArrays(images, labels))
    (folder / "png" / "train").mkdir(parents=True)
    for i, image in enumerate(images):
        Image.fromarray(image).save(folder / "png" / "train" / f"{i + 1}.png")
    with open(folder / "png" / "trainLabels.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["id", "label"])
        out.writerows([i + 1, CIFAR10_CLASSES[y]] for i, y in enumerate(labels))
    return images, labels


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("data")
    images, labels = write_dataset(folder)
    return folder, images, labels


def config(folder, loader, **kw) -> DataConfig:
    kw = {"batch_size": 32, "num_workers": 0 if loader.startswith("torch") else 1, "drop_last": False, **kw}
    return DataConfig(path=str(folder / "cifar10_train_raw.beton"), loader=loader,
                      png_dir=str(folder / "png" / "train"), **kw)


def one_epoch(loader) -> tuple[np.ndarray, np.ndarray]:
    """(images (n, H, W, 3), labels (n,)) of one epoch, checking every batch's type, shape and place."""
    xs, ys = [], []
    for x, y in loader:
        assert x.dtype == torch.uint8 and x.shape[1:] == (3, H, W) and x.device == loader.device
        assert x.is_contiguous(memory_format=torch.channels_last)
        assert y.dtype == torch.int64 and y.shape == (x.shape[0],) and y.device == loader.device
        xs.append(x.permute(0, 2, 3, 1).numpy().copy())  # copy: FFCV reuses its buffers
        ys.append(y.numpy().copy())
    return np.concatenate(xs), np.concatenate(ys)


def as_indices(images: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Index in `reference` of each image (random images are all distinct)."""
    where = {im.tobytes(): i for i, im in enumerate(reference)}
    return np.array([where[im.tobytes()] for im in images])


LOADERS = ["ffcv", "torch-memory", "torch-files", "gpu"]


@pytest.mark.parametrize("name", LOADERS)
def test_sequential_epoch_is_the_file_bit_exact(data, name):
    folder, images, labels = data
    workers = {"ffcv": 2, "torch-memory": 2}.get(name, 0)  # exercises FFCV threads and torch worker processes
    loader = make_loader(config(folder, name, order="sequential", flip="none", num_workers=workers), CPU)
    assert (len(loader), loader.num_images, loader.image_shape) == (4, N, (3, H, W))
    got_images, got_labels = one_epoch(loader)
    np.testing.assert_array_equal(got_images, images)
    np.testing.assert_array_equal(got_labels, labels)


@pytest.mark.parametrize("name,order,os_cache", [(n, "random", True) for n in LOADERS]
                         + [("ffcv", "quasi_random", False)])
def test_random_order_is_a_permutation_replayed_by_epoch(data, name, order, os_cache):
    folder, images, labels = data
    cfg = config(folder, name, order=order, os_cache=os_cache, seed=3)
    loader = make_loader(cfg, CPU)
    epochs = [one_epoch(loader) for _ in range(2)]  # epochs 0 and 1: iteration advances the epoch
    loader.set_epoch(0)
    replay = one_epoch(loader)
    orders = [as_indices(x, images) for x, _ in epochs]
    for (x, y), order_e in zip(epochs, orders):
        assert sorted(order_e) == list(range(N))
        np.testing.assert_array_equal(y, labels[order_e])
    assert not np.array_equal(orders[0], orders[1]) and not np.array_equal(orders[0], np.arange(N))
    np.testing.assert_array_equal(replay[0], epochs[0][0])
    if name != "gpu" and order == "random":  # the host loaders share FFCV's RANDOM formula: same seed, same order
        for e in range(2):
            np.testing.assert_array_equal(orders[e], epoch_order(N, cfg, e, 0, 1))


@pytest.mark.parametrize("name", ["torch-memory", "torch-files", "gpu"])
def test_two_ranks_get_disjoint_halves(data, name):
    folder, images, _ = data
    shards = []
    for rank in range(2):
        loader = make_loader(config(folder, name, batch_size=16), CPU, rank=rank, world_size=2)
        assert len(loader) == 4  # 50 images per rank: 3 full batches and one of 2
        shards.append(as_indices(one_epoch(loader)[0], images))
    assert len(shards[0]) == len(shards[1]) == N // 2
    assert set(shards[0]).isdisjoint(shards[1]) and set(shards[0]) | set(shards[1]) == set(range(N))


@pytest.mark.parametrize("name", ["ffcv", "torch-memory", "torch-files"])
def test_cpu_flip_mirrors_about_half(data, name):
    folder, images, labels = data
    loader = make_loader(config(folder, name, order="sequential", flip="cpu"), CPU)
    got, got_labels = one_epoch(loader)
    same = (got == images).all(axis=(1, 2, 3))
    mirrored = (got == images[:, :, ::-1]).all(axis=(1, 2, 3))
    assert (same | mirrored).all() and 20 < mirrored.sum() < 80
    np.testing.assert_array_equal(got_labels, labels)
    if name != "ffcv":  # torch loaders draw flips from (seed, epoch); FFCV's flip uses numba's unseeded RNG
        loader.set_epoch(0)
        np.testing.assert_array_equal(one_epoch(loader)[0], got)


def test_ffcv_with_more_workers_than_threads_warns_and_caps(data):
    with pytest.warns(UserWarning, match="num_workers=999"):
        make_loader(config(data[0], "ffcv", num_workers=999), CPU)


# ---- prepare_batch -------------------------------------------------------------------------------------------------

def test_prepare_batch_maps_0_255_to_exactly_minus1_1():
    images = torch.arange(256, dtype=torch.uint8).repeat(2, 3, 1, 1).contiguous(memory_format=torch.channels_last)
    x = prepare_batch(images, flip=False, channels_last=True)
    assert x.dtype == torch.float32 and x.is_contiguous(memory_format=torch.channels_last)
    assert x.min().item() == -1.0 and x.max().item() == 1.0
    values = np.arange(256, dtype=np.float32)
    np.testing.assert_array_equal(x[0, 0, 0].numpy(), (values - np.float32(127.5)) / np.float32(127.5))
    np.testing.assert_allclose(x[0, 0, 0].numpy(), values / 127.5 - 1, rtol=0, atol=1e-7)
    assert prepare_batch(images, flip=False, channels_last=False).is_contiguous()
    with pytest.raises(TypeError, match="uint8"):
        prepare_batch(images.float(), flip=False, channels_last=True)


def test_gpu_flip_mirrors_about_half_per_sample():
    torch.manual_seed(0)
    images = torch.randint(1, 256, (400, 3, 4, 5), dtype=torch.uint8)
    x = prepare_batch(images, flip=True, channels_last=True)
    ref = prepare_batch(images, flip=False, channels_last=True)
    same = (x == ref).flatten(1).all(1)
    mirrored = (x == ref.flip(3)).flatten(1).all(1)
    assert (same | mirrored).all() and 150 < mirrored.sum() < 250


def test_prepare_batch_compiles_without_graph_breaks():
    compiled = torch.compile(prepare_batch, backend="eager", fullgraph=True)  # fullgraph: a break is an error
    images = torch.randint(0, 256, (8, 3, 4, 4), dtype=torch.uint8)
    torch.manual_seed(1)
    out = compiled(images, flip=True, channels_last=True)
    assert out.shape == (8, 3, 4, 4) and out.abs().max() <= 1


# ---- bad input -----------------------------------------------------------------------------------------------------

def test_check_beton_says_what_is_wrong(data, tmp_path):
    check_beton(data[0] / "cifar10_train_raw.beton")
    with pytest.raises(FileNotFoundError, match="make dataset"):
        check_beton(tmp_path / "missing.beton")
    with pytest.raises(ValueError, match="not a file"):
        check_beton(tmp_path)
    junk = tmp_path / "junk.beton"
    junk.write_bytes(b"not a beton at all" * 10)
    with pytest.raises(ValueError, match="not a readable FFCV .beton"):
        check_beton(junk)
    other = tmp_path / "other.beton"
    DatasetWriter(str(other), {"picture": RGBImageField(write_mode="raw"), "label": IntField()},
                  num_workers=1).from_indexed_dataset(IndexedArrays(data[1][:4], data[2][:4]))
    with pytest.raises(ValueError, match=r"needs fields 'image'.*'picture'"):
        check_beton(other)
    with pytest.raises(FileNotFoundError, match="make dataset"):
        make_loader(DataConfig(path=str(tmp_path / "missing.beton")), CPU)


def test_the_header_is_what_ffcvs_reader_reads(data, small_dataset, tmp_path):
    """data.py reads a .beton's header with numpy (no FFCV import): the same samples, fields, metadata and allocation
    table as FFCV's Reader; a file with a field type it does not read itself goes to FFCV's Reader."""
    from ffcv.fields import FloatField
    from ffcv.reader import Reader

    from ffcv_ddpm.data import _open_beton, _read_header

    extra = tmp_path / "extra.beton"
    DatasetWriter(str(extra), {"image": RGBImageField(write_mode="raw"), "weight": FloatField(), "label": IntField()},
                  num_workers=1).from_indexed_dataset(IndexedArraysAndWeights(data[1][:5], data[2][:5]))
    for path in (data[0] / "cifar10_train_raw.beton", small_dataset / "cifar10_test_jpg.beton", extra):
        ffcv = Reader(str(path))
        ours = _open_beton(path)
        assert (_read_header(str(path)) is None) == (path == extra)  # FloatField: read by FFCV's Reader
        assert ours.num_samples == ffcv.num_samples and ours.field_names == ffcv.field_names
        assert ours.field_types == {name: type(h).__name__ for name, h in ffcv.handlers.items()}
        assert ours.metadata.dtype == ffcv.metadata.dtype and np.array_equal(ours.metadata, ffcv.metadata)
        assert np.array_equal(ours.alloc_table, ffcv.alloc_table)


class IndexedArraysAndWeights(IndexedArrays):
    def __getitem__(self, i):
        return self.images[i], 0.5 * i, int(self.labels[i])


def test_an_in_memory_read_imports_neither_ffcv_nor_numba(data):
    """The trainer's in-memory loaders (torch-memory, gpu) and the studies read a raw .beton without FFCV or numba in
    the process (their import is ~0.6 s of every such process's start-up); a JPEG file still needs FFCV."""
    import subprocess
    import sys

    from conftest import REPO

    code = ("import sys; from ffcv_ddpm.data import check_beton, read_beton; check_beton(sys.argv[1]); "
            "images, labels = read_beton(sys.argv[1]); assert len(images) == len(labels) > 0; "
            "print(sorted(m for m in ('ffcv', 'numba') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(data[0] / "cifar10_train_raw.beton")], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_dataset_info_reads_the_manifest(data, tmp_path):
    info = dataset_info(data[0] / "cifar10_train_raw.beton")
    assert (info["num_images"], info["height"], info["width"], info["synthetic"]) == (N, H, W, None)
    beton = tmp_path / "cifar10_train_raw.beton"
    beton.write_bytes((data[0] / "cifar10_train_raw.beton").read_bytes())
    (tmp_path / "manifest.json").write_text(json.dumps({"source": "synthetic", "synthetic": True}))
    info = dataset_info(beton)
    assert (info["source"], info["synthetic"]) == ("synthetic", True)


def test_bad_configs_are_rejected_with_the_field_named(data, tmp_path):
    with pytest.raises(ValueError, match="data.loader='dali'"):
        DataConfig(loader="dali")
    with pytest.raises(ValueError, match="data.order"):
        DataConfig(order="shuffled")
    with pytest.raises(ValueError, match="flip='cpu'"):
        DataConfig(loader="gpu", flip="cpu")
    with pytest.raises(ValueError, match="png_dir"):
        DataConfig(loader="torch-files")
    cfg = DataConfig()
    cfg.batch_size = 0  # set after __init__, as config overrides do: make_loader validates again
    with pytest.raises(ValueError, match="batch_size"):
        make_loader(cfg, CPU)
    with pytest.raises(ValueError, match="batch_size=101 exceeds"):
        make_loader(config(data[0], "torch-files", batch_size=101, drop_last=True), CPU)
    with pytest.raises(ValueError, match="torch.distributed"):
        make_loader(config(data[0], "ffcv"), CPU, rank=1, world_size=2)
    with pytest.raises(FileNotFoundError, match="PNG folder"):
        make_loader(DataConfig(loader="torch-files", png_dir=str(tmp_path / "nope")), CPU)


def test_default_workers_fit_the_machine(monkeypatch):
    """8 decode threads on a 2-core machine would only be capped by numba, with a warning on every run."""
    import ffcv_ddpm.data as data_mod

    monkeypatch.setattr(data_mod, "cpu_count", lambda: 2)
    assert data_mod.DataConfig().num_workers == 2
    monkeypatch.setattr(data_mod, "cpu_count", lambda: 64)
    assert data_mod.DataConfig().num_workers == 8


class _EpochLog(BatchLoader):
    """Epochs of 3 batches (epoch, i); records when each epoch starts, the way FFCV's loader starts eagerly."""

    def __init__(self, log, device):
        cfg = DataConfig(path="unused", batch_size=1)
        super().__init__(cfg, torch.device(device), 0, 1, num_images=3, image_shape=(3, 1, 1))
        self.log = log

    def _epoch_batches(self, epoch):
        self.log.append(("start", epoch))
        return iter([(epoch, i) for i in range(3)])


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_endless_starts_the_next_epoch_early_on_a_gpu_only(device):
    log = []
    data = endless(_EpochLog(log, device), 2, 1)  # a run resumed at epoch 2, batch 1 (no GPU is touched)
    got = []
    for _ in range(5):
        got.append(next(data))
        log.append(got[-1])
    # The plain order: epoch by epoch, the skipped batch left out...
    assert got == [(2, 1), (2, 2), (3, 0), (3, 1), (3, 2)]
    # ...and on a GPU each next epoch started while the last batch of the one before was still to be used; on the
    # CPU only once it was used (FFCV's decode thread beside the step's CPU kernels costs bit-reproducibility).
    early = log.index(("start", 3)) < log.index((2, 2)) and log.index(("start", 4)) < log.index((3, 2))
    assert early == (device == "cuda")
    data.close()


@pytest.mark.parametrize("fmt", ["raw", "jpg"])
def test_read_beton_leaves_torchs_thread_count_alone(small_dataset, fmt):
    """FFCV's Loader (the JPEG file's read) sets torch's intra-op threads to its worker count, FFCV's import to 1; a
    one-shot read must not change the process's (the CPU tests run their convolutions on one thread, and two on a
    busy 2-core machine were 10-30x slower)."""
    from ffcv_ddpm.data import read_beton

    from ffcv_ddpm import data

    data._read_cache.clear()  # a read from memory (below) would not reach the file
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        images, _ = read_beton(small_dataset / f"cifar10_test_{fmt}.beton", num_workers=2)
        assert len(images) > 0 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_read_beton_reads_what_ffcvs_loader_reads(data, small_dataset, tmp_path, monkeypatch):
    """A raw .beton is copied out of the file by numpy, a JPEG one decoded by FFCV's Loader: both bit-exact to what
    FFCV's Loader reads (conftest.read_beton), in file order, H != W included."""
    from conftest import read_beton as loader_read
    from ffcv_ddpm import data as data_mod

    decoded, real = [], data_mod._decode_beton
    monkeypatch.setattr(data_mod, "_decode_beton", lambda reader, *a: decoded.append(reader.file_name)
                        or real(reader, *a))
    folder, images, labels = data
    raw = folder / "cifar10_train_raw.beton"
    jpg = small_dataset / "cifar10_test_jpg.beton"
    for path in (raw, small_dataset / "cifar10_test_raw.beton", jpg):
        got = data_mod._read_beton(path, None)
        want = loader_read(path)
        assert got[0].dtype == np.uint8 and got[1].dtype == np.int64
        np.testing.assert_array_equal(got[0], want[0])
        np.testing.assert_array_equal(got[1], want[1])
    assert decoded == [str(jpg)]  # the raw files never reached the Loader
    np.testing.assert_array_equal(data_mod._read_beton(raw, None)[0], images)
    # An image whose metadata points past its allocation is refused, not read from its neighbour's bytes.
    bad = tmp_path / "bad.beton"
    bad.write_bytes(raw.read_bytes())
    reader = data_mod._open_beton(bad)
    meta = reader.metadata.copy()
    meta["f0"]["data_ptr"][3] += 1
    monkeypatch.setattr(data_mod, "_open_beton", lambda path: setattr(reader, "metadata", meta) or reader)
    with pytest.raises(ValueError, match="an image's bytes are not where its metadata says"):
        data_mod._read_beton(bad, None)


def test_read_beton_reads_a_file_once_until_it_changes(tmp_path, monkeypatch):
    """A study reads one small .beton several times: later reads come from memory (FFCV's Loader compiles its
    pipeline for each read, ~1 s on a CPU), each a copy of its own; a file rewritten in between is read again."""
    from ffcv_ddpm import data

    path = write_beton(tmp_path / "a.beton", 20, seed=0)
    reads, real = [], data._read_beton
    monkeypatch.setattr(data, "_read_beton", lambda *a: reads.append(a) or real(*a))
    first, _ = data.read_beton(path)
    kept = first.copy()
    first[:] = 0  # the caller's copy: not what the next caller gets
    again, _ = data.read_beton(path)
    assert len(reads) == 1 and np.array_equal(again, kept) and again.std() > 0
    write_beton(path, 20, seed=1)
    other, _ = data.read_beton(path)
    assert len(reads) == 2 and not np.array_equal(other, kept)


class _FakeEpochIterator:
    """What _Epoch wraps: FFCV's EpochIterator, a thread with close() and join()."""

    def __init__(self, n):
        self.left, self.calls = n, []

    def __next__(self):
        if not self.left:
            raise StopIteration
        self.left -= 1
        return self.left

    def close(self):
        self.calls.append("close")

    def join(self, timeout=None):
        self.calls.append("join")

    def is_alive(self):
        return False


def test_an_ffcv_epoch_stops_its_thread_when_closed_unread_or_when_it_ends():
    from ffcv_ddpm.data import _Epoch

    unread = _FakeEpochIterator(3)
    _Epoch(unread).close()  # endless() closed right after starting the next epoch: no batch was taken
    assert unread.calls[:2] == ["close", "join"]
    ended = _FakeEpochIterator(2)
    assert list(_Epoch(ended)) == [1, 0] and ended.calls[:2] == ["close", "join"]


def test_an_ffcv_epoch_closed_with_its_last_batches_unread_stops_its_thread(tmp_path):
    """FFCV's epoch thread puts the end of the epoch (None) into its queue without a timeout: closed with the last
    batches decoded and unread (a run stopped near an epoch's end, a resumed run's 2 steps here), the queue full, it
    used to wait there for good, and close() for 10 s a join."""
    import time

    from ffcv_ddpm.data import DataConfig, _FFCVBatches

    path = write_beton(tmp_path / "train.beton", 64)
    batches = _FFCVBatches(DataConfig(path=str(path), batch_size=8, num_workers=1, order="sequential"),
                           torch.device("cpu"), 0, 1)
    epoch = batches._epoch_batches(0)
    thread = epoch._batches
    unread = thread.output_queue.maxsize
    for _ in range(len(batches) - unread):
        next(epoch)
    deadline = time.time() + 30
    while not thread.output_queue.full() and time.time() < deadline:  # the last batches decoded...
        time.sleep(0.01)
    time.sleep(0.5)  # ...and the thread at its put of the epoch's end
    assert thread.output_queue.full() and thread.is_alive()
    epoch.close()
    assert not thread.is_alive()


def test_ordered_loader_is_ffcvs_loader_but_for_its_epochs():
    """OrderedLoader.__iter__ copies ffcv's Loader.__iter__ with one class swapped: an ffcv whose epoch start changed
    fails here rather than train with a stale copy."""
    import inspect

    from ffcv.loader import Loader

    from ffcv_ddpm.ffcv_loader import OrderedLoader

    def statements(method) -> list[str]:
        lines = inspect.getsource(method).splitlines()[1:]  # the body, without the def line
        return [s.strip() for s in lines if s.strip() and not s.strip().startswith("#")]

    theirs = statements(Loader.__iter__)
    assert theirs[-1] == "return EpochIterator(self, selected_order)"
    assert statements(OrderedLoader.__iter__) == theirs[:-1] + ["return OrderedEpoch(self, selected_order)"]


def test_an_ffcv_epoch_start_on_a_gpu_leaves_memory_still_being_read_alone(data):
    """On a GPU (skipped here): a tensor freed on the host while a queued kernel still reads it, then a new FFCV epoch,
    whose batch buffer is that tensor's size (the allocator may hand it that very block), with no host drain between:
    the kernel reads the tensor's values, not the epoch's images, and the epoch's batch is the file."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    folder, images, labels = data
    gpu = torch.device("cuda")
    loader = make_loader(config(folder, "ffcv", batch_size=N, order="sequential", flip="none"), gpu)
    sums, reused = [], 0
    for _ in range(3):
        live = torch.full((N, H, W, 3), 7, dtype=torch.uint8, device=gpu)  # the size of one FFCV batch buffer
        block = range(live.untyped_storage().data_ptr(), live.untyped_storage().data_ptr() + live.numel())
        torch.cuda._sleep(100_000_000)  # tens of ms of GPU work ahead of the read below
        sums.append(live.sum(dtype=torch.int64))  # queued behind the sleep
        del live  # freed here while its read is still queued
        (x, y), = list(loader)  # one batch per epoch: the epoch starts (FFCV allocates), decodes and copies
        reused += any(t.untyped_storage().data_ptr() in block for t in (x, y))  # the images' or the labels' buffer
        np.testing.assert_array_equal(x.permute(0, 2, 3, 1).cpu().numpy(), images)
        np.testing.assert_array_equal(y.cpu().numpy(), labels)
    assert [int(s) for s in sums] == [7 * N * H * W * 3] * 3
    assert reused, "the allocator never handed an epoch the freed block: this test exercised nothing"
