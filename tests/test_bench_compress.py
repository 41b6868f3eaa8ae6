"""benchmarks.quality.compress end to end on the CPU at toy size: the dense digits model trained here, every kind of row
(references, int8, unstructured and structured pruning, from-scratch architectures with their dense reference, the
speed preset, fine-tuning), one row of every family first, findings computed from the numbers; a RUN_DIR studied with
rows that run and its model.* overrides applied to the network; bad options; a signal during the dense training
stopping the whole command (a real process)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.quality import compress
from conftest import REPO

pytestmark = pytest.mark.usefixtures("one_thread")

TOY = ["--preset", "tiny", "--steps", "2", "data.batch_size=8", "--judge-steps", "2", "--ratios", "0.5",
       "--ft-steps", "2", "--time-steps", "2", "--scratch-steps", "2", "--ddim-steps", "1", "--sample-batch", "8",
       "--reps", "2", "model.num_classes=10", "diffusion.timesteps=4", "train.device=cpu", "train.precision=fp32",
       "train.telemetry=False", "train.log_every=1"]


@pytest.fixture(scope="module")
def study(digits_dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compress")
    out, work = tmp / "out", tmp / "work"
    rc = compress.main(["--data", str(digits_dataset), "--out", str(out), "--work", str(work),
                        "--speed-preset", "tiny", *TOY])
    assert rc == 0
    return out, work, json.loads((out / "compress.json").read_text())


def rows_of(result: dict, **match) -> list[dict]:
    return [r for r in result["rows"] if all(r.get(k) == v for k, v in match.items())]


def test_every_row_runs_and_the_report_is_written(study):
    out, work, r = study
    assert sorted(p.name for p in out.iterdir()) == ["compress.json", "compress.md", "compress.png", "latency.png"]
    assert r["complete"] and r["device"] == "CPU" and r["dense"]["trained_here"] and r["model"] == "tiny"
    assert r["dense"]["config"]["train"]["compile"]  # trained as make quality trains (compiled where there is CUDA)
    assert r["judge"]["trained_here"] and 0 <= r["judge"]["test_accuracy"] <= 1
    assert r["judge"]["held_out"] == 16 and r["floor"]["n"] == 16  # the rows' 2 x 8 samples, held out of the judge
    assert [x["status"] for x in r["rows"]] == ["ok"] * len(r["rows"]), [x["status"] for x in r["rows"]]
    main = rows_of(r, model="tiny")
    kinds = {(x["family"], x["variant"], x["fine_tune_steps"]) for x in main}
    # refs, int8, unstructured, structured, architectures + their dense reference, fine-tuned structured and L1
    assert len(kinds) == len(main) == 4 + 3 + 4 + 1 + 4 + 1 + 2
    for x in main:
        assert x["fd_digits"] >= 0 and x["n_samples"] == 16 and 0 <= x["cond_acc"] <= 1
        assert x["latency_ms"] > 0 and x["img_per_s"] == pytest.approx(8 / (x["latency_ms"] / 1e3))
        assert len(x["latency_ms_calls"]) == 2 and x["size_mb"] > 0 and x["gflops_per_image"] > 0
    speed = rows_of(r, model="tiny (random weights)")
    assert len(speed) == 4 + 3 + 1 + 1 + 3 and all("fd_digits" not in x for x in speed)
    # The first round holds one row of every family (the architecture's with its reference), fine-tuning included.
    first = [(x["model"], x["family"], x["fine_tune_steps"] > 0) for x in r["rows"] if x["rank"] == 0]
    assert {(f, ft) for m, f, ft in first if m == "tiny"} == {
        ("reference", False), ("int8", False), ("unstructured", False), ("structured", False),
        ("architecture", False), ("structured", True)}
    assert [x["rank"] for x in r["rows"]] == sorted(x["rank"] for x in r["rows"])
    md = (out / "compress.md").read_text()
    assert "## tiny (random weights)" in md and "| unstructured | L1 global 50% | 2 steps |" in md
    assert "the quality bar" in md and "Unstructured sparsity: latency" in md and "x the baseline's" in md
    assert "one scale per (n, c, h) pixel row" in md and "dense convs (reference)" in md
    assert (work / "compress-judge.pt").is_file()


def test_rows_keep_what_they_claim(study):
    _, _, r = study
    dense = rows_of(r, model="tiny", variant="dense (baseline)")[0]
    assert dense["weight_sparsity"] == 0 and dense["train_step_ms"] > 0
    for pruned in rows_of(r, model="tiny", family="unstructured"):
        assert pruned["weight_sparsity"] == pytest.approx(0.5, abs=1e-3)  # fine-tuned ones too: the masks stayed
        assert pruned["params"] == dense["params"] and pruned["nonzero_params"] < dense["params"]
        assert pruned["gflops_per_image"] == dense["gflops_per_image"]  # zeros are still multiplied
        assert pruned["size_mb"] == pytest.approx(dense["size_mb"], rel=1e-3)
        assert ("train_step_ms" in pruned) == (pruned["fine_tune_steps"] > 0)
    smaller = rows_of(r, model="tiny", family="structured") + [
        x for x in rows_of(r, model="tiny", family="architecture") if x["variant"] != "dense convs (reference)"]
    for small in smaller:
        assert small["params"] < dense["params"] and small["gflops_per_image"] < dense["gflops_per_image"]
        assert small["size_mb"] < dense["size_mb"]
    for arch in rows_of(r, model="tiny", family="architecture"):  # trained here from scratch, sampled raw
        assert arch["train_step_ms"] > 0 and arch["weights"] == "raw" and arch["scratch_steps"] == 2
    reference = rows_of(r, model="tiny", variant="dense convs (reference)")[0]
    assert reference["params"] == dense["params"] and reference["gflops_per_image"] == dense["gflops_per_image"]
    for mode in ("weight-only", "dynamic"):  # int8 codes: a smaller checkpoint of the same network
        q = rows_of(r, model="tiny", family="int8", mode=mode)[0]
        assert q["size_mb"] < 0.7 * dense["size_mb"] and q["params"] == dense["params"]
    half = rows_of(r, model="tiny", variant="bf16 weights")[0]
    assert half["size_mb"] < 0.7 * dense["size_mb"]


def test_findings_follow_the_numbers():
    """The same rows with other latencies give other sentences: nothing is printed whatever the ratio."""
    from benchmarks.quality.compress_report import findings

    def rows(sparse_ms, channels_ms, acc):
        common = dict(status="ok", fine_tune_steps=0, params=100, size_mb=1.0)
        return [dict(common, family="reference", variant="dense (baseline)", latency_ms=100.0, gflops_per_image=1.0,
                     cond_acc=acc, fd_digits=0.3, weight_sparsity=0.0),
                dict(common, family="unstructured", variant="L1 global 90%", latency_ms=sparse_ms,
                     gflops_per_image=1.0, weight_sparsity=0.9, size_csr_mb=0.2),
                dict(common, family="structured", variant="channels 50%", latency_ms=channels_ms,
                     gflops_per_image=0.5, params=60)]

    same = " ".join(findings(rows(103.0, 60.0, 0.95)))
    assert "passes the quality bar" in same and "unchanged within 10% (1.03x)" in same
    assert "the zeros are still multiplied" in same and "latency fell with the FLOPs" in same
    other = " ".join(findings(rows(50.0, 98.0, 0.5)))
    assert "does NOT pass the quality bar" in other and "faster (0.50x)" in other
    assert "the zeros are still multiplied" not in other and "latency did not fall with the FLOPs" in other


def test_run_dir_rows_run_with_its_overrides_applied_to_the_network(study, tmp_path):
    """RUN_DIR with model.attn_impl=math: the network is built with it (not only the report's config), and the rows
    of the families asked for run."""
    from benchmarks.quality.study import StudyStop

    _, work, first = study
    run_dir = first["dense"]["run_dir"]
    out = tmp_path / "out"
    args = [run_dir, *TOY, "--judge", str(work / "compress-judge.pt"), "--out", str(out), "--work",
            str(tmp_path / "w"), "--speed-preset", "", "--families", "reference,structured", "model.attn_impl=math"]
    assert compress.main(args) == 0
    r = json.loads((out / "compress.json").read_text())
    assert r["complete"] and not r["dense"]["trained_here"] and r["dense"]["step"] == 2
    assert r["dense"]["config"]["model"]["attn_impl"] == "math" and r["judge"]["path"].endswith("compress-judge.pt")
    assert [(x["family"], x["variant"], x["fine_tune_steps"], x["status"]) for x in r["rows"]] == [
        ("reference", "dense (baseline)", 0, "ok"), ("structured", "channels 50%", 0, "ok"),
        ("structured", "channels 50%", 2, "ok"), ("reference", "fp32 (TF32 off)", 0, "ok"),
        ("reference", "bf16 weights", 0, "ok"), ("reference", "fp16 weights", 0, "ok")]
    assert "not studied (--families): int8, unstructured, architecture" in (out / "compress.md").read_text()
    assert not (tmp_path / "w").exists()  # nothing trained
    stop = StudyStop()
    try:
        _, model, _, _ = compress.dense_run(compress.parse_args(args), stop)
    finally:
        stop.restore()
    impls = {m.impl for m in model.modules() if type(m).__name__ == "SelfAttention"}
    assert impls == {"math"}


def test_run_dir_with_a_budget_and_a_shape_changing_override(study, tmp_path, capsys):
    _, work, first = study
    out = tmp_path / "out"
    args = [first["dense"]["run_dir"], "--judge", str(work / "compress-judge.pt"), "--out", str(out),
            "--work", str(tmp_path / "w"), "--speed-preset", "", "--budget-s", "0", *TOY]
    assert compress.main(args) == 0
    r = json.loads((out / "compress.json").read_text())
    assert r["rows"] and all(x["status"].startswith("skipped: estimated") for x in r["rows"])
    assert "skipped: estimated" in (out / "compress.md").read_text()
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").iterdir())  # nothing trained
    capsys.readouterr()
    assert compress.main([*args[:-len(TOY)], *TOY, "model.base_channels=16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit the model" in err[0] and "model.base_channels=16" in err[0]


def test_a_report_cut_by_its_budget_is_finished_by_a_second_call(study, tmp_path, capsys):
    """--continue-from: the first call's measured rows are kept as they were, the skipped ones run now; a report of
    another run or made with other row settings is refused in one line."""
    _, work, first = study
    run_dir, judge = first["dense"]["run_dir"], str(work / "compress-judge.pt")
    common = [run_dir, "--judge", judge, "--work", str(tmp_path / "w"), "--speed-preset", "", *TOY]
    a = tmp_path / "a"
    # A complete report, made to look cut: every row after the first as a budget leaves it (skipped, no figures).
    assert compress.main([*common, "--out", str(a), "--families", "reference,structured", "--budget-s", "1e9"]) == 0
    cut = json.loads((a / "compress.json").read_text())
    cut["rows"][1:] = [{**r, "status": "skipped: estimated 9 s would end past the 1 s budget"} for r in cut["rows"][1:]]
    for r in cut["rows"][1:]:
        for k in ("latency_ms", "size_mb"):
            r.pop(k, None)
    (a / "compress.json").write_text(json.dumps(cut))
    b = tmp_path / "b"
    args = [*common, "--out", str(b), "--families", "reference,structured", "--continue-from", str(a / "compress.json")]
    assert compress.main(args) == 0
    done = json.loads((b / "compress.json").read_text())
    assert [compress.row_key(r) for r in done["rows"]] == [compress.row_key(r) for r in cut["rows"]]
    assert done["rows"][0] == cut["rows"][0]  # kept as measured
    assert all(r["status"] == "ok" and r["latency_ms"] > 0 for r in done["rows"])
    assert done["continued_from"]["rows_kept"] == 1 and "previous" not in done["settings"]
    assert "1 rows measured by an earlier call" in (b / "compress.md").read_text()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # other row settings
        compress.main([*args, "--ddim-steps", "2"])
    assert e.value.code == 2 and "--ddim-steps 1 there, 2 here" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # no RUN_DIR: a new dense model could not be the same one
        compress.main(["--out", str(tmp_path / "c"), "--continue-from", str(a / "compress.json"), *TOY])
    assert e.value.code == 2 and "give that run folder as RUN_DIR" in capsys.readouterr().err


def test_bad_run_dir_is_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        compress.main([str(tmp_path), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no config.json" in err and err.count("\n") == 1


@pytest.mark.parametrize("args, message", [(["--ratios", "0.5,1"], "--ratios: invalid value '0.5,1'"),
                                           (["--speed-preset", "big"], "--speed-preset: invalid value 'big'"),
                                           (["--reps", "1"], "--reps: invalid value '1': expected an integer >= 2"),
                                           (["--budget-s", "-1"], "--budget-s: invalid value '-1'"),
                                           (["--judge", "missing.pt"], "--judge missing.pt: no such file"),
                                           (["--families", "int8,foo"], "--families: invalid value 'int8,foo'"),
                                           (["a", "b"], "unrecognized arguments: b")])
def test_bad_options_are_one_line(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        compress.main([*args, "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_sigterm_during_the_dense_training_stops_the_whole_command(digits_dataset, tmp_path):
    """The issue's case, as a user meets it: `kill PID` while compress trains its dense model. The trainer
    checkpoints and returns; compress must not study that model: it stops, says so, exits 143, and leaves no run
    folder behind."""
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, "-m", "benchmarks.quality.compress", "--data", str(digits_dataset), "--out", str(out),
           "--work", str(work), *TOY, "--steps", "100000", "train.ckpt_every=100000"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not list(work.glob("*/stats.jsonl")):  # training has started: a line of stats is written
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "compress did not start training in time"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    err = stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("compress: stopped by SIGTERM during training (compress-dense)"), err
    assert "removed its unfinished run folder" in err[0] and "Kept: nothing." in err[0]
    assert "SIGTERM received; checkpoint written" in stdout  # the trainer's part of it
    assert not any(p.is_dir() for p in work.iterdir()) and not out.exists()
