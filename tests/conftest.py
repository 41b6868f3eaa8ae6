"""Shared test fixtures: small datasets written by the real tools, in every input format, and a .beton reader.

- small_dataset (session, built once for all pytest-xdist workers): a folder with the four .beton files +
  manifest.json that `make dataset` writes, built by tools.make_dataset from SMALL_TRAIN / SMALL_TEST synthetic
  images; small_dataset_arrays is what they contain.
- digits_dataset (the same): `make dataset SOURCE=digits` (scikit-learn's digits, all 1,797).
- make_cifar_tarball(path, data): the official CIFAR-10 python tarball format (pickled batches in a .tar.gz).
- write_png_folder(root, data): the Kaggle PNG layout, written with PIL independently of tools' exporter.
- read_beton(path, order=...): every image and label of a .beton through FFCV's Loader, as numpy arrays.
"""
from __future__ import annotations

import os

# `make test` runs on the CPU on every machine: the tests size their work for a CPU (the benchmarks' CPU tables, the
# time limits), and a visible GPU changes what a command does (another table, compiled rows, forked test processes
# that cannot start CUDA). On a GPU machine FFCV_DDPM_TEST_GPU=1 keeps the GPU visible: the tests that have a CUDA path
# take it (the Triton kernels of tests/test_norm.py and test_conv_gn.py, the 2-GPU DDP test), and those marked
# cpu_only are skipped. Set here, before torch is first imported, so that the commands tests start inherit it.
GPU_TESTS = os.environ.get("FFCV_DDPM_TEST_GPU") == "1"
if not GPU_TESTS:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# Without a GPU, Triton kernels (ffcv_ddpm.gn_kernels) are tested through Triton's interpreter, which must be chosen
# before triton is first imported. Inductor's CPU backend, which the other tests compile with, does not use Triton.
if not GPU_TESTS or not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
# No test reaches the network: the FID weights are never downloaded here (tests/test_fid.py replaces the downloader
# to test it). Set in the environment, so the commands tests start as child processes inherit it.
os.environ["FFCV_DDPM_OFFLINE"] = "1"


def _usable_cpus() -> int:
    # The cores this process may run on: a container or taskset may allow fewer than the machine has.
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# Under pytest-xdist (`make test`: -n auto), each worker's OpenMP threads get its share of the cores, set before torch
# is first imported and inherited by the processes tests start. Two threads per process on a busy 2-core machine made
# a training step of the tiny model ~20x slower (2 s instead of 0.09 s), OpenMP threads spinning against each other.
WORKER_THREADS = None  # under xdist: the worker's thread count (its share, or the OMP_NUM_THREADS the user set)
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault("OMP_NUM_THREADS",
                          str(max(1, _usable_cpus() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))
    WORKER_THREADS = int(os.environ["OMP_NUM_THREADS"]) if os.environ["OMP_NUM_THREADS"].isdigit() else None
# The commands tests start give their processes threads of their own (benchmarks.speed.ddp: the cores / N per rank),
# beside the other worker's: OpenMP threads that spin while they wait took tests/test_bench_ddp.py's loss check from
# 19 s to 118 s with one core busy elsewhere (32 s when they sleep). Passive waiting changes no result, only who
# holds a core. Set before torch (libgomp) is first imported, inherited by every process a test starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only: checks the CPU path of a command (skipped under FFCV_DDPM_TEST_GPU=1 "
                                       "on a GPU machine, where the command takes its CUDA path)")


# --quick (make test-quick): the suite without its costliest tests, for a contributor's edit-and-run loop; make test
# (what CI runs) runs them all. A test is left out when tests/durations.txt records at least QUICK_LIMIT seconds for it.
QUICK_LIMIT = 5.0


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help=f"leave out the tests tests/durations.txt records at {QUICK_LIMIT:g} s or more "
                          "(make test runs every test)")


def quick_selection(items: list, costs: dict[str, float], limit: float = QUICK_LIMIT) -> tuple[list, list]:
    """(kept, left out): the items whose recorded cost (durations.txt, by node id under tests/) is under `limit`, and
    the others, each in collected order. Tests not recorded are cheap."""
    slow = [item for item in items if costs.get(item.nodeid.removeprefix("tests/"), 0.0) >= limit]
    left_out = {id(item) for item in slow}
    return [item for item in items if id(item) not in left_out], slow


def pytest_collection_modifyitems(config, items):
    import torch
    if config.getoption("quick"):
        items[:], slow = quick_selection(items, recorded_costs())
        config.hook.pytest_deselected(items=slow)  # pytest's summary counts them: "N deselected"
    if GPU_TESTS and torch.cuda.is_available():
        skip = pytest.mark.skip(reason="checks the CPU path; FFCV_DDPM_TEST_GPU=1 runs the CUDA one")
        for item in items:
            if "cpu_only" in item.keywords:
                item.add_marker(skip)
    if "PYTEST_XDIST_WORKER" in os.environ:  # every worker collects, and must order its collection the same way
        items[:] = costliest_first(items, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


# Module-scoped fixtures cheap enough to set up again where a module's tests are split between the workers.
CHEAP_MODULE_FIXTURES = {"one_thread"}


def recorded_costs() -> dict[str, float]:
    """tests/durations.txt: {node id under tests/: seconds} of the costly tests, as measured under make test."""
    costs = {}
    for line in (Path(__file__).parent / "durations.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            seconds, nodeid = line.split(" ", 1)
            costs[nodeid.strip()] = float(seconds)
    return costs


def costliest_first(items: list, workers: int) -> list:
    """The collection in the order that keeps both workers busy to the end. xdist's worksteal gives each worker a
    contiguous share of the collection and lets a worker that runs out take the end of another's queue: in the
    collected (alphabetical) order a 70 s test could start last and run alone while the other core idles. So the
    costly units (a test; or a whole module whose tests share a costly module-scoped fixture, kept together so
    that it is built once) are dealt to the workers' shares by cost, costliest first (longest processing time
    first), and the cheap tests, in collected order, fill each share behind them, where stealing takes from."""
    if workers < 2:
        return items
    costs = recorded_costs()
    cost = {id(item): costs.get(item.nodeid.removeprefix("tests/"), 0.0) for item in items}
    grouped = {item.module for item in items if any(
        defs[-1].scope == "module" and name not in CHEAP_MODULE_FIXTURES
        for name, defs in item._fixtureinfo.name2fixturedefs.items())}
    units: dict = {}  # unit key -> its items in collected order
    for item in items:
        units.setdefault(item.module if item.module in grouped else id(item), []).append(item)
    costly = sorted((u for u in units.values() if sum(cost[id(i)] for i in u) >= 3.0),
                    key=lambda u: -sum(cost[id(i)] for i in u))
    shares, loads = [[] for _ in range(workers)], [0.0] * workers
    for unit in costly:
        w = loads.index(min(loads))
        shares[w] += unit
        loads[w] += sum(cost[id(i)] for i in unit)
    taken = {id(i) for share in shares for i in share}
    cheap = [item for item in items if id(item) not in taken]
    # xdist sends worker w (of k) len(rest) // (k - w) of the tests not yet sent: each share is filled to its size.
    ordered, left = [], len(items)
    for w, share in enumerate(shares):
        size = left // (workers - w)
        left -= size
        fill = max(0, size - len(share)) if w < workers - 1 else len(cheap)
        ordered += share + cheap[:fill]
        cheap = cheap[fill:]
    return ordered


def pytest_xdist_auto_num_workers(config):
    """-n auto: one worker per physical core this process may use (xdist's own count is the machine's physical cores,
    more than a taskset or cpuset container allows). -n logical keeps xdist's count."""
    import psutil
    if config.option.numprocesses == "logical":
        return None
    return max(1, min(psutil.cpu_count(logical=False) or 1, _usable_cpus()))


import csv
import io
import pickle
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ffcv_ddpm.numba_cache import cache_typed_dict
from tools.cifar10 import CLASSES, ImageDataset, load_synthetic

cache_typed_dict()  # before the fixtures' first FFCV import (ffcv_ddpm.numba_cache)

SMALL_TRAIN, SMALL_TEST, SMALL_SEED = 256, 64, 0


# ---------------------------------------------------------------------------------------------------------------
# Inputs in the formats tools/ reads

def make_cifar_tarball(path: Path, data: ImageDataset, skip: tuple[str, ...] = ()) -> Path:
    """Write `data` as cifar-10-python.tar.gz does: cifar-10-batches-py/data_batch_1..5 (train split in 5 parts),
    test_batch and batches.meta, each a protocol-2 pickle of a dict with bytes keys; b'data' is (N, 3072) uint8,
    each row the R, G and B planes of one image, row-major. Members named in `skip` are left out."""
    def batch(images: np.ndarray, labels: np.ndarray, name: str) -> dict:
        return {b"batch_label": name.encode(), b"labels": [int(v) for v in labels],
                b"data": np.ascontiguousarray(images.transpose(0, 3, 1, 2)).reshape(len(images), 3072),
                b"filenames": [f"img_{i}.png".encode() for i in range(len(images))]}

    members = {f"data_batch_{k + 1}": batch(imgs, labels, f"training batch {k + 1} of 5")
               for k, (imgs, labels) in enumerate(zip(np.array_split(data.train.images, 5),
                                                      np.array_split(data.train.labels, 5)))}
    members["test_batch"] = batch(data.test.images, data.test.labels, "testing batch 1 of 1")
    members["batches.meta"] = {b"label_names": [c.encode() for c in CLASSES], b"num_cases_per_batch": 10000,
                               b"num_vis": 3072}
    with tarfile.open(path, "w:gz") as tar:
        for name, obj in members.items():
            if name in skip:
                continue
            payload = pickle.dumps(obj, protocol=2)
            info = tarfile.TarInfo(f"cifar-10-batches-py/{name}")
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    return path


def write_png_folder(root: Path, data: ImageDataset, with_test: bool = True) -> Path:
    """Kaggle layout: root/train/<id>.png (ids from 1) + root/trainLabels.csv ('id,label', class names); test too."""
    from PIL import Image
    splits = [("train", data.train)] + ([("test", data.test)] if with_test else [])
    for name, split in splits:
        (root / name).mkdir(parents=True)
        for i, image in enumerate(split.images):
            Image.fromarray(image).save(root / name / f"{i + 1}.png")
        with open(root / f"{name}Labels.csv", "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["id", "label"])
            writer.writerows((i + 1, CLASSES[label]) for i, label in enumerate(split.labels))
    return root


# ---------------------------------------------------------------------------------------------------------------
# Reading back

def read_beton(path, order: str = "sequential", seed: int = 0, batch_size: int = 100):
    """All (images (N, 32, 32, 3) uint8, labels (N,) int64) of a .beton via FFCV's Loader, in `order`
    ('sequential' = file order, 'random' = a seeded permutation). One Loader costs ~1 s of numba compilation."""
    from ffcv.fields.decoders import IntDecoder, SimpleRGBImageDecoder
    from ffcv.loader import Loader, OrderOption
    from ffcv.transforms import Squeeze, ToTensor

    loader = Loader(str(path), batch_size=batch_size, num_workers=1, seed=seed, drop_last=False,
                    order={"sequential": OrderOption.SEQUENTIAL, "random": OrderOption.RANDOM}[order],
                    pipelines={"image": [SimpleRGBImageDecoder(), ToTensor()],
                               "label": [IntDecoder(), ToTensor(), Squeeze(1)]})
    images, labels = [], []
    for x, y in loader:
        images.append(x.numpy().copy())  # the loader reuses its batch buffers
        labels.append(y.numpy().reshape(-1).copy())
    return np.concatenate(images), np.concatenate(labels)


# ---------------------------------------------------------------------------------------------------------------
# Fixtures

@pytest.fixture(scope="session")
def small_dataset_arrays() -> ImageDataset:
    """What small_dataset holds: SMALL_TRAIN / SMALL_TEST synthetic images (seed SMALL_SEED)."""
    return load_synthetic(SMALL_TRAIN, SMALL_TEST, SMALL_SEED)


def built_once(tmp_path_factory, name: str, build) -> Path:
    """The folder `name`, made by build(folder) once for the whole run: under pytest-xdist each worker is a process
    with a session of its own, so the first worker to ask builds it (under a file lock in the run's temporary folder,
    above the workers' own) and the others wait for it and read the same files. The tests treat it as read-only."""
    import fcntl

    root = tmp_path_factory.getbasetemp()
    if "PYTEST_XDIST_WORKER" in os.environ:
        root = root.parent
    folder = root / name
    with open(root / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "manifest.json").is_file():  # make_dataset writes it last
            build(folder)
    return folder


@pytest.fixture(scope="session")
def small_dataset(tmp_path_factory) -> Path:
    """A data folder as `make dataset SOURCE=synthetic` writes it (four .beton files + manifest.json), small."""
    from tools.make_dataset import main

    def build(out: Path) -> None:
        rc = main(["--source", "synthetic", "--out", str(out), "--num-synthetic", str(SMALL_TRAIN),
                   "--num-synthetic-test", str(SMALL_TEST), "--seed", str(SMALL_SEED), "--workers", "2"])
        assert rc == 0, "tools.make_dataset failed to build the small synthetic dataset"

    return built_once(tmp_path_factory, "small_dataset", build)


@pytest.fixture(scope="session")
def digits_dataset(tmp_path_factory) -> Path:
    """A data folder as `make dataset SOURCE=digits` writes it: digits_{train,test}_{raw,jpg}.beton + manifest.json."""
    from tools.make_dataset import main

    def build(out: Path) -> None:
        rc = main(["--source", "digits", "--out", str(out), "--workers", "2"])
        assert rc == 0, "make_dataset --source digits failed"

    return built_once(tmp_path_factory, "digits", build)


@pytest.fixture(autouse=True)
def _worker_threads():
    """Under xdist, each test starts with the worker's share of the cores: FFCV's Loader sets torch's thread count to
    its decode threads (data.num_workers, 2 by default on 2 cores), which would stay for every later test of the
    worker."""
    yield
    if WORKER_THREADS is not None and torch.get_num_threads() != WORKER_THREADS:
        torch.set_num_threads(WORKER_THREADS)


# ---- shared by the model, diffusion, EMA and trainer tests ----

@pytest.fixture(scope="module")
def one_thread():
    """On a small shared CPU, OpenMP threads spinning against other processes make these tiny ops ~10x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# Ops that copy a device value to the host: each one is a GPU sync (.item(), float(t), bool(t), boolean masks).
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal"}


class _OpRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def host_syncs(fn, *args, **kwargs) -> list[str]:
    """The host-syncing ops fn runs (checked on CPU by op name, so it holds on the GPU too)."""
    with _OpRecorder() as rec:
        fn(*args, **kwargs)
    return [op for op in rec.ops if op in SYNC_OPS]


REPO = Path(__file__).resolve().parents[1]

_HOLDER = """
import sys, time
from ffcv_ddpm.folder_lock import lock_folder
lock_folder(sys.argv[1])
print("ready", flush=True)
time.sleep(600)
"""


def hold_lock(folder: Path) -> "subprocess.Popen":
    """A process that holds `folder`'s lock (ffcv_ddpm.folder_lock) until killed."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(folder)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.stdout.close()
    return proc


class IndexedArrays:
    """(image, label) pairs by index: what FFCV's DatasetWriter.from_indexed_dataset reads."""

    def __init__(self, images, labels):
        self.images, self.labels = images, labels

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])


def write_beton(path: Path, n: int, seed: int = 0, height: int = 32, width: int = 32) -> Path:
    """A raw .beton of n height x width images, written straight through FFCV (no tools/, no manifest)."""
    from ffcv.fields import IntField, RGBImageField
    from ffcv.writer import DatasetWriter

    rng = np.random.default_rng(seed)
    # Smooth colour ramps plus noise: structured, never all zeros.
    ramp = np.linspace(0, 200, height, dtype=np.float32)[None, :, None, None]
    images = (ramp + rng.integers(0, 56, (n, height, width, 3))).astype(np.uint8)
    labels = rng.integers(0, 10, n)
    DatasetWriter(str(path), {"image": RGBImageField(write_mode="raw"), "label": IntField()},
                  num_workers=1).from_indexed_dataset(IndexedArrays(images, labels))
    return path


# FFCV_DDPM_TEST_LOG=file: each test's outcome, duration and (when it fails) its report, appended as it finishes, so a
# run cut off by a time limit (a lent GPU machine) still says what failed and where the time went.
def pytest_runtest_logreport(report):
    path = os.environ.get("FFCV_DDPM_TEST_LOG")
    # Under xdist the controller hears every worker's reports: written there only, once each.
    if not path or "PYTEST_XDIST_WORKER" in os.environ or (report.when != "call" and report.passed):
        return
    with open(path, "a") as f:
        f.write(f"{report.outcome.upper()} {report.when} {report.duration:.1f}s {report.nodeid}\n")
        if report.failed:
            f.write(report.longreprtext[-4000:] + "\n")
