"""The bench table's MFU columns: the reference network's FLOPs, the FLOPs the row's computation executes (a
reformulation that does less work, e.g. the folded upsample, is not read as faster kernels: issue 47 item 5), and
older files without the executed count."""

import pytest

from benchmarks.speed.report import add_metrics, render_markdown


def result(executed: float | None) -> dict:
    train = {"fwd": 12e9, "fwd_bwd": 36e9, "fwd_by_category": {"conv": 11e9, "linear": 0.1e9, "attention": 0.9e9},
             "params": 1}
    if executed is not None:
        train["executed_fwd_bwd"] = executed
    raw = {"batch_size": 1000, "precision": "bf16", "tf32_matmul": False, "tf32_cudnn": False,
           "iter_ms": [100.0] * 10, "wait_ms": [1.0] * 10, "first_step_s": 1.0, "peak_mem_bytes": 2**30}
    row = {"name": "defaults", "group": "ddpm-cifar10", "preset": "ddpm-cifar10", "baseline": True, "overrides": [],
           "status": "ok", "error": None, "raw": raw}
    return {"table": "ddpm", "command": ["python"], "device_name": "NVIDIA H200", "card": "h200",
            "environment": {"commit": "abc", "torch": "2.x", "cuda": "12", "date_utc": "2026-01-01"},
            "dataset": {"path": "d", "num_images": 1, "source": "synthetic", "synthetic": True},
            "settings": {"iters": 10, "warmup": 1},
            "flops": {"ddpm-cifar10": {"train": train, "published": {"mult_adds_fwd": 1e9, "fwd_bwd": 6e9}}},
            "measured_peaks": None, "rows": [row]}


def test_mfu_against_the_executed_flops_beside_the_reference_networks():
    m = add_metrics(result(executed=33.5e9))["rows"][0]["metrics"]  # 10,000 img/s
    assert m["mfu"] == pytest.approx(360.0 / 989.4) and m["executed_mfu"] == pytest.approx(335.0 / 989.4)
    text = render_markdown(add_metrics(result(executed=33.5e9)))
    header = next(line for line in text.splitlines() if line.startswith("| row |"))
    cells = next(line for line in text.splitlines() if line.startswith("| defaults |"))
    columns = [c.strip() for c in header.strip("|").split("|")]
    values = dict(zip(columns, (c.strip() for c in cells.strip("|").split("|"))))
    assert values["MFU"] == "36.4%" and values["MFU (executed FLOPs)"] == "33.9%"
    old = render_markdown(add_metrics(result(executed=None)))  # a file from before the count was recorded
    cells = next(line for line in old.splitlines() if line.startswith("| defaults |"))
    assert dict(zip(columns, (c.strip() for c in cells.strip("|").split("|"))))["MFU (executed FLOPs)"] == "-"


def test_ddp_points_carry_the_executed_flops_mfu_and_older_files_do_not_invent_it(tmp_path):
    from benchmarks.speed import ddp

    def result(executed):
        point = {"nproc": 2, "img_per_s": 20_000.0}
        r = {"flops_per_image": 36e9, "peak_tflops": 1000.0, "points": {"per-GPU": [{"nproc": 1, "img_per_s": 10_250.0},
                                                                                   point]}}
        if executed:
            r["executed_flops_per_image"] = executed
        ddp.add_metrics(r)
        return point

    p = result(33e9)
    assert p["mfu_per_gpu"] == pytest.approx(10_000 * 36e9 / 1e12 / 1000) and p["executed_mfu_per_gpu"] == \
        pytest.approx(10_000 * 33e9 / 1e12 / 1000)
    assert "executed_mfu_per_gpu" not in result(None)
