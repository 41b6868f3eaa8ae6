"""benchmarks.speed.trainer_vs_bench on CPU: the trainer's stats.jsonl beside a bench row of the same config."""

import json

import pytest

from benchmarks.speed import trainer_vs_bench
from benchmarks.common import BenchError


def test_trainer_and_bench_row_of_one_config_are_compared(small_dataset, tmp_path, capsys):
    args = ["--data", str(small_dataset), "--preset", "tiny", "--steps", "6", "--log-every", "2", "--iters", "3",
            "--warmup", "1", "data.batch_size=8", "data.num_workers=1", "--out", str(tmp_path)]
    rc = trainer_vs_bench.main(args)
    printed = capsys.readouterr().out
    assert rc in (0, 1), printed  # on a shared CPU the two may not agree; the figures must be the files' own
    r = json.loads((tmp_path / "trainer-vs-bench.json").read_text())
    stats = [json.loads(line) for line in (tmp_path / "trainer-vs-bench" / "stats.jsonl").read_text().splitlines()]
    assert [s["step"] for s in stats] == [2, 4, 6]
    assert r["trainer"] == {**trainer_vs_bench.trainer_figures(stats, 8), "run_files": str(tmp_path / "trainer-vs-bench")}
    assert r["trainer"]["steps_compared"] == 4 and r["bench"]["raw"]["batch_size"] == 8
    assert len(r["bench"]["raw"]["iter_ms"]) == 3
    # The same config both ways: the trainer's saved config is the row's, but for what only the trainer sets.
    saved = json.loads((tmp_path / "trainer-vs-bench" / "config.json").read_text())
    ignore = {"steps", "log_every", "ckpt_every", "sample_every", "progress", "out_dir", "desc", "device"}
    assert saved["model"] == r["config"]["model"] and saved["data"] == r["config"]["data"]
    assert {k: v for k, v in saved["train"].items() if k not in ignore} == {
        k: v for k, v in r["config"]["train"].items() if k not in ignore}
    c = r["comparison"]
    assert c["img_per_s_ratio"] == pytest.approx(r["trainer"]["img_per_s"] / r["bench"]["img_per_s"])
    assert c["agree"] == (rc == 0) == (abs(c["img_per_s_ratio"] - 1) <= 0.03)
    md = (tmp_path / "trainer-vs-bench.md").read_text()
    assert ("**agree**" if c["agree"] else "**DIFFER**") in md and "| trainer (stats.jsonl) |" in md
    assert not list((tmp_path / "trainer-vs-bench").glob("ckpt-*"))  # the checkpoint is not kept


def test_one_logged_interval_is_not_enough(tmp_path, capsys):
    assert trainer_vs_bench.main(["--data", str(tmp_path), "--steps", "50", "--log-every", "50"]) == 2
    assert "fewer than two log intervals" in capsys.readouterr().err
    with pytest.raises(BenchError, match="logged one interval only"):
        trainer_vs_bench.trainer_figures([{"step": 2, "img_per_s": 1.0, "iter_ms_median": 1.0, "data_wait_ms": 0,
                                           "wall_s": 1.0}], 8)
