"""benchmarks.compress end to end on the CPU at toy size: the dense digits model trained here, every kind of row
(references, int8, unstructured and structured pruning, from-scratch architectures, the speed preset, fine-tuning),
the report files; a RUN_DIR with a saved judge, and rows past the budget skipped."""
from __future__ import annotations

import json

import pytest

from benchmarks import compress

pytestmark = pytest.mark.usefixtures("one_thread")

TOY = ["--preset", "tiny", "--steps", "2", "data.batch_size=8", "--judge-steps", "2", "--ratios", "0.5",
       "--ft-steps", "2", "--time-steps", "2", "--ddim-steps", "1", "--sample-batch", "8", "--reps", "2",
       "model.num_classes=10", "diffusion.timesteps=4", "train.device=cpu", "train.precision=fp32",
       "train.telemetry=False"]


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
    assert r["judge"]["trained_here"] and 0 <= r["judge"]["test_accuracy"] <= 1 and r["floor"]["n"] == 16
    assert [x["status"] for x in r["rows"]] == ["ok"] * len(r["rows"]), [x["status"] for x in r["rows"]]
    main = rows_of(r, model="tiny")
    kinds = {(x["family"], x["variant"], x["fine_tune_steps"]) for x in main}
    assert len(kinds) == len(main) == 4 + 3 + 4 + 1 + 3 + 1 + 4  # refs, int8, unstructured, structured, arch, +ft
    for x in main:
        assert x["fd_digits"] >= 0 and x["n_samples"] == 16 and 0 <= x["cond_acc"] <= 1
        assert x["latency_ms"] > 0 and x["img_per_s"] == pytest.approx(8 / (x["latency_ms"] / 1e3))
        assert len(x["latency_ms_calls"]) == 2 and x["size_mb"] > 0 and x["gflops_per_image"] > 0
    speed = rows_of(r, model="tiny (random weights)")
    assert len(speed) == 4 + 3 + 1 + 1 + 3 and all("fd_digits" not in x for x in speed)
    md = (out / "compress.md").read_text()
    assert "## tiny (random weights)" in md and "| unstructured | L1 global 50% | 2 steps |" in md
    assert "Unstructured sparsity" in md and "int8 weight-only:" in md
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
    for small in rows_of(r, model="tiny", family="structured") + rows_of(r, model="tiny", family="architecture"):
        assert small["params"] < dense["params"] and small["gflops_per_image"] < dense["gflops_per_image"]
        assert small["size_mb"] < dense["size_mb"]
    assert all(x["train_step_ms"] > 0 for x in rows_of(r, model="tiny", family="architecture"))
    for mode in ("weight-only", "dynamic"):  # int8 codes: a smaller checkpoint of the same network
        q = rows_of(r, model="tiny", variant=f"int8 {mode}")[0]
        assert q["size_mb"] < 0.7 * dense["size_mb"] and q["params"] == dense["params"]
    half = rows_of(r, model="tiny", variant="bf16 weights")[0]
    assert half["size_mb"] < 0.7 * dense["size_mb"]


def test_run_dir_with_a_saved_judge_and_a_budget(study, tmp_path, capsys):
    _, work, first = study
    out = tmp_path / "out"
    args = [first["dense"]["run_dir"], "--judge", str(work / "compress-judge.pt"), "--out", str(out),
            "--work", str(tmp_path / "w"), "--speed-preset", "", "--budget-s", "0", *TOY]
    assert compress.main(args) == 0
    r = json.loads((out / "compress.json").read_text())
    assert r["complete"] and not r["dense"]["trained_here"] and r["dense"]["step"] == 2
    assert not r["judge"]["trained_here"] and r["judge"]["path"].endswith("compress-judge.pt")
    assert r["rows"] and all(x["status"].startswith("skipped: estimated") for x in r["rows"])
    assert "skipped: estimated" in (out / "compress.md").read_text()
    assert not (tmp_path / "w").exists() or not any((tmp_path / "w").iterdir())  # nothing trained


def test_bad_run_dir_is_one_error_line(tmp_path, capsys):
    assert compress.main([str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "compress: error:" in err and "no config.json" in err


@pytest.mark.parametrize("args, message", [(["--ratios", "0.5,1"], "--ratios: invalid value '0.5,1'"),
                                           (["--speed-preset", "big"], "--speed-preset: invalid value 'big'"),
                                           (["a", "b"], "unrecognized arguments: b")])
def test_bad_options_are_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        compress.main(args)
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1
