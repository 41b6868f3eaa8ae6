"""The one timed loop (ffcv_ddpm.timing) on CPU: a late batch shows as data wait inside the iteration, the loss is
summed on the device without a host read, a stop ends the loop early."""

import gc
import time

import pytest
import torch

from conftest import host_syncs
from ffcv_ddpm.timing import GcPauses, timed_call, timed_steps, untimed_steps


def test_a_late_batch_is_inside_the_iteration_and_counted_as_wait():
    def fetch():
        time.sleep(0.03)  # the loader is late by 30 ms
        return torch.ones(())

    def step(batch, i):
        time.sleep(0.01)
        return batch * (i + 1)

    t = timed_steps(step, fetch, 3, "cpu")
    assert t.steps == 3 and len(t.wait_ms) == 3
    assert all(w >= 29 for w in t.wait_ms)
    assert all(it >= w + 9 for it, w in zip(t.iter_ms, t.wait_ms))
    assert t.loss_sum.item() == 6.0 and t.loss_sum.dtype == torch.float32


def test_the_loss_is_summed_in_fp32_without_a_host_read():
    losses = [torch.tensor(1 / 3, dtype=torch.bfloat16)] * 4

    def run():
        return timed_steps(lambda batch, i: losses[i], lambda: None, 4, "cpu")

    assert host_syncs(run) == []
    t = run()
    assert t.loss_sum.dtype == torch.float32
    assert t.loss_sum.item() == pytest.approx(4 * losses[0].float().item())


def test_stop_after_ends_the_loop_and_none_is_not_summed():
    seen = []
    t = timed_steps(lambda batch, i: seen.append(i), lambda: None, 10, "cpu", stop_after=lambda i, loss: i == 2)
    assert seen == [0, 1, 2] and t.steps == 3 and t.loss_sum is None


def test_timed_call_and_untimed_steps():
    value, ms = timed_call(lambda: (time.sleep(0.02), 7)[1], "cpu")
    assert value == 7 and ms >= 19
    calls = []
    assert untimed_steps(lambda batch, i: calls.append((batch, i)), lambda: "b", 2, "cpu") >= 0
    assert calls == [("b", 0), ("b", 1)]


class _Cycle:
    def __init__(self):
        self.me = self  # a reference cycle: only the cyclic collector frees it


def test_gc_pauses_counts_collections_by_generation_and_resets():
    pauses = GcPauses().start()
    try:
        garbage = [_Cycle() for _ in range(20_000)]
        del garbage
        gc.collect()  # a full collection: generation 2
        gc.collect(0)
        got = pauses.take()
        assert got["gc_collections"][2] >= 1 and got["gc_collections"][0] >= 1
        assert 0 < got["gc_max_ms"] <= got["gc_ms"]
        assert pauses.take() == {"gc_ms": 0.0, "gc_max_ms": 0.0, "gc_collections": [0, 0, 0]}
        gc.collect()
        pauses.reset()
        assert pauses.take()["gc_collections"] == [0, 0, 0]
    finally:
        pauses.stop()
    gc.collect()
    assert pauses.take()["gc_collections"] == [0, 0, 0]  # stopped: no longer called
    assert pauses._callback not in gc.callbacks
