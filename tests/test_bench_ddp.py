"""benchmarks.speed.ddp on CPU: torchrun + gloo with 1 and 2 processes of the tiny preset, results and report
written."""

import json

import pytest

from benchmarks.speed import ddp
from conftest import write_beton

# The DDP points' trainers read the dataset into memory: FFCV's pipeline compiles for ~10 s in every process on a CPU,
# and these tests check the benchmark around the trainers (tests/test_ddp.py trains DDP through FFCV's loader).
LOADER = "data.loader=torch-memory"


@pytest.fixture
def data(tmp_path):
    """A data folder holding a small train .beton, as the benchmark reads it."""
    folder = tmp_path / "data"
    folder.mkdir()
    write_beton(folder / "cifar10_train_raw.beton", 128)
    return folder


def test_ddp_scaling_benchmark_and_its_diagnostics_on_cpu(data, tmp_path):
    """Both modes at 1 and 2 processes (their one-process points one run, recorded in both); then, in the same call,
    the control (independent single-process trainers), a DDP variant (small buckets; gloo has no bf16 all-reduce, so
    the bf16 hook is refused on CPU, one line), the all-reduce timing and the loss check: each recorded as its own
    mode, each rank's data wait in the DDP points. (One call: a torchrun launch costs ~10 s of a 2-core machine.)"""
    out = tmp_path / "res"
    rc = ddp.main(["--data", str(data), "--device", "cpu", "--preset", "tiny", "--gpus", "1,2", "--mode", "both",
                   "data.batch_size=16", LOADER, "--steps", "8", "--log-every", "2", "--out", str(out), "--control",
                   "--allreduce", "--variant", "small-buckets:train.ddp_reduce=ddp train.ddp_bucket_mb=0.01",
                   "--variant", "bf16-grads:train.ddp_grad_dtype=bf16", "--loss-check"])
    result = json.loads((out / "ddp.json").read_text())
    points = result["points"]["per-GPU"]
    assert [p["nproc"] for p in points] == [1, 2]
    assert [p["global_batch"] for p in points] == [16, 32]
    for p in points:
        assert p["img_per_s"] > 0 and 0 <= p["data_wait_share"] <= 1 and p["mfu_per_gpu"] is None
        assert [s["step"] for s in p["stats"]] == [2, 4, 6, 8]
        # The intervals after the first: 6 steps of the global batch over the seconds the three took.
        seconds = sum(2 * p["global_batch"] / s["img_per_s"] for s in p["stats"][1:])
        assert p["img_per_s"] == pytest.approx(6 * p["global_batch"] / seconds)
        assert p["img_per_s_median"] == pytest.approx(sorted(s["img_per_s"] for s in p["stats"][1:])[1])
        assert 0 < p["img_per_s_wall"] < p["img_per_s"]  # wall time holds the steps and the intervals' syncs
    assert points[0]["scaling_efficiency"] == 1.0
    md = (out / "ddp.md").read_text()
    assert md.count("\n| ") >= 3 and (out / "ddp.png").stat().st_size > 0

    assert list(result["points"]) == ["per-GPU", ddp.CONTROL, "per-GPU, small-buckets", "per-GPU, bf16-grads",
                                      "global"]
    assert "train.ddp_grad_dtype=bf16 needs NCCL" in result["points"]["per-GPU, bf16-grads"][0]["error"]
    control, variant = result["points"][ddp.CONTROL], result["points"]["per-GPU, small-buckets"]
    assert [p["nproc"] for p in control] == [2] and len(control[0]["per_process_img_per_s"]) == 2
    assert variant[0]["config"]["train"]["ddp_bucket_mb"] == 0.01 and variant[0]["nproc"] == 2
    assert len(variant[0]["stats"][-1]["rank_data_wait_share"]) == 2
    for p in (*control, *variant):
        assert p["scaling_efficiency"] > 0  # against the one-process per-GPU point
    (a,) = result["allreduce"]
    assert a["nproc"] == 2 and a["numel"] > 40_000 and a["bf16"]["bytes"] * 2 == a["fp32"]["bytes"]
    assert "## independent (no DDP)" in md

    # Global batch 16: one process at 16 is the per-GPU one-process point's run, recorded as such; two at 8 each.
    one, two = result["points"]["global"]
    assert one["same_run_as"] == "per-GPU" and one["stats"] == points[0]["stats"] and "same_run_as" not in points[0]
    assert (two["nproc"], two["per_rank_batch"], two["global_batch"]) == (2, 8, 16)
    assert "| 1 (the per-GPU run) | 16 | 16 |" in md
    lc = result["loss_check"]
    # The control: same weights (train.seed), another data order, and a noise stream none of the 2 ranks draws.
    assert lc["control"]["config"]["data"]["seed"] == 1 and lc["control"]["config"]["train"]["noise_seed"] == 2
    assert lc["control"]["config"]["train"]["seed"] == 0 and lc["floor"] > 0  # other draws: another curve
    assert lc["tol"] == ddp.LOSS_MARGIN * lc["floor"]
    (c,) = lc["checks"]
    assert c["nproc"] == 2 and c["ok"] == (c["max_abs_smoothed"] <= lc["tol"])
    assert "Loss curves: N GPUs against one" in md
    assert rc == 1  # the bf16 variant failed, recorded; the rest ran (a curve outside the tolerance fails it too)


def test_a_bad_variant_is_one_line(tmp_path, capsys):
    assert ddp.main(["--data", str(tmp_path), "--device", "cpu", "--variant", "nokey"]) == 2
    assert ddp.main(["--data", str(tmp_path), "--device", "cpu", "--variant", "x:train.ddp_grad_dtype=fp8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "NAME:KEY=VALUE" in err[0] and "train.ddp_grad_dtype" in err[1]
    assert list(tmp_path.iterdir()) == []


def test_loss_check_needs_global_points_with_one_process(data):
    assert ddp.main(["--data", str(data), "--device", "cpu", "--mode", "per-gpu", "--loss-check"]) == 2
    assert ddp.main(["--data", str(data), "--device", "cpu", "--mode", "global", "--gpus", "2", "--loss-check"]) == 2


def test_a_point_past_its_timeout_is_recorded_and_the_rest_run(data, tmp_path):
    out = tmp_path / "res"
    rc = ddp.main(["--data", str(data), "--device", "cpu", "--preset", "tiny", "--gpus", "1,2", "--mode", "per-gpu",
                   "data.batch_size=16", LOADER, "--steps", "4", "--log-every", "2", "--out", str(out), "--control",
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
    lines = [{"step": 2 * (i + 1), "iter_ms_median": 60.0 + i,
              "iter_ms_max": 900.0 if i == 0 else 61.0 + 150 * (i == 2),
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


def trainer_lines(iter_ms: list[list[float]], global_batch: int) -> list[dict]:
    """stats.jsonl lines of intervals whose steps took `iter_ms` each, their rates as the trainer computes them."""
    lines, step = [], 0
    for ms in iter_ms:
        step += len(ms)
        lines.append({"step": step, "img_per_s": len(ms) * global_batch / (sum(ms) / 1e3),
                      "iter_ms_median": float(sorted(ms)[len(ms) // 2])})
    return lines


def test_img_per_s_counts_a_stalled_interval_with_all_its_time():
    """Four steady intervals of 25 steps of 70 ms, one of them with a step stalled for 2 s (a rank collecting, a
    slow batch): img/s is all their images over all their seconds, so the stall costs what it cost; the median of
    the intervals' rates (kept beside it) does not see it. The first interval (compilation) stays out of both."""
    batch = 4 * 512  # 4 processes, 512 each
    intervals = [[5000.0] + [70.0] * 24] + [[70.0] * 25] * 2 + [[70.0] * 24 + [2000.0]] + [[70.0] * 25]
    stats = trainer_lines(intervals, batch)
    got = ddp.throughput(stats)
    steady = intervals[1:]
    assert got["img_per_s"] == pytest.approx(100 * batch / (sum(map(sum, steady)) / 1e3))  # 100 steps in 8.93 s
    assert got["img_per_s_median"] == pytest.approx(25 * batch / 1.75)  # 70 ms a step: the stall is not there
    assert got["img_per_s"] < 0.8 * got["img_per_s_median"] and "img_per_s_wall" not in got  # older trainer lines

    # That stall on the 4-GPU point (1 GPU: 70 ms a step, no stall): its efficiency and MFU per GPU fall with it,
    # and the mean step shows it.
    one = {"nproc": 1, "per_rank_batch": 512, "stats": trainer_lines([[70.0] * 25] * 5, 512)}
    four = {"nproc": 4, "per_rank_batch": 512, "stats": stats}
    result = {"flops_per_image": 1e9, "peak_tflops": 1000.0, "points": {"per-GPU": [one, four]}}
    for p in (one, four):
        p.update(ddp.throughput(p["stats"]))
    ddp.add_metrics(result)
    assert four["scaling_efficiency"] == pytest.approx(70.0 / (sum(map(sum, steady)) / 100))  # 78.4%, not 100%
    assert four["mfu_per_gpu"] == pytest.approx(four["img_per_s"] / 4 * 1e9 / 1e12 / 1000.0)
    median, mean = ddp.step_ms(four)
    assert median == 70.0 and mean == pytest.approx(sum(map(sum, steady)) / 100)  # 89.3 ms: some steps stalled
    assert ddp.step_ms({"per_rank_batch": 512, "nproc": 2, "img_per_s": 1.0}) is None  # the control: no intervals


def test_rederive_writes_the_files_figures_beside_todays(tmp_path, capsys):
    """--rederive FOLDER: every DDP result under it, its img/s recomputed from its intervals (a point of a file
    written with the median interval's rate moves), the efficiency and MFU after it; a point without intervals (the
    control before its processes' stats were kept) keeps its figure and says so."""
    batch = 512
    stalled = trainer_lines([[900.0] * 2] + [[50.0] * 10] * 2 + [[50.0] * 9 + [550.0]], 2 * batch)
    steady = trainer_lines([[900.0] * 2] + [[50.0] * 10] * 3, batch)
    old = {"nproc": 1, "per_rank_batch": batch, "global_batch": batch, "stats": steady, "img_per_s": 10240.0,
           "scaling_efficiency": 1.0, "mfu_per_gpu": 0.01024}
    result = {"flops_per_image": 1e9, "peak_tflops": 1000.0, "points": {
        "per-GPU": [old, {**old, "nproc": 2, "global_batch": 2 * batch, "stats": stalled, "img_per_s": 20480.0}],
        ddp.CONTROL: [{"nproc": 2, "img_per_s": 20000.0, "scaling_efficiency": 0.977, "mfu_per_gpu": 0.01}]}}
    (tmp_path / "run" / "A").mkdir(parents=True)
    (tmp_path / "run" / "A" / "ddp.json").write_text(json.dumps(result))
    (tmp_path / "run" / "other.json").write_text(json.dumps({"rows": []}))  # not a DDP result: not listed
    assert ddp.main(["--rederive", str(tmp_path / "run")]) == 0
    note = (tmp_path / "run" / ddp.REDERIVED).read_text()
    rows = [line for line in note.splitlines() if line.startswith("| [")]
    assert len(rows) == 3 and all(r.startswith("| [A/ddp.json](A/ddp.json) |") for r in rows)
    # 2 processes: 30 steps of 1024 images in 2.0 s = 15,360 img/s (the file: 20,480), 75.0% of twice 10,240.
    assert "| per-GPU | 2 | 20,480 | 15,360 (-25.00%) | 100.0% -> 75.0% | 1.0% -> 0.8% |" in rows[1]
    assert "| per-GPU | 1 | 10,240 | 10,240 (+0.00%) | 100.0% -> 100.0% |" in rows[0]
    assert "| 20,000 | not re-derivable: no intervals kept | 97.7% -> 97.7% |" in rows[2]
    assert ddp.rederive(result)["points"]["per-GPU"][1]["img_per_s_median"] == 20480.0
    assert ddp.main(["--rederive", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err.strip().endswith("--rederive " + str(tmp_path / "none") + ": no such folder")
    (tmp_path / "run" / "cut.json").write_text('{"points": ')  # a file cut short: named in one line
    assert ddp.main(["--rederive", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--rederive: cannot read {tmp_path / 'run' / 'cut.json'}: " in err


def test_warm_up_runs_each_graph_of_the_plan_once_before_the_points(data, tmp_path):
    """--warm on: one short run per distinct (processes, per-rank batch, overrides) of the plan (the independent
    control shares the one-process graph), recorded; the points then run as usual. The run's variant sets its own
    batch: data.batch_size in a --variant is that variant's batch per GPU, in its warm-up and its point (the trainer's
    argument list ends with the per-rank batch, so a variant's value was once silently overridden)."""
    plan = [("per-GPU", [1, 2], True, ddp.run_point, [], 16), (ddp.CONTROL, [2], True, ddp.run_independent, [], 16),
            ("per-GPU, v", [2], True, ddp.run_point, ["train.ddp_split=True"], 16),
            ("per-GPU, big", [1, 2], True, ddp.run_point, ["data.batch_size=32"], 32),
            ("global", [1, 2], False, ddp.run_point, [], 16)]
    assert ddp.warm_jobs(plan) == [(1, 16, ()), (2, 16, ()), (2, 16, ("train.ddp_split=True",)),
                                   (1, 32, ("data.batch_size=32",)), (2, 32, ("data.batch_size=32",)), (2, 8, ())]
    # Run, one process only (the plan above covers the graphs of two; the scaling test runs two-process points): a
    # warm-up run per graph, then the points. (A torchrun launch costs a 2-core machine ~10 s, each rank ~5 s of it:
    # this run also checks the variant's batch.)
    out = tmp_path / "res"
    rc = ddp.main(["--data", str(data), "--device", "cpu", "--preset", "tiny", "--gpus", "1", "--mode", "per-gpu",
                   "data.batch_size=16", LOADER, "--steps", "4", "--log-every", "2", "--out", str(out), "--warm", "on",
                   "--variant", "half:train.ddp_reduce=ddp train.ddp_split=True data.batch_size=8"])
    assert rc == 0
    result = json.loads((out / "ddp.json").read_text())
    runs = result["warm_up"]["runs"]
    given = ["data.batch_size=16", LOADER]  # the command's own overrides go to every run
    half = [*given, "train.ddp_reduce=ddp", "train.ddp_split=True", "data.batch_size=8"]
    assert sorted((r["nproc"], r["per_rank_batch"], r["overrides"]) for r in runs) == [(1, 8, half), (1, 16, given)]
    assert all(r["rc"] == 0 for r in runs)
    points = result["points"]
    assert [(p["nproc"], p["per_rank_batch"], p["config"]["data"]["batch_size"]) for p in points["per-GPU"]] == [
        (1, 16, 16)]
    assert [(p["nproc"], p["per_rank_batch"], p["config"]["data"]["batch_size"]) for p in points["per-GPU, half"]] == [
        (1, 8, 8)]
    assert points["per-GPU, half"][0]["config"]["train"]["ddp_split"] is True


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
