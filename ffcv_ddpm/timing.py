"""The one timed loop: N training iterations, each timed from the request for its batch to the next request.

    t = timed_steps(lambda batch, i: trainer.step(*batch, lr), lambda: next(data), n=50, device=device)
    t.iter_ms, t.wait_ms, t.loss_sum     # per-iteration ms, the wait for data within each, the summed loss (device)

Used by the trainer (one call per log interval), benchmarks.speed.bench (a row's timed iterations),
benchmarks.speed.profile (the telemetry blocks), and for single timed calls (timed_call: a sampler run, a kernel).

On CUDA, events are recorded on the current stream. The CPU runs ahead of the GPU, so an event recorded at the top
of iteration i completes when the GPU has finished iteration i-1: iteration i spans start_i -> start_{i+1} on the
GPU's clock, and that span includes any time the GPU sat idle because the loader was late. wait_i = start_i ->
data_ready_i is exactly that idle time (zero when the batch was ready before the GPU needed it). Published
benchmarks that start their events after the batch arrives cannot see a slow loader at all. One synchronize, at the
end of the loop. On CPU (no asynchrony) the same spans are taken with perf_counter.
"""

import gc
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch


def mark(cuda: bool):
    """A point in time: a CUDA event recorded on the current stream (no sync), else perf_counter."""
    if cuda:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev
    return time.perf_counter()


def elapsed_ms(a, b, cuda: bool) -> float:
    """Milliseconds from mark a to mark b (CUDA: both events must have completed)."""
    return a.elapsed_time(b) if cuda else (b - a) * 1e3


class _StepTimer:
    """The marks of timed_steps: start() before asking for the batch, data_ready() when it is there, stop() after the
    last iteration, read() -> (iteration ms, data-wait ms) with one synchronize."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._starts, self._ready = [], []

    def start(self):
        self._starts.append(mark(self.cuda))

    def data_ready(self):
        self._ready.append(mark(self.cuda))

    def stop(self):
        """Close the last iteration (an iteration ends where the next one starts)."""
        self._starts.append(mark(self.cuda))

    def _ms(self, a, b) -> float:
        return elapsed_ms(a, b, self.cuda)

    def read(self) -> tuple[list[float], list[float]]:
        """(iteration ms, data-wait ms) for the iterations since the last read. Synchronizes once on CUDA."""
        starts, ready = self._starts, self._ready
        n = len(ready)
        if len(starts) != n + 1:
            raise RuntimeError(f"_StepTimer: {len(starts)} start/stop marks for {n} iterations; call stop() first")
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


@dataclass
class Timed:
    iter_ms: list[float]             # per iteration, the wait for its batch included
    wait_ms: list[float]             # the part of each iteration spent waiting for the batch
    loss_sum: torch.Tensor | None    # the steps' losses summed on the device (None if step returned none)

    @property
    def steps(self) -> int:
        return len(self.iter_ms)


def timed_steps(step: Callable[[Any, int], torch.Tensor | None], fetch: Callable[[], Any], n: int, device,
                stop_after: Callable[[int, torch.Tensor | None], bool] | None = None) -> Timed:
    """Up to `n` iterations of `step(fetch(), i)`, timed as the module docstring says; one sync, at the end.

    `step` returns a scalar loss tensor (summed on the device, never read here) or None. `stop_after(i, loss)`, if
    given, runs after each iteration without syncing (a signal flag, a progress bar) and ends the loop by returning
    True.
    """
    timer = _StepTimer(device)
    loss_sum = None
    for i in range(n):
        timer.start()  # before asking for the batch: a late loader shows up as a longer iteration
        batch = fetch()
        timer.data_ready()
        loss = step(batch, i)
        if loss is not None:
            if loss_sum is None:
                loss_sum = torch.zeros((), device=loss.device)  # fp32, whatever the loss's dtype
            loss_sum += loss
        if stop_after is not None and stop_after(i, loss):
            break
    timer.stop()
    iter_ms, wait_ms = timer.read()
    return Timed(iter_ms, wait_ms, loss_sum)


def timed_call(fn: Callable[[], Any], device) -> tuple[Any, float]:
    """(fn(), its milliseconds): one iteration of timed_steps with nothing to fetch."""
    out = []
    t = timed_steps(lambda _batch, _i: out.append(fn()), lambda: None, 1, device)
    return out[0], t.iter_ms[0]


def untimed_steps(step: Callable[[Any, int], Any], fetch: Callable[[], Any], n: int, device) -> float:
    """Warm-up: `n` iterations, then one sync; the wall seconds they took (compilation included, not a timing)."""
    t0 = time.perf_counter()
    for i in range(n):
        step(fetch(), i)
    sync(device)
    return time.perf_counter() - t0


def freeze_garbage() -> tuple[int, int]:
    """gc.collect(), then gc.freeze() (train.gc_freeze): what is alive now (the compiled graphs, the model, the loader)
    is left out of every later collection, so a full one walks only what was made since. Returns how many objects
    this call froze and how many the process had frozen before it (for unfreeze_garbage: on the GPU machine's image
    at 922d6ff something froze objects in a test's process before the trainer did; which import, not yet known).
    Called outside timed steps: the collection takes ~0.1-1 s."""
    gc.collect()  # what is garbage now is freed, not frozen with the rest
    before = gc.get_freeze_count()
    gc.freeze()
    return gc.get_freeze_count() - before, before


def unfreeze_garbage(frozen: tuple[int, int] | None) -> None:
    """Give back what freeze_garbage froze, unless the process had frozen objects of its own before: gc.unfreeze()
    gives back everything, and a caller that froze its objects (a server's pre-fork freeze, a test runner) keeps them
    frozen; ours then stay frozen too, which only keeps them out of later collections."""
    if frozen and not frozen[1]:
        gc.unfreeze()


class GcPauses:
    """Python's garbage collections in this process, as gc.callbacks reports them: how many per generation, their
    total and longest pause since the last take(). A full (generation 2) collection walks every live object, the
    compiled graphs' included, and stalls the step it falls in; under DDP it stalls every rank at the next
    all-reduce. Host clock only: no device sync.

        pauses = GcPauses().start(); pauses.reset(); <timed steps>; pauses.take() -> {"gc_ms": ..., "gc_max_ms": ...,
        "gc_collections": [per generation]}
    """

    def __init__(self):
        self._t0 = None
        self.reset()

    def reset(self):
        """Forget what was counted (the trainer's bookkeeping between two intervals: not a step's pause)."""
        self.ms, self.max_ms, self.counts = 0.0, 0.0, [0, 0, 0]

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            ms = (time.perf_counter() - self._t0) * 1e3
            self.ms += ms
            self.max_ms = max(self.max_ms, ms)
            self.counts[min(info["generation"], 2)] += 1
            self._t0 = None

    def start(self) -> "GcPauses":
        gc.callbacks.append(self._callback)
        return self

    def stop(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def take(self) -> dict:
        out = {"gc_ms": self.ms, "gc_max_ms": self.max_ms, "gc_collections": list(self.counts)}
        self.reset()
        return out
