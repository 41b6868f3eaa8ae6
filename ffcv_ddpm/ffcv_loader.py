"""FFCV's Loader with one change at epoch starts: the new epoch's copies to the GPU wait, on the GPU, for the work
queued before the epoch began, where the host used to drain the stream (imported only when an FFCV loader is built).

Why (benchmarks/NOTES.md, "FFCV epochs ordered after the queued work", and item 18): each FFCV epoch allocates its
device buffers on the current stream and fills them from its own streams. The caching allocator may hand it blocks
that kernels still queued on the current stream (the last steps' activations) have just freed, and an unordered copy
then overwrites live activations (seen on an H200: a NaN loss at the first step of epoch 2). Draining the stream
before the epoch prevented that but emptied the GPU's queue once an epoch: on 4 GPUs at 512 per GPU an epoch is 24
steps, and every rank waited for the slowest drain. An event recorded before the allocation, waited on by the copy
streams, gives the same order without stopping the host.
"""

import torch

from ffcv_ddpm.numba_cache import cache_typed_dict

cache_typed_dict()  # before FFCV's import
from ffcv.loader import Loader  # noqa: E402
from ffcv.loader.epoch_iterator import EpochIterator
from ffcv.pipeline.compiler import Compiler


class OrderedEpoch(EpochIterator):
    """An FFCV epoch whose copy streams first wait for the current stream's work queued before the epoch began."""

    def __init__(self, loader: Loader, order):
        self.queued = None
        if torch.cuda.is_available():  # FFCV's own test for using CUDA streams (epoch_iterator.IS_CUDA)
            # Before super().__init__, which allocates the device buffers and starts the epoch's thread.
            self.queued = torch.cuda.Event()
            self.queued.record(torch.cuda.current_stream())
        super().__init__(loader, order)

    def run_pipeline(self, b_ix, batch_indices, batch_slot, cuda_event):
        if self.queued is not None:  # a no-op on the GPU once the queued work is done
            self.cuda_streams[batch_slot].wait_event(self.queued)
        return super().run_pipeline(b_ix, batch_indices, batch_slot, cuda_event)


class OrderedLoader(Loader):
    """ffcv.loader.Loader whose epochs are OrderedEpoch."""

    def __iter__(self):
        # Loader.__iter__ of ffcv 1.0.2 (tests/test_data.py checks it is still the same), with OrderedEpoch.
        Compiler.set_num_threads(self.num_workers)
        order = self.next_traversal_order()
        selected_order = order[:len(self) * self.batch_size]
        self.next_epoch += 1
        if self.code is None or self.recompile:
            self.generate_code()
        return OrderedEpoch(self, selected_order)
