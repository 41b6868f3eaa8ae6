"""Per-iteration timing with the wait for data inside the timed region, read with one sync per interval.

    timer = StepTimer(device)
    for ...:
        timer.start()              # top of the iteration, BEFORE asking the loader for the batch
        batch = next(it)
        timer.data_ready()
        step(batch)
    timer.stop()
    iter_ms, wait_ms = timer.read()   # one synchronize

On CUDA, events are recorded on the current stream. The CPU runs ahead of the GPU, so an event recorded at the top
of iteration i completes when the GPU has finished iteration i-1: iteration i spans start_i -> start_{i+1} on the
GPU's clock, and that span includes any time the GPU sat idle because the loader was late. wait_i = start_i ->
data_ready_i is exactly that idle time (zero when the batch was ready before the GPU needed it). Published
benchmarks that start their events after the batch arrives cannot see a slow loader at all.
On CPU (no asynchrony) the same spans are taken with perf_counter.
"""

import time

import torch


class StepTimer:
    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._starts, self._ready = [], []

    def _mark(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self):
        self._starts.append(self._mark())

    def data_ready(self):
        self._ready.append(self._mark())

    def stop(self):
        """Close the last iteration (an iteration ends where the next one starts)."""
        self._starts.append(self._mark())

    def _ms(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3

    def read(self) -> tuple[list[float], list[float]]:
        """(iteration ms, data-wait ms) for the iterations since the last read. Synchronizes once on CUDA."""
        starts, ready = self._starts, self._ready
        n = len(ready)
        if len(starts) != n + 1:
            raise RuntimeError(f"StepTimer: {len(starts)} start/stop marks for {n} iterations; call stop() first")
        if self.cuda and n:
            starts[-1].synchronize()
        iter_ms = [self._ms(starts[i], starts[i + 1]) for i in range(n)]
        wait_ms = [self._ms(starts[i], ready[i]) for i in range(n)]
        self._starts, self._ready = [], []
        return iter_ms, wait_ms


def sync(device) -> None:
    """Wait for the device (a no-op on CPU): only at the edges of timed regions, never inside the loop."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
