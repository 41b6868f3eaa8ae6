"""The benchmark harness on CPU: row definitions, metrics and rendering from a hand-made result, an end-to-end run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.common import BETON
from benchmarks.speed.rows import STACK, TABLES, merge, quick_rows, row_overrides, table_rows
from benchmarks.speed.report import add_metrics, render_markdown, terminal_table, write_reports
from ffcv_ddpm.config import load_config

REPO = Path(__file__).resolve().parent.parent


def test_rows_are_complete_configs_that_load():
    rows = table_rows("annotated-small", ("data.loader=torch-memory",))
    assert rows[0].baseline and sum(r.baseline for r in rows) == 1
    names = [r.name for r in rows]
    for row in rows:
        keys = [o.split("=")[0] for o in row.overrides]
        assert len(keys) == len(set(keys)), f"{row.name}: a key appears twice"
        # A batch rule is a number, "max", or an EARLIER row's name.
        assert isinstance(row.batch, int) or row.batch == "max" or names.index(row.batch) < names.index(row.name)
        load_config(row.preset, list(row.overrides))  # every row is a valid RunConfig
    cfg = {r.name: load_config(r.preset, list(r.overrides)) for r in rows}
    base, last = cfg[STACK[0][0]], cfg[STACK[-1][0]]
    assert (base.train.precision, base.train.compile, base.model.attn_impl, base.model.norm_impl) == (
        "fp32", False, "math", "torch")  # stock PyTorch, whatever the project's defaults are
    assert (last.train.precision, last.train.compile, last.model.attn_impl, last.data.loader) == (
        "bf16", True, "sdpa", "gpu")
    assert (last.model.norm_impl, last.train.channels_last) == ("fused", True)
    # The trainer's defaults (CUDA graphs, cuDNN's search since f3ad27b) are rows of their own, never inherited: a
    # row is what its name says whatever the defaults become.
    for name, c in cfg.items():
        graphs = "CUDA graphs" in name or "reduce-overhead" in name
        autotune = "max-autotune" in name
        assert c.train.compile_mode == ("reduce-overhead" if graphs else "max-autotune-no-cudagraphs" if autotune
                                        else "default"), name
        assert c.train.cudnn_benchmark == ("cuDNN" in name), name
    fp16 = cfg["fp16 + GradScaler (instead of bf16)"]
    assert fp16.data.loader == "ffcv" and fp16.model.norm_impl == "torch"  # a variant, not stacked
    # On the fused-AdamW row, so that GradScaler needs no host read of found_inf: the only difference is fp16.
    bf16 = cfg["+ fused AdamW"]
    assert fp16.train.fused_adam
    assert fp16.to_dict() == {**bf16.to_dict(), "train": {**bf16.to_dict()["train"], "precision": "fp16"}}
    assert names.index("fp16 + GradScaler (instead of bf16)") == names.index("+ fused AdamW") + 1


def test_loader_rows_change_only_the_loader(tmp_path):
    rows = TABLES["loaders-e2e"](("data.loader=torch-memory",))
    assert [r.preset for r in rows].count("ddpm-cifar10") == len(rows) // 2 and sum(r.baseline for r in rows) == 2
    data_overrides = (f"data.path={tmp_path / BETON}",)
    default = load_config("ddpm-cifar10", list(data_overrides))
    for row in rows[: len(rows) // 2]:
        cfg = load_config(row.preset, row_overrides(row, data_overrides, tmp_path))
        assert cfg.train == default.train and cfg.model == default.model  # the trainer's defaults: bf16, compile...
        assert cfg.data.batch_size == 128 and row.batch == 512  # the row's batch is applied by the runner
        if "JPEG" in row.name:
            assert cfg.data.path == str(tmp_path / "cifar10_train_jpg.beton")  # the row's .beton wins
        else:
            assert cfg.data.path == str(tmp_path / BETON)
        if cfg.data.loader == "torch-files":
            assert cfg.data.png_dir == str(tmp_path / "png" / "train")
    assert {load_config(r.preset, list(r.overrides)).data.loader for r in rows} == {"ffcv", "torch-memory",
                                                                                    "torch-files", "gpu"}


def _spawned(kind, spec, timeout):
    """runner.spawn without the processes: the environment, and rows of which the second fails."""
    from ffcv_ddpm.env import environment

    if kind == "env":
        return {"status": "ok", "result": {**environment(), "commit": "abc1234", "commit_source":
                                           "declared (FFCV_DDPM_COMMIT), not verified", "dirty": None}}
    if spec["overrides"][-1] == "model.dropout=0.0" and "model.base_channels=16" in spec["overrides"]:
        return {"status": "failed", "error": "out of memory"}
    return {"status": "ok", "result": _row_raw(spec, first_step_s=1.0)}


def _row_raw(spec, first_step_s: float, **extra) -> dict:
    """What a row's process returns (jobs.run_row), for `spec`: two 10-ms iterations, 1 ms of data wait in each."""
    return {"batch_size": spec["batch_size"], "precision": "fp32", "iter_ms": [10.0] * 2, "wait_ms": [1.0] * 2,
            "first_step_s": first_step_s, "peak_mem_bytes": None, "sdpa_backend": "math", "config": {}, **extra}


def _gpu_spawned(kind, spec, timeout, first_step_s: float = 2.0):
    """runner.spawn on a pretended GPU, without the processes: the probe finds batch 8, the environment as in
    _spawned, and each row a compiled one whose first step took `first_step_s`."""
    if kind == "probe":
        return {"status": "ok", "result": {"batch_size": 8}}
    if kind == "env":
        return _spawned(kind, spec, timeout)
    return {"status": "ok", "result": _row_raw(spec, first_step_s=first_step_s, compiled=True)}


def _table_args(data, out, **changes):
    """run_table's arguments as bench parses them by default, over `data`, writing to `out`."""
    import argparse

    return argparse.Namespace(**{**dict(data=data, iters=None, warmup=None, baseline_loader="torch-memory",
                                        max_batch=8, mem_fraction=0.9, measure_peak=False, sampling=False,
                                        sample_n=None, ddim_steps=2, num_synthetic=None, row_timeout=10, out=out,
                                        rows=None), **changes})


def test_runner_counts_flops_per_row_and_fails_when_any_row_fails(small_dataset, tmp_path, monkeypatch, capsys):
    """Each row's FLOPs come from its own model config; one failed row makes the exit status 1; the commit of a
    copied tree (FFCV_DDPM_COMMIT) is printed as declared, not verified."""
    from benchmarks.speed import runner
    from benchmarks.speed.rows import Row

    monkeypatch.setattr(runner, "spawn", _spawned)
    monkeypatch.setattr(runner, "cuda_available", lambda: False)
    rows = [Row("tiny", "tiny", ("data.loader=torch-memory",), 4, baseline=True),
            Row("wider", "tiny", ("data.loader=torch-memory", "model.base_channels=16"), 4)]
    args = _table_args(small_dataset, tmp_path)
    rc, path = runner.run_table(rows, "t", args, ["model.dropout=0.0"], [], note="a note")
    result = json.loads(path.read_text())
    assert rc == 1 and [r["status"] for r in result["rows"]] == ["ok", "failed"]
    small, wide = (r["flops"]["train"]["fwd_bwd"] for r in result["rows"])
    assert wide > 2 * small  # the row's own model, not the preset's
    assert result["rows"][0]["metrics"]["flops_per_img"] == small
    md = path.with_suffix(".md").read_text()
    assert "- a note" in md and "abc1234 (declared, not verified)" in md
    assert "github.com/kimbochen/ddpm" in md  # the published table's source, beside its figures


def test_a_second_table_into_one_output_folder_is_refused_naming_the_first(small_dataset, tmp_path, monkeypatch):
    """Two benchmarks writing one folder at once would time each other's load, the last to finish replacing the
    other's files: the second stops before it times anything; the first's lock, left by its kill -9, is taken
    over."""
    from conftest import hold_lock

    from benchmarks.common import BenchError
    from benchmarks.speed import runner
    from benchmarks.speed.rows import Row

    monkeypatch.setattr(runner, "spawn", _spawned)
    monkeypatch.setattr(runner, "cuda_available", lambda: False)
    rows, args = [Row("tiny", "tiny", ("data.loader=torch-memory",), 4, baseline=True)], _table_args(small_dataset,
                                                                                                      tmp_path)
    holder = hold_lock(tmp_path)
    try:
        with pytest.raises(BenchError, match=f"{tmp_path} is in use by process {holder.pid} "):
            runner.run_table(rows, "t", args, [], [])
        assert [p.name for p in tmp_path.iterdir()] == [".lock"]  # nothing measured, nothing written
    finally:
        holder.kill()
        holder.wait()
    rc, path = runner.run_table(rows, "t", args, [], [])
    assert rc == 0 and sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.md", "t.png"]


def test_warm_compiles_the_compiled_rows_n_at_a_time_before_timing(small_dataset, tmp_path, monkeypatch):
    """--warm 2 on a (pretended) GPU: the probe runs once, alone, before any warm-up job; the compiled rows (not the
    eager one, not the autotuning one, whose choices must be timed on an idle GPU) compile two at a time in one-step
    jobs, each held to half the GPU's memory; then every row is timed in its turn, as without --warm."""
    import threading
    import time

    from benchmarks.speed import runner
    from benchmarks.speed.rows import Row

    calls, running, peak, lock = [], [0], [0], threading.Lock()

    def spawned(kind, spec, timeout, log=None):
        with lock:
            calls.append((kind, spec.get("overrides", [None])[-1], spec.get("iters"), spec.get("mem_fraction"),
                          log is not None))
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)  # long enough for a second job to start beside this one
        with lock:
            running[0] -= 1
        return _gpu_spawned(kind, spec, timeout, first_step_s=30.0 if log else 2.0)

    monkeypatch.setattr(runner, "spawn", spawned)
    monkeypatch.setattr(runner, "cuda_available", lambda: True)
    base = ("data.loader=torch-memory",)
    rows = [Row("eager", "tiny", (*base, "train.compile=False"), 4, baseline=True),
            Row("compiled", "tiny", (*base, "train.compile=True"), "max"),
            Row("autotune", "tiny", (*base, "train.compile=True", "train.compile_mode=max-autotune"), "compiled"),
            Row("wider", "tiny", (*base, "train.compile=True", "model.base_channels=16"), "compiled")]
    args = _table_args(small_dataset, tmp_path, warm=2)
    rc, path = runner.run_table(rows, "t", args, [], [])
    kinds = [(k, last, iters, frac, logged) for k, last, iters, frac, logged in calls if k != "env"]
    assert kinds[0] == ("probe", "train.compile=True", None, 0.9, False)  # alone, before any warm-up job
    warm = kinds[1:3]
    assert sorted(w[1] for w in warm) == ["model.base_channels=16", "train.compile=True"]
    assert all(w[0] == "row" and w[2] == 1 and w[3] == 0.5 and w[4] for w in warm) and peak[0] == 2
    assert [(k, iters) for k, _, iters, _, _ in kinds[3:]] == [("row", 50)] * 4  # then every row, timed, in turn
    result = json.loads(path.read_text())
    assert rc == 0 and result["warm"] == {"jobs": 2, "rows": 2}
    assert [(r["warm"] or {}).get("first_step_s") for r in result["rows"]] == [None, 30.0, None, 30.0]
    assert "compiled in the --warm warm-up beside other rows (first step 30 s)" in path.with_suffix(".md").read_text()


def test_merge_keeps_one_entry_per_key_last_wins():
    assert merge(("a=1", "b=2"), ("a=3",)) == ("a=3", "b=2")


def test_quick_rows_stay_small():
    rows = quick_rows(("data.loader=torch-memory",))
    assert {r.preset for r in rows} == {"tiny"} and len(rows) == 3
    assert all(isinstance(r.batch, int) and r.batch <= 32 for r in rows)


def _fake_result(device_name):
    """A result as bench writes it, with round numbers: 10 iterations of 100 ms at batch 1000 -> 10,000 img/s."""
    flops = {"train": {"fwd": 2e9, "fwd_bwd": 6e9, "fwd_by_category": {"conv": 1e9, "linear": 0.0, "attention": 1e9},
                       "params": 1},
             "published": {"mult_adds_fwd": 0.5e9, "fwd_bwd": 3e9}}

    def row(name, ms, baseline=False, precision="bf16", status="ok"):
        raw = {"batch_size": 1000, "precision": precision, "tf32_matmul": False, "tf32_cudnn": False,
               "iter_ms": [ms] * 10, "wait_ms": [ms / 10] * 10, "first_step_s": 1.0, "peak_mem_bytes": 2**30,
               "sdpa_backend": "SDPA flash"}
        return {"name": name, "group": "annotated-small", "preset": "annotated-small", "baseline": baseline,
                "overrides": ["train.precision=" + precision], "status": status,
                "error": None if status == "ok" else "out of memory", "raw": raw if status == "ok" else None}

    return {
        "table": "small", "command": ["python", "-m", "benchmarks.speed.bench"], "device_name": device_name,
        "card": "x",
        "environment": {"commit": "abc", "torch": "2.x", "cuda": "12", "date_utc": "2026-01-01"},
        "dataset": {"path": "d.beton", "num_images": 50000, "source": "synthetic", "synthetic": True},
        "settings": {"iters": 10, "warmup": 1}, "flops": {"annotated-small": flops}, "measured_peaks": None,
        "rows": [row("base", 200.0, baseline=True, precision="fp32"), row("fast", 100.0), row("oom", 1, status="x")],
        "sampling": [{"name": "ddpm-cifar10", "sampler": "ddim", "precision": "bf16", "steps": 50, "n": 8,
                      "seconds": 2.0, "img_per_s": 4.0, "tflops": 1.0}],
    }


def test_metrics_from_raw_figures():
    result = add_metrics(_fake_result("NVIDIA H100 80GB HBM3"))
    base, fast, oom = (r["metrics"] for r in result["rows"])
    assert fast["img_per_s"] == pytest.approx(10_000)
    assert fast["data_wait_share"] == pytest.approx(0.1)
    assert fast["tflops"] == pytest.approx(60.0)  # 6 GFLOP/img x 10,000 img/s
    assert fast["mfu"] == pytest.approx(60.0 / 989.4)
    assert fast["published_mfu"] == pytest.approx(30.0 / 989.4)
    assert base["mfu"] == pytest.approx(30.0 / 67.0)  # true fp32 (no TF32) against the FP32 peak
    assert fast["speedup"] == pytest.approx(2.0) and base["speedup"] == pytest.approx(1.0)
    assert oom is None


def test_report_renders_markdown_and_png(tmp_path):
    result = _fake_result(None)  # a CPU run: MFU must read n/a, not 0 or a made-up number
    path = tmp_path / "small.json"
    path.write_text(json.dumps(result))
    md, png = write_reports(json.loads(path.read_text()), path)
    text = md.read_text()
    assert "| fast | 1000 |" in text and "10,000" in text and "n/a (no CUDA)" in text
    assert "FAILED: out of memory" in text and "SYNTHETIC" in text
    assert "### The published table" in text and "2.10" in text  # the published rows, with the recount beside them
    assert png.stat().st_size > 10_000
    on_gpu = render_markdown(add_metrics(_fake_result("NVIDIA H200")))
    assert "6.1%" in on_gpu  # 60 TFLOP/s of 989.4


def test_a_cuda_graph_rows_peak_memory_includes_the_recording():
    # Under reduce-overhead the step's tensors live in the graphs' pool, allocated while recording (in the warm-up):
    # the timed steps' own peak (0.8 GiB on an H100 for a ~20 GiB step) is not the step's memory.
    result = _fake_result("NVIDIA H100 80GB HBM3")
    for row, mode in zip(result["rows"], ("default", "reduce-overhead")):
        row["raw"].update(compiled=True, peak_mem_bytes=int(0.8 * 2**30), peak_mem_bytes_incl_warmup=20 * 2**30)
        row["config"] = {"train": {"compile_mode": mode}}
    text = render_markdown(add_metrics(result))
    base_line = next(line for line in text.splitlines() if line.startswith("| base |"))
    fast_line = next(line for line in text.splitlines() if line.startswith("| fast |"))
    assert "| 0.8 |" in base_line and "includes the warm-up" not in base_line
    assert "| 20.0 |" in fast_line and "peak mem includes the warm-up" in fast_line


def test_terminal_table_has_every_row_aligned():
    lines = terminal_table(add_metrics(_fake_result(None))).strip().splitlines()
    assert lines[0] == "annotated-small" and lines[1].split()[:2] == ["row", "batch"]
    assert "10,000" in lines[3] and "n/a (no CUDA)" in lines[3] and lines[4].endswith("FAILED: out of memory")
    assert len({line.index("img/s") if "img/s" in line else None for line in lines[1:2]}) == 1
    assert lines[2].index("5,000") + len("5,000") == lines[3].index("10,000") + len("10,000")  # right-aligned


def test_local_cpu_results_are_ignored_by_git_and_gpu_results_are_not():
    """`make bench` on a CPU writes benchmarks/results/cpu/: it must not dirty the checkout (issue 17)."""
    def ignored(path):
        return subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0

    if subprocess.run(["git", "rev-parse"], cwd=REPO, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    assert ignored("benchmarks/results/cpu/quick.json") and ignored("benchmarks/results/cpu/profile-tiny/trace.json.gz")
    assert not ignored("benchmarks/results/h200/ddpm.json") and not ignored("benchmarks/results/h100/ddpm.json")


def test_report_cli_rejects_a_foreign_file(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.speed.report", str(bad)], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 2 and "not a benchmarks.speed.bench result" in proc.stderr


def test_headline_is_four_rows_from_the_stack_and_the_trainer_defaults():
    """`make bench` on a GPU: the published baseline, compile + SDPA + bf16, + FFCV, and the trainer's defaults with
    the GPU-resident loader; the compile and FFCV rows share one model graph (so one compilation, via the cache)."""
    from benchmarks.speed.rows import BEST, headline_rows

    rows = headline_rows("ddpm-cifar10", ("data.loader=torch-memory",))
    names = [r.name for r in rows]
    assert names == [STACK[0][0], "+ torch.compile + SDPA + bf16 autocast", "+ FFCV loading", BEST]
    cfg = [load_config(r.preset, list(r.overrides)) for r in rows]
    full = {r.name: load_config(r.preset, list(r.overrides))
            for r in table_rows("ddpm-cifar10", ("data.loader=torch-memory",))}
    assert cfg[0] == full[STACK[0][0]] and rows[0].baseline and rows[0].batch == 128
    assert cfg[1] == full["+ bf16 autocast"]  # the full table's three steps in one row
    assert cfg[2] == full["+ FFCV loading"]
    assert cfg[1].model == cfg[2].model and cfg[1].train == cfg[2].train  # the same compiled graph
    default = load_config("ddpm-cifar10")
    assert (cfg[3].model, cfg[3].train) == (default.model, default.train) and cfg[3].data.loader == "gpu"
    assert [r.batch for r in rows[1:]] == [1024] * 3
    assert TABLES["headline"](("data.loader=torch-memory",)) == rows and TABLES["full"] == TABLES["both"]


def test_the_default_table_is_the_headline_on_a_gpu_and_quick_without(monkeypatch, capsys):
    from benchmarks.speed import bench

    monkeypatch.setattr(bench, "cuda_available", lambda: True)
    assert bench.main(["--list"]) == 0
    assert capsys.readouterr().out.count("[ddpm-cifar10]") == 4
    monkeypatch.setattr(bench, "cuda_available", lambda: False)
    assert bench.main(["--list"]) == 0
    assert "[tiny]" in capsys.readouterr().out


def test_sampling_rows_render_with_their_speedup_over_eager_and_failures():
    result = _fake_result("NVIDIA H100 80GB HBM3")
    eager = {**result["sampling"][0], "mode": "eager", "first_call_s": 2.0, "status": "ok"}
    graphs = {**eager, "mode": "reduce-overhead", "seconds": 0.5, "img_per_s": 16.0, "tflops": 4.0,
              "first_call_s": 40.0, "vs_eager_max_abs": 1, "vs_eager_mean_abs": 0.004}
    result["sampling"] = [eager, graphs, {"name": "annotated-small", "mode": "default", "status": "failed",
                                          "error": "out of memory"}]
    md = render_markdown(add_metrics(result))
    assert ("| ddpm-cifar10 | ddim | 50 | reduce-overhead | bf16 | 8 | 40.0 | 0.500 | 16 | 4 | 4.00x | "
            "max 1, mean 0.004 |") in md
    assert "FAILED: out of memory" in md
    text = terminal_table(result)
    assert "4.00x" in text and "FAILED: out of memory" in text


def test_a_row_names_the_command_overrides_it_ran_with(small_dataset, tmp_path, monkeypatch):
    """`--rows best train.cudnn_benchmark=True`: the switch is in the row's name, so a merged table cannot take it
    for the row without it; the compile-cache state a row's process saw is in its notes."""
    from benchmarks.speed import runner
    from benchmarks.speed.rows import Row

    def spawned(kind, spec, timeout):
        got = _spawned(kind, spec, timeout)
        if kind == "row":
            got["result"].update(compiled=True, compile_cache_before={"files": 0, "bytes": 0})
        return got

    monkeypatch.setattr(runner, "spawn", spawned)
    monkeypatch.setattr(runner, "cuda_available", lambda: False)
    args = _table_args(small_dataset, tmp_path)
    rc, path = runner.run_table([Row("best", "tiny", ("data.loader=torch-memory",), 4, baseline=True)], "t", args,
                                ["train.cudnn_benchmark=True", "data.batch_size=4"], [])
    result = json.loads(path.read_text())
    assert rc == 0 and result["rows"][0]["name"] == "best [train.cudnn_benchmark=True]"  # the batch is a batch rule
    assert "compile cache cold (empty)" in path.with_suffix(".md").read_text()


@pytest.mark.cpu_only
def test_sampling_table_end_to_end(tmp_path):
    """`--table sampling` on a CPU: the eager and the compiled sampler of one model, each in a process of its own;
    the compiled rows carry their speedup over eager and how far their DDIM images are from eager's (same seed).
    The model is tests/test_sampling.py's (same config, batch and seed), so one of the two compiles from the cache."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "benchmarks.speed.bench", "--table", "sampling", "--sample-modes", "eager,default",
           "--sample-n", "2", "--ddim-steps", "5", "--out", str(out), "--data", str(tmp_path / "data"),
           "model.num_classes=3", "diffusion.timesteps=20", "train.sample_every=0"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "sampling.json").read_text())
    assert result["rows"] == [] and result["dataset"] is None and not (tmp_path / "data").exists()  # no data read
    got = {(s["mode"], s["sampler"]): s for s in result["sampling"]}
    assert set(got) == {(m, s) for m in ("eager", "default") for s in ("ddim", "ddpm")}
    assert [got[("default", s)]["steps"] for s in ("ddim", "ddpm")] == [5, 20]  # DDPM: all T steps
    assert got[("default", "ddim")]["vs_eager_max_abs"] <= 1 and "vs_eager_max_abs" not in got[("eager", "ddim")]
    for s in got.values():
        assert s["name"] == "tiny" and s["n"] == 2 and s["precision"] == "fp32" and s["img_per_s"] > 0
        assert s["tflops"] == pytest.approx(s["fwd_flops_per_img"] * 2 * s["steps"] / s["seconds"] / 1e12)
    md = (out / "sampling.md").read_text()
    assert "## Sampling throughput" in md and "| tiny | ddim | 5 | default | fp32 | 2 |" in md
    assert "1.00x" in md and (out / "sampling.png").is_file()


def test_a_row_whose_batch_comes_from_an_unselected_row_gets_the_full_tables_batch(small_dataset, tmp_path,
                                                                                   monkeypatch):
    """--rows with part of a table (a table split over calls or GPUs): a row whose batch is an earlier row's, when
    that row is not selected, runs at the batch that row's own rule gives (here through two unselected rows to a
    probe), as in the full table; without the whole table to look in, it fails as before, saying why."""
    from benchmarks.speed import runner
    from benchmarks.speed.rows import Row

    ran = []

    def spawned(kind, spec, timeout, log=None):
        if kind in ("probe", "row"):
            ran.append((kind, spec["batch_size"] if kind == "row" else None))
        return _gpu_spawned(kind, spec, timeout)

    monkeypatch.setattr(runner, "spawn", spawned)
    monkeypatch.setattr(runner, "cuda_available", lambda: True)
    base = ("data.loader=torch-memory",)
    table = [Row("eager", "tiny", (*base, "train.compile=False"), 4, baseline=True),
             Row("compiled", "tiny", (*base, "train.compile=True"), "max"),
             Row("channels_last", "tiny", (*base, "train.compile=True", "train.channels_last=True"), "compiled"),
             Row("wider", "tiny", (*base, "train.compile=True", "model.base_channels=16"), "channels_last")]
    args = _table_args(small_dataset, tmp_path, rows="wider")
    rc, path = runner.run_table(table[3:], "t", args, [], [], table_rows=table)
    (row,) = json.loads(path.read_text())["rows"]
    assert rc == 0 and ran == [("probe", None), ("row", 8)]
    assert row["raw"]["batch_note"].startswith("as row 'channels_last' (not selected here): as row 'compiled'")
    ran.clear()
    rc, path = runner.run_table(table[3:], "t", args, [], [])
    (row,) = json.loads(path.read_text())["rows"]
    assert rc == 1 and ran == [] and "which did not run (failed or not selected)" in row["error"]


class _Started(Exception):
    """Raised by a stand-in for runner.spawn: the command got as far as starting a process."""


def test_loaders_e2e_stops_before_any_row_runs_when_a_rows_data_is_missing(small_dataset, small_dataset_arrays,
                                                                           tmp_path, monkeypatch, capsys):
    """Row 4 of --table loaders-e2e (the DataLoader over PNG files) used to fail in its turn, after rows 1-3 had
    compiled and timed for minutes, when the data folder had no PNG export (`make dataset-png`). Now the command
    stops first, naming every row that lacks a file, the file, and how to make it or leave the row out; with the
    folder there, the check passes and the run starts."""
    import shutil

    from conftest import write_png_folder

    from benchmarks.speed import bench, runner

    started = []

    def spawned(kind, spec, timeout, log=None):
        started.append(kind)
        raise _Started(kind)

    monkeypatch.setattr(runner, "spawn", spawned)
    monkeypatch.setattr(runner, "flops_of", lambda row, overrides: started.append("flops"))
    data, out = tmp_path / "data", tmp_path / "out"
    shutil.copytree(small_dataset, data)  # what `make dataset` writes: the .beton files, no png/
    argv = ["--data", str(data), "--table", "loaders-e2e", "--out", str(out)]

    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    png = data / "png" / "train"
    assert "row 4 [ddpm-cifar10] PyTorch DataLoader over PNG files" in err, err
    assert "row 9 [annotated-small] PyTorch DataLoader over PNG files" in err, err
    assert f"PNG folder {png}" in err and f"make dataset-png DATA={data}" in err and f"--export-png {png.parent}" in err
    assert "--rows 1,2,3,5,6,7,8,10" in err  # the rows that can run, as --rows takes them
    assert err.count("row ") == 2 and "JPEG" not in err  # the rows with their files are not named
    assert started == [] and not out.exists()  # no process, no FLOP count, nothing written

    # A JPEG .beton that is not there: its rows too, with the fix for a .beton.
    (data / "cifar10_train_jpg.beton").unlink()
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert "row 2 [ddpm-cifar10] FFCV JPEG .beton" in err and "row 7 [annotated-small] FFCV JPEG .beton" in err
    assert f"{data / 'cifar10_train_jpg.beton'} not found; create it with `make dataset`" in err
    assert "--rows 1,3,5,6,8,10" in err and started == []
    shutil.copy(small_dataset / "cifar10_train_jpg.beton", data)

    # The PNG folder without its labels CSV is as unusable as no folder.
    write_png_folder(data / "png", small_dataset_arrays, with_test=False)
    (data / "png" / "trainLabels.csv").rename(tmp_path / "trainLabels.csv")
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert f"labels {data / 'png' / 'trainLabels.csv'} of PNG folder {png} not found" in err and started == []

    (tmp_path / "trainLabels.csv").rename(data / "png" / "trainLabels.csv")
    with pytest.raises(_Started):  # every row's files are there: the run starts (its first process: the environment)
        bench.main(argv)
    assert started == ["env"]


def test_a_dataset_bench_is_about_to_build_counts_as_there(tmp_path):
    """--data naming a folder with no .beton: bench builds a synthetic dataset there (raw and JPEG .beton files), so
    only the rows reading what that build does not write (the PNG folder) are named."""
    from benchmarks.common import BenchError
    from benchmarks.speed import runner

    rows = TABLES["loaders-e2e"](("data.loader=torch-memory",))
    with pytest.raises(BenchError) as e:
        runner.check_row_data(rows, tmp_path / "empty", [], rows)
    named = [line.strip() for line in str(e.value).splitlines() if line.strip().startswith("row ")]
    assert [n.split(" [")[0] for n in named] == ["row 4", "row 9"] and not (tmp_path / "empty").exists()
    runner.check_row_data([r for r in rows if "PNG" not in r.name], tmp_path / "empty", [], rows)  # the rest pass
