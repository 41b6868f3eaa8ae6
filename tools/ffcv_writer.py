"""Write one split of images + labels to an FFCV .beton file (fields 'image': RGBImageField, 'label': IntField).

Imported lazily by make_dataset: FFCV pulls in torch, which the up-to-date check and the error paths do not need.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import queue
import time
from pathlib import Path

from ffcv_ddpm.numba_cache import cache_typed_dict

cache_typed_dict()  # before FFCV's import
import ffcv.writer  # noqa: E402
from ffcv.fields import IntField, RGBImageField
from ffcv.memory_allocator import MemoryAllocator
from ffcv.writer import DatasetWriter
from tqdm import tqdm

from tools.atomic import create_segment, release_segment, track_children, untrack_children, worker_init
from tools.cifar10 import Split


class ArrayDataset:
    """The indexable FFCV's writer asks for: sample i is (HWC uint8 image, int label)."""

    def __init__(self, split: Split):
        self.images, self.labels = split.images, split.labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.images[i], int(self.labels[i])


def _worker(work_fn, *args) -> None:
    worker_init()
    work_fn(*args)


def _drain(q) -> None:
    try:
        while True:
            q.get(timeout=0.05)
    except queue.Empty:
        pass


class _NamedSegments:
    """Stands in for multiprocessing.shared_memory inside FFCV's DatasetWriter.prepare."""

    @staticmethod
    def SharedMemory(create: bool, size: int):  # noqa: N802 (the name FFCV calls)
        assert create
        return create_segment(size)


class _Writer(DatasetWriter):
    """FFCV 1.0.2's DatasetWriter, with the worker loop made safe to fail.

    Upstream, the parent polls a shared counter until every sample is written: a worker that dies (an exception, the
    OOM killer) leaves it spinning forever, and Ctrl-C prints a traceback per worker. Here the parent raises when a
    worker dies, always stops its workers and frees the shared metadata, and the progress bar is named.
    """

    def __init__(self, fname: str, fields: dict, desc: str, num_workers: int, page_size: int):
        super().__init__(fname, fields, page_size=page_size, num_workers=num_workers)
        self.desc = desc

    def prepare(self):
        # FFCV creates its metadata segment with a random psm_* name, which a later run cannot tell from anyone
        # else's after kill -9; ours is named and locked as this project's (tools.atomic.create_segment).
        real = ffcv.writer.shared_memory
        ffcv.writer.shared_memory = _NamedSegments
        try:
            super().prepare()
        finally:
            ffcv.writer.shared_memory = real

    def _write_common(self, num_samples, queue_content, work_fn, extra_worker_args):
        ctx = multiprocessing.get_context("fork")  # workers share the arrays with the parent instead of copying them
        self.num_samples = num_samples
        self.prepare()  # writes the header, allocates the shared metadata that `finally` frees
        procs, finished = [], False
        work, allocations = ctx.Queue(), ctx.Queue()
        try:
            for todo in queue_content:
                work.put(todo)
            for _ in range(self.num_workers):
                work.put(None)  # one "no more work" token per worker
            done = ctx.Value(ctypes.c_uint64, 0)
            allocator = MemoryAllocator(self.fname, self.data_region_start, self.page_size)
            args = (work, self.metadata_sm, self.metadata_type, self.fields, allocator, done, allocations,
                    *extra_worker_args)
            procs = [ctx.Process(target=_worker, args=(work_fn, *args), daemon=True) for _ in range(self.num_workers)]
            for p in procs:
                p.start()
            track_children(p.pid for p in procs)
            with tqdm(total=num_samples, desc=self.desc, unit="img", leave=False) as bar:
                while bar.n < num_samples:
                    self._check_workers(procs)
                    bar.update(done.value - bar.n)
                    time.sleep(0.02)
            allocation_list = []
            while len(allocation_list) < len(procs):  # each worker sends its allocation table when it finishes
                try:
                    allocation_list.append(allocations.get(timeout=0.1))
                except queue.Empty:
                    self._check_workers(procs)
            self.finalize([a for table in allocation_list for a in table])
            finished = True
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join()
            untrack_children(p.pid for p in procs)
            if not finished:
                # Work the stopped workers never read would keep the queue's feeder thread, and so this process's
                # exit, blocked forever on a full pipe: read it back here.
                _drain(work)
                work.cancel_join_thread()
            release_segment(self.metadata_sm)

    @staticmethod
    def _check_workers(procs) -> None:
        failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if failed:
            raise RuntimeError(f"an FFCV writer worker died (exit code {failed[0]}); see its error above")


def write_beton(path: Path, split: Split, write_mode: str, jpeg_quality: int, workers: int, page_size: int,
                desc: str) -> None:
    """Write `split` to `path` ('raw': uint8 pixels; 'jpg': JPEG at `jpeg_quality`). Not atomic by itself."""
    fields = {"image": RGBImageField(write_mode=write_mode, jpeg_quality=jpeg_quality), "label": IntField()}
    workers = max(1, min(workers, len(split) // 100))  # tiny splits: extra processes would only cost start-up
    chunk = max(1, min(256, len(split) // (4 * workers)))  # several chunks per worker, so all of them get work
    writer = _Writer(str(path), fields, desc=desc, num_workers=workers, page_size=page_size)
    writer.from_indexed_dataset(ArrayDataset(split), chunksize=chunk)
