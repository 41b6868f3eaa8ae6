"""benchmarks.quality.digits end to end on the CPU at toy size: judge with its held-out floor, conditional training with
the trainer's eval_every, every kind of sampling row, the report files rewritten as it goes; rows past the budget are
skipped; every bad option is one line before anything is written; a signal stops the whole command."""
from __future__ import annotations

import json
import os
import signal

import pytest

from benchmarks.quality import digits

pytestmark = pytest.mark.usefixtures("one_thread")

TOY = ["--preset", "tiny", "--steps", "2", "data.batch_size=16", "--judge-steps", "5", "--n-per-class", "1",
       "--guidance", "0,2", "--ddim-steps", "2,1", "--sample-batch", "20", "model.num_classes=10",
       "diffusion.timesteps=4", "train.device=cpu", "train.compile=False", "train.precision=fp32",
       "train.telemetry=False"]


def test_quality_report_end_to_end(digits_dataset, tmp_path, capsys):
    out = tmp_path / "out"
    assert digits.main(["--data", str(digits_dataset), "--out", str(out), "--work", str(tmp_path / "w"), *TOY]) == 0
    outputs = sorted(p.name for p in out.iterdir() if not p.name.startswith(".writer-"))  # tools.atomic's lock
    assert outputs == ["quality.json", "quality.md", "quality.png", "samples.png"]
    r = json.loads((out / "quality.json").read_text())
    assert r["complete"] and r["device"] == "CPU" and r["dataset"]["counts"] == {"train": 1438, "test": 359}
    assert 0 <= r["judge"]["test_accuracy"] <= 1 and r["judge"]["steps"] == 5
    # The floor comes from images the judge held out: 10 of the 1438, class-balanced, not among its 1428.
    assert r["floor"]["n"] == 10 and r["floor"]["n_train_images"] == 1438 and r["judge"]["held_out"] == 10
    assert r["judge"]["train_images"] == 1428 and r["floor"]["fd_digits_seen_by_judge"] > 0
    assert r["training"]["params"] > 0 and [s["step"] for s in r["training"]["stats"] if "fd_digits" in s] == [1, 2]
    kinds = [(x["weights"], x["sampler"], x["steps"], x["guidance"]) for x in r["rows"]]
    # DDPM at the first w, then at the best other w (here the only other one), no row twice.
    assert kinds == [("EMA", "ddim", 2, 0.0), ("EMA", "ddim", 2, 2.0), ("EMA", "ddim", 2, None),
                     ("EMA", "ddim", 1, 0.0), ("EMA", "ddim", 1, 2.0), ("raw", "ddim", 2, 0.0),
                     ("raw", "ddim", 2, 2.0), ("EMA", "ddpm", 4, 0.0), ("EMA", "ddpm", 4, 2.0)]
    for row in r["rows"]:
        assert row["status"] == "ok" and row["n"] == 10 and row["fd_digits"] >= 0
        assert sum(row["predicted_class_counts"]) == 10
        assert (row["cond_acc"] is None) == (row["guidance"] is None)
    assert r["best"]["cond_acc"] == max(x["cond_acc"] for x in r["rows"] if x["cond_acc"] is not None)
    md = (out / "quality.md").read_text()
    assert "## Judge" in md and "the judge never saw" in md and "| EMA | DDPM 4 | 2 |" in md and "Best setting" in md
    printed = capsys.readouterr().out.splitlines()
    assert "digits: best conditional accuracy" in printed[-1]
    # the judge's training, the first long phase (100 s on a CPU), is announced before it starts
    assert printed[0].startswith("digits: [") and printed[0].endswith("] training the judge (5 steps)"), printed[:3]


def test_ddpm_rows_take_the_best_guidance_of_the_main_ddim_rows():
    args = digits.parse_args(["--guidance", "0,1,2,4", "--ddim-steps", "100,50"])
    plan = [(r["weights"], r["sampler"], r["steps"], r["guidance"]) for r in digits.rows_in_priority_order(args)]
    assert plan[-6:] == [("raw", "ddim", 100, 4.0), ("EMA", "ddpm", None, 0.0), ("EMA", "ddpm", None, digits.BEST),
                         ("EMA", "ddpm", None, 1.0), ("EMA", "ddpm", None, 2.0), ("EMA", "ddpm", None, 4.0)]
    assert len(plan) == 4 + 1 + 4 + 4 + 5

    def row(w, acc, fd, steps=100, status="ok"):
        return dict(weights="EMA", sampler="ddim", steps=steps, guidance=w, cond_acc=acc, fd_digits=fd, status=status)

    rows = [row(0.0, 0.95, 0.3), row(1.0, 0.99, 0.5), row(2.0, 0.99, 0.4), row(4.0, 1.0, 2.0, status="skipped"),
            row(4.0, 1.0, 0.1, steps=50), row(None, None, 0.6)]
    assert digits.best_guidance(rows, 100, {0.0}) == 2.0  # the tie on accuracy goes to the lower FD-digits
    assert digits.best_guidance(rows, 100, {0.0, 2.0}) == 1.0
    assert digits.best_guidance(rows, 100, {0.0, 1.0, 2.0}) is None


def test_rows_past_the_budget_are_skipped(digits_dataset, tmp_path):
    out = tmp_path / "out"
    args = ["--data", str(digits_dataset), "--out", str(out), "--work", str(tmp_path / "w"), *TOY, "--budget-s", "1"]
    assert digits.main(args) == 0
    rows = json.loads((out / "quality.json").read_text())["rows"]
    assert rows[0]["status"] == "ok"  # the first row runs: nothing to estimate its time from
    # No DDIM row but the first measured, so no best w: the DDPM rows are those of the listed weights, skipped too.
    assert all(x["status"].startswith("skipped: estimated") for x in rows[1:]) and len(rows) == 9
    assert "skipped: estimated" in (out / "quality.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--guidance", "abc"], "--guidance: invalid value 'abc': expected comma-separated numbers >= 0"),
    (["--ddim-steps", "x"], "--ddim-steps: invalid value 'x': expected comma-separated integers >= 1"),
    (["--judge-steps", "0"], "--judge-steps: invalid value '0': expected an integer >= 1"),
    (["--sample-batch", "0"], "--sample-batch: invalid value '0': expected an integer >= 1"),
    (["--budget-s", "-1"], "--budget-s: invalid value '-1': expected a number >= 0"),
    (["--ddim-steps", "100,2000"], "--ddim-steps 2000: at most diffusion.timesteps=1000"),
    (["--preset", "tiny"], "preset 'tiny' is unconditional: add model.num_classes=10"),
    (["diffusion.process=ve"], "benchmarks.quality.sde studies the VE process")])
def test_every_bad_option_is_one_line_before_anything_is_written(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        digits.main(["--data", str(tmp_path / "d"), "--out", str(tmp_path / "o"), "--work", str(tmp_path / "w"),
                      *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_a_signal_while_sampling_stops_the_command_and_keeps_the_run(digits_dataset, tmp_path, monkeypatch, capsys):
    """SIGINT (Ctrl-C) during the first sampling row: the whole command stops (no further row), exit 130, the report
    says so, the completed training run and the judge stay and the last line names them."""
    import ffcv_ddpm.evaluate

    real = ffcv_ddpm.evaluate.load_run
    calls = []

    def load_run(*a, **k):  # reads the trained run for the rows: the trainer never calls it
        calls.append(1)
        loaded = real(*a, **k)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGINT)  # recorded; the first row's safe point stops the command
        return loaded

    monkeypatch.setattr(ffcv_ddpm.evaluate, "load_run", load_run)
    out, work = tmp_path / "out", tmp_path / "w"
    assert digits.main(["--data", str(digits_dataset), "--out", str(out), "--work", str(work), *TOY]) == 130
    assert len(calls) == 2  # the EMA and the raw weights, loaded before the rows
    r = json.loads((out / "quality.json").read_text())
    assert not r["complete"] and r["stopped"] == "SIGINT during sampling" and r["rows"] == []
    assert "**STOPPED** (SIGINT during sampling)" in (out / "quality.md").read_text()
    (run_dir,) = [p for p in work.iterdir() if p.is_dir()]
    assert (run_dir / "stats.jsonl").is_file()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("digits: stopped by SIGINT during sampling. Kept: ")
    assert str(run_dir) in err[0] and "quality-judge.pt" in err[0] and str(out) in err[0]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the command's handlers are gone
