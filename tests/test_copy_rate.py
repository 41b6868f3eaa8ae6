"""benchmarks.speed.copy_rate on the CPU: the sweep writes a row a size (after every row), the ledger lists it, and
bad sizes are one line; floors prices each GroupNorm site's passes at the copy rate of the site's own size."""

import json

import pytest

from benchmarks import ledger
from benchmarks.speed import copy_rate, floors


def test_the_sweep_writes_each_size_and_the_ledger_lists_it(tmp_path, capsys):
    out = tmp_path / "results" / "cpu" / "copy"
    assert copy_rate.main(["--out", str(out), "--mib", "1,4", "--iters", "3"]) == 0
    r = json.loads((out / "copy_rate.json").read_text())
    assert [row["mib"] for row in r["rows"]] == [1, 4] and all(row["gb_per_s"] > 0 for row in r["rows"])
    assert r["device_name"] is None and r["footprint_gib"] == 0 and "| 4 |" in (out / "copy_rate.md").read_text()
    assert ledger.main(["--results", str(tmp_path / "results")]) == 0
    line = next(ln for ln in (tmp_path / "results" / "README.md").read_text().splitlines() if "copy_rate.json" in ln)
    assert "copy rate" in line and "over 1-4 MiB" in line
    capsys.readouterr()
    for bad in ("0,4", "a lot", ""):
        assert copy_rate.main(["--out", str(tmp_path / "x"), "--mib", bad]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "expected comma-separated whole MiB >= 1" in err[0], err
    assert not (tmp_path / "x").exists()


def test_floors_price_each_site_at_its_own_sizes_copy_rate(monkeypatch):
    """A copy rate that depends on the size (as on an H200: 4.2 TB/s at 128 MB, 2.77 at 1 GiB): each site's pass at
    its own size's rate, the optimizer's at the parameters' size; with --copy-mib every pass at that one size's."""
    from ffcv_ddpm.config import load_config

    asked = []

    def rate(nbytes, device="cuda", iters=10):  # GB/s: slower for bigger copies, never the same for two sizes
        asked.append(nbytes)
        return 1000.0 / (1 + nbytes / 1e5)

    monkeypatch.setattr(copy_rate, "copy_gb_per_s", rate)
    cfg = load_config("tiny", ["model.image_size=8", "data.batch_size=6"])
    m = floors.measure(cfg, 6, False, 1, 0)
    sites = sorted(set(asked))
    assert len(sites) >= 3 and m["copy_mib"] is None and set(m["copy_rates"]) == {str(b) for b in sites}
    norm = m["memory"]["normalization"]
    opt_bytes = 4 * m["memory"]["optimizer"]["params"]
    assert m["memory"]["optimizer"]["floor_ms"] == pytest.approx(10 * opt_bytes / rate(opt_bytes) / 1e6)
    # the normalization's rate is its sites' bytes over their time: between its slowest and fastest site's rate
    site_rates = [m["copy_rates"][str(b)] for b in sites if b != opt_bytes]
    assert min(site_rates) < m["copy_gb_per_s"] < max(site_rates)
    assert norm["floor_ms_5_passes"] == pytest.approx(5 * norm["bytes_per_pass"] / m["copy_gb_per_s"] / 1e6)
    asked.clear()
    fixed = floors.measure(cfg, 6, False, 1, 8)
    assert asked == [8 << 20] and fixed["copy_mib"] == 8 and fixed["copy_gb_per_s"] == pytest.approx(rate(8 << 20))
    assert fixed["memory"]["normalization"]["bytes_per_pass"] == norm["bytes_per_pass"]


def test_norm_bench_rates_each_kernel_against_a_copy_of_one_pass():
    """norm_bench --kernels: each streaming kernel's bytes (its passes of the site's bf16 tensor) over its time,
    against a copy's rate at one pass's size; the small finalize kernels and others are not rows; a name Triton
    suffixed counts as its kernel."""
    from benchmarks.speed import norm_bench

    shape = (4, 8, 16, 16, 0.1, True, 2)
    one_pass = 4 * 8 * 16 * 16 * 2
    times = {"_stats_kernel": 0.002, "_apply_kernel_0d1d": 0.004, "_finalize_kernel": 0.5, "_bwd_dx_kernel": 0.01,
             "void at::native::elementwise_kernel": 1.0}
    rows = {r["kernel"]: r for r in norm_bench.kernel_rows(times, shape, copy_gbs=10.0)}
    assert set(rows) == {"_stats_kernel", "_apply_kernel", "_bwd_dx_kernel"}  # no reduction timed: no row
    assert rows["_apply_kernel"]["gb_per_s"] == pytest.approx(2 * one_pass / 0.004 / 1e6)
    assert rows["_bwd_dx_kernel"]["passes"] == 3 and rows["_bwd_dx_kernel"]["of_copy"] == pytest.approx(
        3 * one_pass / 0.01 / 1e6 / 10.0)
    # the mask as bits: the apply writes a sixteenth of a pass more, the backward kernels read it; statistics as before
    with_bits = {r["kernel"]: r for r in norm_bench.kernel_rows(times, shape, copy_gbs=10.0, bits=True)}
    assert with_bits["_apply_kernel"]["gb_per_s"] == pytest.approx((2 * one_pass + one_pass // 16) / 0.004 / 1e6)
    assert with_bits["_stats_kernel"]["gb_per_s"] == rows["_stats_kernel"]["gb_per_s"]
