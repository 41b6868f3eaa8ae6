"""The two clocks the kernel benchmarks time with: CUDA-graph replays (the kernels alone) and calls launched one by
one from the host (CUDA events, or perf_counter on the CPU). norm_bench's --timing chooses between them; clock_ms
takes the graph on CUDA and the host's clock on the CPU (floors, copy_rate); the per-site benchmarks use graph_ms."""

from __future__ import annotations

import torch


def time_ms(fn, iters: int, warmup: int, device: str = "cuda") -> float:
    """--timing events: median ms of `iters` calls after `warmup` (timing.timed_steps: CUDA events, one sync; on
    the CPU, perf_counter). The host launches each call, so when its launch work outlasts the kernels this times the
    host (NOTES item 15)."""
    from ffcv_ddpm.timing import timed_steps, untimed_steps

    def call(_batch, _i):
        fn()  # returns None: nothing for timed_steps to sum

    untimed_steps(call, lambda: None, warmup, device)
    return sorted(timed_steps(call, lambda: None, iters, device).iter_ms)[iters // 2]


def graph_ms(fn, iters: int, warmup: int, reps: int = 5) -> float:
    """--timing graph: `iters` calls captured as one CUDA graph, replayed `reps` times; the median replay's ms per
    call. A replay launches nothing from the host, so this is the kernels' time alone, and each replay is long
    enough (tens of ms) for the clocks to settle."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as torch.cuda.graph's documentation asks
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()  # the first replay uploads the graph: not timed
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        times.append((start, stop))
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) / iters for a, b in times)[reps // 2]


def clock_ms(fn, cuda: bool, iters: int) -> float:
    """ms per call of fn on whichever device runs it: on CUDA `iters` calls as one CUDA graph (graph_ms), on CPU the
    median of `iters` timed calls after one untimed (time_ms)."""
    return graph_ms(fn, iters, warmup=2) if cuda else time_ms(fn, iters, warmup=1, device="cpu")
