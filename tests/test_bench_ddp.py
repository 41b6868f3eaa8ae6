"""benchmarks.speed.ddp on CPU: torchrun + gloo with 1 and 2 processes of the tiny preset, results and report
written."""

import json

import pytest

from benchmarks.speed import ddp
from conftest import write_beton


@pytest.fixture
def data(tmp_path):
    """A data folder holding a small train .beton, as the benchmark reads it."""
    folder = tmp_path / "data"
    folder.mkdir()
    write_beton(folder / "cifar10_train_raw.beton", 128)
    return folder


def test_ddp_scaling_benchmark_on_cpu(data, tmp_path):
    out = tmp_path / "res"
    rc = ddp.main(["--data", str(data), "--device", "cpu", "--preset", "tiny", "--gpus", "1,2", "--mode", "per-gpu",
                   "data.batch_size=16", "--steps", "6", "--log-every", "2", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "ddp.json").read_text())
    points = result["points"]["per-GPU"]
    assert [p["nproc"] for p in points] == [1, 2]
    assert [p["global_batch"] for p in points] == [16, 32]
    for p in points:
        assert p["img_per_s"] > 0 and 0 <= p["data_wait_share"] <= 1 and p["mfu_per_gpu"] is None
        assert [s["step"] for s in p["stats"]] == [2, 4, 6]
    assert points[0]["scaling_efficiency"] == 1.0
    assert (out / "ddp.md").read_text().count("\n| ") >= 3 and (out / "ddp.png").stat().st_size > 0


def test_ddp_diagnostics_on_cpu(data, tmp_path):
    """The control (independent single-process trainers), a DDP variant (small buckets; gloo has no bf16 all-reduce,
    so the bf16 hook is refused on CPU, one line) and the all-reduce timing: each recorded as its own mode, each
    rank's data wait in the DDP points."""
    out = tmp_path / "res"
    rc = ddp.main(["--data", str(data), "--device", "cpu", "--preset", "tiny", "--gpus", "1,2", "--mode", "per-gpu",
                   "data.batch_size=16", "--steps", "4", "--log-every", "2", "--out", str(out), "--control",
                   "--allreduce", "--variant", "small-buckets:train.ddp_reduce=ddp train.ddp_bucket_mb=0.01",
                   "--variant", "bf16-grads:train.ddp_grad_dtype=bf16"])
    assert rc == 1  # the bf16 variant failed, recorded; the rest ran
    result = json.loads((out / "ddp.json").read_text())
    assert list(result["points"]) == ["per-GPU", ddp.CONTROL, "per-GPU, small-buckets", "per-GPU, bf16-grads"]
    assert "train.ddp_grad_dtype=bf16 needs NCCL" in result["points"]["per-GPU, bf16-grads"][0]["error"]
    control, variant = result["points"][ddp.CONTROL], result["points"]["per-GPU, small-buckets"]
    assert [p["nproc"] for p in control] == [2] and len(control[0]["per_process_img_per_s"]) == 2
    assert variant[0]["config"]["train"]["ddp_bucket_mb"] == 0.01 and variant[0]["nproc"] == 2
    assert len(variant[0]["stats"][-1]["rank_data_wait_share"]) == 2
    for p in (*control, *variant):
        assert p["scaling_efficiency"] > 0  # against the one-process per-GPU point
    (a,) = result["allreduce"]
    assert a["nproc"] == 2 and a["numel"] > 40_000 and a["bf16"]["bytes"] * 2 == a["fp32"]["bytes"]
    assert "## independent (no DDP)" in (out / "ddp.md").read_text()


def test_a_bad_variant_is_one_line(tmp_path, capsys):
    assert ddp.main(["--data", str(tmp_path), "--device", "cpu", "--variant", "nokey"]) == 2
    assert ddp.main(["--data", str(tmp_path), "--device", "cpu", "--variant", "x:train.ddp_grad_dtype=fp8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "NAME:KEY=VALUE" in err[0] and "train.ddp_grad_dtype" in err[1]
    assert list(tmp_path.iterdir()) == []


def test_loss_check_compares_curves_against_a_random_draws_control(data, tmp_path):
    out = tmp_path / "res"
    rc = ddp.main(["--data", str(data), "--device", "cpu", "--preset", "tiny", "--gpus", "1,2", "--mode", "global",
                   "data.batch_size=16", "--steps", "12", "--log-every", "2", "--out", str(out), "--loss-check"])
    lc = json.loads((out / "ddp.json").read_text())["loss_check"]
    # The control: same weights (train.seed), another data order, and a noise stream none of the 2 ranks draws.
    assert lc["control"]["config"]["data"]["seed"] == 1 and lc["control"]["config"]["train"]["noise_seed"] == 2
    assert lc["control"]["config"]["train"]["seed"] == 0 and lc["floor"] > 0  # other draws: another curve
    assert lc["tol"] == ddp.LOSS_MARGIN * lc["floor"]
    (c,) = lc["checks"]
    assert c["nproc"] == 2 and c["ok"] == (c["max_abs_smoothed"] <= lc["tol"])
    assert rc == (0 if c["ok"] else 1)  # a curve outside the tolerance fails the command
    assert "Loss curves: N GPUs against one" in (out / "ddp.md").read_text()
    assert ddp.main(["--data", str(data), "--device", "cpu", "--mode", "per-gpu", "--loss-check"]) == 2


def test_a_point_past_its_timeout_is_recorded_and_the_rest_run(data, tmp_path):
    out = tmp_path / "res"
    rc = ddp.main(["--data", str(data), "--device", "cpu", "--preset", "tiny", "--gpus", "1,2", "--mode", "per-gpu",
                   "data.batch_size=16", "--steps", "4", "--log-every", "2", "--out", str(out), "--control",
                   "--timeout", "0.5"])
    assert rc == 1
    points = json.loads((out / "ddp.json").read_text())["points"]
    assert [p["nproc"] for p in points["per-GPU"]] == [1, 2] and len(points[ddp.CONTROL]) == 1
    for p in (*points["per-GPU"], *points[ddp.CONTROL]):
        assert p["error"].startswith("stopped after --timeout 0.5 s")


def test_gpu_state_reads_the_measured_intervals_of_the_telemetry(tmp_path):
    """Clock and power after the first interval (compilation) only; no file (CPU) gives None."""
    path = tmp_path / "telemetry.jsonl"
    rows = [{"t": t / 10, "sm_clock_mhz": 1980 if t < 50 else 1500 + t, "power_w": 300.0 + t} for t in range(100)]
    rows.append({"t": 10.0, "sm_clock_mhz": None, "power_w": None})  # an unsupported query blanks a field
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    g = ddp.gpu_state(path, after_s=5.0)
    assert g["samples"] == 51 and g["sm_clock_mhz_median"] == 1574.5 and g["power_w_max"] == 399.0
    assert 1554 <= g["sm_clock_mhz_p10"] <= 1556 and g["power_w_median"] == 374.5
    assert ddp.gpu_state(tmp_path / "none.jsonl", after_s=0.0) is None


def test_read_run_keeps_the_slowest_step_the_collections_and_each_ranks_all_reduce(tmp_path):
    """From stats.jsonl, after the first (compiling) interval: the slowest step, the most any rank spent collecting in
    one interval, and with flat each rank's all-reduce time (median over intervals), in the JSON and the table."""
    run = tmp_path / "out" / "00000-tiny"
    run.mkdir(parents=True)
    (run / "config.json").write_text("{}")
    lines = [{"iter_ms_median": 60.0 + i, "iter_ms_max": 900.0 if i == 0 else 61.0 + 150 * (i == 2),
              "img_per_s": 1000.0, "data_wait_share": 0.001, "peak_mem_gib": 1.0, "wall_s": i, "gc_ms": 1.0,
              "rank_gc_ms": [1.0, 40.0 * (i == 2)], "rank_data_wait_share": [0.001, 0.002],
              "rank_allreduce_ms_mean": [2.5 + i, 0.8]} for i in range(4)]
    (run / "stats.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    p = ddp.read_run(tmp_path / "out")
    assert p["slowest_step_ms"] == 211.0 and p["gc_ms_worst_interval"] == 40.0
    assert p["allreduce_ms_by_rank"] == [4.5, 0.8]
    p |= {"nproc": 2, "per_rank_batch": 8, "global_batch": 16, "img_per_s_per_gpu": 500.0, "mfu_per_gpu": None,
          "scaling_efficiency": 0.97}
    result = {"preset": "tiny", "device_name": None, "environment": {}, "command": "x", "dataset": "d",
              "flops_per_image": 1e9, "peak_tflops": None, "precision": "fp32", "points": {"per-GPU, flat": [p]}}
    ddp.render(result, tmp_path / "ddp")
    row = next(line for line in (tmp_path / "ddp.md").read_text().splitlines() if line.startswith("| 2 |"))
    assert "| 211.0, 40.0 | 4.50 / 0.80 |" in row


def test_step_ms_tells_a_few_stalled_steps_from_a_slower_step():
    """Median over the measured intervals (the first, compiling one dropped) against the mean img/s counts: one
    interval with a stalled step moves the mean, not the median; the control (no stats) has none."""
    stats = [{"iter_ms_median": 900.0}, {"iter_ms_median": 64.0}, {"iter_ms_median": 65.0}, {"iter_ms_median": 66.0}]
    p = {"stats": stats, "per_rank_batch": 512, "nproc": 2, "img_per_s": 1024 / 0.070}  # 70 ms per step on average
    median, mean = ddp.step_ms(p)
    assert median == 65.0 and mean == pytest.approx(70.0)
    assert ddp.step_ms({"per_rank_batch": 512, "nproc": 2, "img_per_s": 1.0}) is None


def test_warm_up_runs_each_graph_of_the_plan_once_before_the_points(data, tmp_path):
    """--warm on: one short run per distinct (processes, per-rank batch, overrides) of the plan (the independent
    control shares the one-process graph), recorded; the points then run as usual."""
    plan = [("per-GPU", [1, 2], True, ddp.run_point, [], 16), (ddp.CONTROL, [2], True, ddp.run_independent, [], 16),
            ("per-GPU, v", [2], True, ddp.run_point, ["train.ddp_split=True"], 16),
            ("per-GPU, big", [1, 2], True, ddp.run_point, ["data.batch_size=32"], 32),
            ("global", [1, 2], False, ddp.run_point, [], 16)]
    assert ddp.warm_jobs(plan) == [(1, 16, ()), (2, 16, ()), (2, 16, ("train.ddp_split=True",)),
                                   (1, 32, ("data.batch_size=32",)), (2, 32, ("data.batch_size=32",)), (2, 8, ())]
    out = tmp_path / "res"
    rc = ddp.main(["--data", str(data), "--device", "cpu", "--preset", "tiny", "--gpus", "1,2", "--mode", "per-gpu",
                   "data.batch_size=16", "--steps", "4", "--log-every", "2", "--out", str(out), "--warm", "on",
                   "--variant", "cuts:train.ddp_reduce=ddp train.ddp_split=True"])
    assert rc == 0
    result = json.loads((out / "ddp.json").read_text())
    runs = result["warm_up"]["runs"]
    given = ["data.batch_size=16"]  # the command's own overrides go to every run
    cuts = [*given, "train.ddp_reduce=ddp", "train.ddp_split=True"]
    assert sorted((r["nproc"], r["overrides"]) for r in runs) == [(1, given), (2, given), (2, cuts)]
    assert all(r["rc"] == 0 and r["per_rank_batch"] == 16 for r in runs)
    assert [p["nproc"] for p in result["points"]["per-GPU"]] == [1, 2]


def test_the_warm_up_shares_a_gpu_by_its_memory():
    """2048 images of per-rank batch on an 80 GB card as before; on an H200 the global-batch plan's 1-process 2048
    run fits beside the 4- and 2-process ones (one compile round, not two)."""
    assert ddp.warm_images_per_gpu(85_045_870_592) == 2048  # H100 80GB HBM3
    h200 = ddp.warm_images_per_gpu(150_754_820_096)
    assert h200 == 3584 and 1536 + 2048 <= h200
    assert ddp.warm_images_per_gpu(16 * 2**30) == 512  # never below one small run


def test_a_variant_that_changes_one_gpu_scales_against_its_own_one_gpu_point():
    """CUDA graphs measured against one GPU without them read 97.2% where the same 4-GPU figure is 94.9% of one GPU
    with them (NOTES item 18): such a variant runs one process too, and its efficiency is against that point."""
    assert ddp.variant_counts([1, 2, 4], ["train.ddp_grad_dtype=bf16", "train.ddp_bucket_mb=200"]) == [2, 4]
    assert ddp.variant_counts([1, 2, 4], ["train.compile_mode=reduce-overhead"]) == [1, 2, 4]
    assert ddp.variant_counts([1, 4], ["train.ddp_split=True", "data.loader=gpu"]) == [1, 4]
    result = {"flops_per_image": 1e9, "peak_tflops": None, "points": {
        "per-GPU": [{"nproc": 1, "img_per_s": 100.0}, {"nproc": 4, "img_per_s": 380.0}],
        "per-GPU, graphs": [{"nproc": 1, "img_per_s": 110.0}, {"nproc": 4, "img_per_s": 396.0}],
        "per-GPU, bf16-grads": [{"nproc": 4, "img_per_s": 390.0}]}}
    ddp.add_metrics(result)
    eff = {m: [round(p["scaling_efficiency"], 4) for p in ps] for m, ps in result["points"].items()}
    assert eff == {"per-GPU": [1.0, 0.95], "per-GPU, graphs": [1.0, 0.9], "per-GPU, bf16-grads": [0.975]}


def test_a_variant_with_its_own_batch_runs_at_that_batch(data, tmp_path):
    """data.batch_size in a --variant is that variant's batch per GPU: the point must run at it, not at the command's
    batch (the trainer's argument list ends with the per-rank batch, so a variant's value was silently overridden)."""
    out = tmp_path / "res"
    rc = ddp.main(["--data", str(data), "--device", "cpu", "--preset", "tiny", "--gpus", "1", "--mode", "per-gpu",
                   "data.batch_size=16", "--steps", "2", "--log-every", "1", "--out", str(out), "--warm", "off",
                   "--variant", "half:data.batch_size=8"])
    assert rc == 0
    points = json.loads((out / "ddp.json").read_text())["points"]
    assert [(p["per_rank_batch"], p["config"]["data"]["batch_size"]) for p in points["per-GPU"]] == [(16, 16)]
    assert [(p["per_rank_batch"], p["config"]["data"]["batch_size"]) for p in points["per-GPU, half"]] == [(8, 8)]
