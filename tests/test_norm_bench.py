"""benchmarks.speed.norm_bench without a GPU: the plans it sweeps and how it picks the fastest per site."""

from benchmarks.speed import norm_bench


def test_the_grid_sweeps_every_tile_chunk_and_warp_combination():
    grid = norm_bench.FUSED_PLANS["grid"]
    assert len(grid) == len(set(grid)) == 32
    assert set(norm_bench.FUSED_PLANS["default"]) <= set(grid)
    for tile, chunk, warps in grid:  # powers of two, a chunk at least a tile: what norm._plan expects
        assert tile & (tile - 1) == 0 and chunk & (chunk - 1) == 0 and chunk >= tile and warps in (4, 8)


def test_best_plans_takes_the_fastest_fused_row_of_each_site():
    rows = [{"impl": "fused", "plan": [1024, 8192, 4], "shape": [8, 128], "fwd_bwd_ms": 2.0},
            {"impl": "fused", "plan": [4096, 32768, 8], "shape": [8, 128], "fwd_bwd_ms": 1.5},
            {"impl": "scale-shift", "plan": None, "shape": [8, 128], "fwd_bwd_ms": 1.0},
            {"impl": "fused", "plan": [2048, 16384, 4], "shape": [8, 384], "fwd_bwd_ms": 3.0}]
    best = norm_bench.best_plans(rows)
    assert {k: v["plan"] for k, v in best.items()} == {"[8, 128]": [4096, 32768, 8], "[8, 384]": [2048, 16384, 4]}
