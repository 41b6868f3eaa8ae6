"""benchmarks.quality end to end on the CPU at toy size: judge, floor, conditional training with the trainer's
eval_every, every kind of sampling row, the report files rewritten as it goes; rows past the budget are skipped."""
from __future__ import annotations

import json

import pytest

from benchmarks import quality

pytestmark = pytest.mark.usefixtures("one_thread")

TOY = ["--preset", "tiny", "--steps", "2", "data.batch_size=16", "--judge-steps", "5", "--n-per-class", "1",
       "--guidance", "0,2", "--ddim-steps", "2,1", "--sample-batch", "20", "model.num_classes=10",
       "diffusion.timesteps=4", "train.device=cpu", "train.compile=False", "train.precision=fp32"]


def test_quality_report_end_to_end(digits_dataset, tmp_path, capsys):
    out = tmp_path / "out"
    assert quality.main(["--data", str(digits_dataset), "--out", str(out), "--work", str(tmp_path / "w"), *TOY]) == 0
    outputs = sorted(p.name for p in out.iterdir() if not p.name.startswith(".writer-"))  # tools.atomic's lock
    assert outputs == ["quality.json", "quality.md", "quality.png", "samples.png"]
    r = json.loads((out / "quality.json").read_text())
    assert r["complete"] and r["device"] == "CPU" and r["dataset"]["counts"] == {"train": 1438, "test": 359}
    assert 0 <= r["judge"]["test_accuracy"] <= 1 and r["judge"]["steps"] == 5
    assert r["floor"]["n"] == 10 and r["floor"]["n_full"] == 1438
    assert r["training"]["params"] > 0 and [s["step"] for s in r["training"]["stats"] if "fd_digits" in s] == [1, 2]
    kinds = [(x["weights"], x["sampler"], x["steps"], x["guidance"]) for x in r["rows"]]
    assert kinds == [("EMA", "ddim", 2, 0.0), ("EMA", "ddim", 2, 2.0), ("EMA", "ddim", 2, None),
                     ("EMA", "ddim", 1, 0.0), ("EMA", "ddim", 1, 2.0), ("raw", "ddim", 2, 0.0),
                     ("raw", "ddim", 2, 2.0), ("EMA", "ddpm", 4, 0.0), ("EMA", "ddpm", 4, 2.0)]
    for row in r["rows"]:
        assert row["status"] == "ok" and row["n"] == 10 and row["fd_digits"] >= 0
        assert sum(row["predicted_class_counts"]) == 10
        assert (row["cond_acc"] is None) == (row["guidance"] is None)
    assert r["best"]["cond_acc"] == max(x["cond_acc"] for x in r["rows"] if x["cond_acc"] is not None)
    md = (out / "quality.md").read_text()
    assert "## Judge" in md and "FD-digits floor" in md and "| EMA | DDPM 4 | 2 |" in md and "Best setting" in md
    assert "quality: best conditional accuracy" in capsys.readouterr().out


def test_rows_past_the_budget_are_skipped(digits_dataset, tmp_path):
    out = tmp_path / "out"
    args = ["--data", str(digits_dataset), "--out", str(out), "--work", str(tmp_path / "w"), *TOY, "--budget-s", "1"]
    assert quality.main(args) == 0
    rows = json.loads((out / "quality.json").read_text())["rows"]
    assert rows[0]["status"] == "ok"  # the first row runs: nothing to estimate its time from
    assert all(x["status"].startswith("skipped: estimated") for x in rows[1:]) and len(rows) == 9
    assert "skipped: estimated" in (out / "quality.md").read_text()


def test_unconditional_preset_is_refused(digits_dataset, tmp_path, capsys):
    args = ["--data", str(digits_dataset), "--out", str(tmp_path), "--work", str(tmp_path / "w"), "--preset", "tiny",
            "train.device=cpu"]
    assert quality.main(args) == 2
    assert "unconditional: add model.num_classes=10" in capsys.readouterr().err
