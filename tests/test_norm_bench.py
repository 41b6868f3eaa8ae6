"""benchmarks.speed.norm_bench without a GPU: the plans it sweeps and how it picks the fastest per site."""

from benchmarks.speed import norm_bench


def test_the_grid_sweeps_every_tile_chunk_and_warp_combination():
    from ffcv_ddpm.norm import DEFAULT_PLAN, plan_problem

    grid = norm_bench.FUSED_PLANS["grid"]
    assert len(grid) == len(set(grid)) == 40  # 4 tiles x 5 chunks x 2 warps: the docstring and --help say 40
    assert "40 kernel plans per site" in norm_bench.__doc__
    default = norm_bench.FUSED_PLANS["default"]  # DEFAULT_PLAN first, then grid plans (loops as written)
    assert default[0] == DEFAULT_PLAN and set(default[1:]) <= set(grid) and DEFAULT_PLAN[:3] == default[1]
    assert max(chunk for _, chunk, _ in grid) == 131072  # past 65536, where the H200 sweep found every site's best
    for plans in norm_bench.FUSED_PLANS.values():  # every plan one that model.norm_plan accepts
        assert [plan_problem(*plan) for plan in plans] == [None] * len(plans)
    stages = norm_bench.FUSED_PLANS["stages"]  # the default's plan first with its loops as written, then pipelined
    assert stages[0] == DEFAULT_PLAN[:3] and {plan[:3] for plan in stages[1:4]} == {DEFAULT_PLAN[:3]}
    assert DEFAULT_PLAN in stages
    assert [plan[3] for plan in stages[1:]] == [2, 3, 4, 3] and "--plans stages" in norm_bench.__doc__
    near = norm_bench.FUSED_PLANS["neighbours"]  # the default first, then plans one halving or doubling away, as deep
    assert near[0] == DEFAULT_PLAN and len(set(near)) == len(near) and "--plans neighbours" in norm_bench.__doc__
    for tile, chunk, warps, stages in near[1:]:
        assert (warps, stages) == DEFAULT_PLAN[2:]
        assert {tile / DEFAULT_PLAN[0], chunk / DEFAULT_PLAN[1]} <= {0.5, 1, 2}


def test_the_fused_layer_is_built_with_the_plan_given(monkeypatch):
    """Site.layer hands the plan to GroupNormAct (no module constants to assign), None meaning the default, and the
    config's switches to the fused layer alone, a --kernels variant's over them."""
    from ffcv_ddpm.norm import DEFAULT_PLAN, GroupNormAct

    built = []
    monkeypatch.setattr(GroupNormAct, "cuda", lambda self: built.append((self.plan, self.fast_silu)) or self)
    site = norm_bench.Site.__new__(norm_bench.Site)  # without its CUDA inputs: only layers are built here
    site.shape, site.fused = (2, 8, 4, 4, 0.0, False, 2), (("fast_silu", True), ("pair_hash", True))
    site.layer("fused", (1024, 16384, 4))
    site.layer("fused", None)
    site.layer("fused", None, (("fast_silu", False),))
    assert built == [((1024, 16384, 4), True), (DEFAULT_PLAN, True), (DEFAULT_PLAN, False)]
    assert DEFAULT_PLAN != (1024, 16384, 4)
    site.layer("scale-shift", None)  # the fused switches would be refused by any other implementation
    assert built[-1] == (None, False)


def test_best_plans_takes_the_fastest_fused_row_of_each_site():
    rows = [{"impl": "fused", "plan": [1024, 8192, 4], "shape": [8, 128], "fwd_bwd_ms": 2.0},
            {"impl": "fused", "plan": [4096, 32768, 8], "shape": [8, 128], "fwd_bwd_ms": 1.5},
            {"impl": "scale-shift", "plan": None, "shape": [8, 128], "fwd_bwd_ms": 1.0},
            {"impl": "fused", "plan": [2048, 16384, 4], "shape": [8, 384], "fwd_bwd_ms": 3.0}]
    best = norm_bench.best_plans(rows)
    assert {k: v["plan"] for k, v in best.items()} == {"[8, 128]": [4096, 32768, 8], "[8, 384]": [2048, 16384, 4]}


def test_a_row_is_its_median_round_with_every_round_kept():
    rounds = [{"fwd_ms": 0.5, "fwd_bwd_ms": 1.6}, {"fwd_ms": 0.3, "fwd_bwd_ms": 1.0}, {"fwd_ms": 0.4, "fwd_bwd_ms": 1.3}]
    shape = (1024, 128, 32, 32, 0.1, True, 32)
    row = norm_bench.summarize("fused", (1024, 16384, 4), shape, rounds)
    assert (row["fwd_ms"], row["fwd_bwd_ms"]) == (0.4, 1.3) and row["rounds"] == rounds
    assert row["shape"] == [1024, 128, 32, 32, 0.1, True]
    # 5 bf16 passes over 1024 x 128 x 32 x 32 = 1.342 GB, in 1.3 ms
    assert abs(row["min_gb"] - 1.342) < 1e-3 and abs(row["gb_per_s_at_min_bytes"] - 1032.44) < 0.01


def test_without_a_gpu_it_says_so(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        return
    assert norm_bench.main(["--out", str(tmp_path)]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_graph_timing_captures_every_implementation_on_a_gpu():
    """On a GPU (skipped here): each implementation's forward and forward + backward, dropout included, capture into a
    CUDA graph and replay; the times are positive and the graph's are no slower than launching from the host."""
    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    site = norm_bench.Site((64, 128, 16, 16, 0.1, True, 32))
    for impl in norm_bench.IMPLS:
        graph = site.measure(impl, None, "graph", 10, 2)
        events = site.measure(impl, None, "events", 10, 2)
        assert 0 < graph["fwd_ms"] < graph["fwd_bwd_ms"], (impl, graph)
        assert graph["fwd_bwd_ms"] <= 1.5 * events["fwd_bwd_ms"], (impl, graph, events)
    # --kernels: the profiler names each streaming kernel of the fused op in every variant (the layer built again
    # with each one's switches: fast SiLU, mask bits, neither SiLU nor dropout)
    for name, switches, _ in norm_bench.KERNEL_VARIANTS:
        times = norm_bench.kernel_ms(site.step("fused", None, switches)[1], 3)
        rows = norm_bench.kernel_rows(times, site.shape, copy_gbs=1000.0)
        assert [r["kernel"] for r in rows] == list(norm_bench.KERNEL_PASSES) and all(r["ms"] > 0 for r in rows), (
            name, times)


def test_a_plan_that_fails_is_one_failed_row_and_the_sweep_goes_on():
    """A staged plan Triton cannot compile raises in its first round: it is measured no more, its error is kept, the
    other runs get every round (interleaved), and best_plans passes over the failed row."""
    calls = []

    def measure(impl, plan):
        calls.append(plan)
        if plan == (2048, 65536, 4, 4):
            raise RuntimeError("PassManager::run failed\nmore compiler output")
        return {"fwd_ms": 1.0, "fwd_bwd_ms": 3.0 if plan == (2048, 65536, 4) else 2.0}

    runs = [("fused", (2048, 65536, 4)), ("fused", (2048, 65536, 4, 4)), ("fused", (2048, 65536, 4, 3))]
    got, failed = norm_bench.sweep(measure, runs, rounds=2)
    assert calls == [(2048, 65536, 4), (2048, 65536, 4, 4), (2048, 65536, 4, 3), (2048, 65536, 4), (2048, 65536, 4, 3)]
    assert failed == {runs[1]: "RuntimeError: PassManager::run failed"}
    assert [len(got[r]) for r in runs] == [2, 0, 2]
    rows = [norm_bench.summarize(*runs[0], (8, 128, 4, 4, 0.0, False, 2), got[runs[0]]),
            {"impl": "fused", "plan": runs[1][1], "shape": [8, 128, 4, 4, 0.0, False], "error": failed[runs[1]]},
            norm_bench.summarize(*runs[2], (8, 128, 4, 4, 0.0, False, 2), got[runs[2]])]
    assert norm_bench.best_plans(rows)["[8, 128, 4, 4, 0.0, False]"]["plan"] == (2048, 65536, 4, 3)
