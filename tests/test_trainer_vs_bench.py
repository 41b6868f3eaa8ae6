"""benchmarks.speed.trainer_vs_bench: on CPU, the trainer's stats.jsonl beside a bench row of the same config; its verdict
on fabricated intervals and rows whose answer is known."""

import json

import pytest

from benchmarks.speed import trainer_vs_bench
from benchmarks.common import BenchError


def test_trainer_and_bench_row_of_one_config_are_compared(small_dataset, tmp_path, capsys):
    # Both processes read the dataset into memory: FFCV's pipeline compiles in each on a CPU, and the loader is not
    # what this test checks (the comparison of one config both ways is; tests/test_data.py tests FFCV's loader). Both
    # train in fp32: the preset's bf16 has no CPU kernels of its own here (a step ~3x slower), nor is it checked.
    args = ["--data", str(small_dataset), "--preset", "tiny", "--steps", "6", "--log-every", "2", "--iters", "3",
            "--warmup", "1", "data.batch_size=8", "data.num_workers=1", "data.loader=torch-memory",
            "train.precision=fp32", "--out", str(tmp_path)]
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
    assert "| trainer over wall time (not compared) |" in md
    assert not list((tmp_path / "trainer-vs-bench").glob("ckpt-*"))  # the checkpoint is not kept


def test_one_logged_interval_is_not_enough(tmp_path, capsys):
    assert trainer_vs_bench.main(["--data", str(tmp_path), "--steps", "50", "--log-every", "50"]) == 2
    assert "fewer than two log intervals" in capsys.readouterr().err
    with pytest.raises(BenchError, match="logged one interval only"):
        trainer_vs_bench.trainer_figures([{"step": 2, "img_per_s": 1.0, "iter_ms_median": 1.0, "data_wait_ms": 0,
                                           "wall_s": 1.0}], 8)


def trainer_lines(iter_ms: list[list[float]], batch: int) -> list[dict]:
    """stats.jsonl lines as the trainer writes them for intervals whose steps took `iter_ms` (no data wait)."""
    lines, step = [], 0
    for ms in iter_ms:
        step += len(ms)
        lines.append({"step": step, "img_per_s": len(ms) * batch / (sum(ms) / 1e3), "data_wait_ms": 0.0,
                      "iter_ms_median": sorted(ms)[len(ms) // 2], "wall_s": sum(map(sum, iter_ms[:len(lines) + 1]))})
    return lines


def bench_figures(iter_ms: list[float], batch: int) -> dict:
    """The bench row's figures from its raw timings, as run() derives them."""
    from benchmarks.speed.report import row_metrics

    raw = {"batch_size": batch, "precision": "fp32", "iter_ms": iter_ms, "wait_ms": [0.0] * len(iter_ms)}
    return row_metrics({"raw": raw}, None, None, None)


@pytest.mark.parametrize("row_ms,stall_ms,agree", [
    (100.0, 100.0, True),    # the same 100 ms steps both ways: ratio 1
    (100.0, 200.0, True),    # one of 40 steps 100 ms late: the trainer 2.4% slower, inside 3%
    (100.0, 250.0, False),   # 150 ms late: 3.6% slower; the median interval (still 100 ms steps) would have agreed
    (96.5, 100.0, False),    # the row 3.5% faster on every step
])
def test_the_verdict_on_known_answers(row_ms, stall_ms, agree):
    """Trainer intervals built step by step (a compiling first interval, then 4 x 10 steps, one of them maybe
    stalled) against a bench row of known steps: the trainer's img/s is its images over its seconds, so a stall
    counts, and the verdict is |ratio - 1| <= --tol (3%)."""
    batch = 64
    steps = [[2000.0] * 10] + [[100.0] * 10] * 3 + [[100.0] * 9 + [stall_ms]]
    trainer = trainer_vs_bench.trainer_figures(trainer_lines(steps, batch), batch)
    seconds = (3900.0 + stall_ms) / 1e3
    assert trainer["img_per_s"] == pytest.approx(40 * batch / seconds) and trainer["steps_compared"] == 40
    assert trainer["ms_median"] == 100.0 and trainer["intervals"] == 4
    bench = bench_figures([row_ms] * 50, batch)
    c = trainer_vs_bench.compare(bench, trainer, tol=0.03)
    assert c["img_per_s_ratio"] == pytest.approx(row_ms * 40 / (3900.0 + stall_ms))
    assert c["agree"] is agree


def test_main_exits_0_when_they_agree_and_1_when_they_differ(monkeypatch, tmp_path, capsys):
    """The command's status is the verdict: the comparison of a fabricated run (no GPU, no trainer) decides it."""
    batch = 64
    stats = trainer_lines([[2000.0] * 10] + [[100.0] * 10] * 4, batch)
    for row_ms, rc, word in ((100.0, 0, "agree"), (90.0, 1, "DIFFER")):
        bench = bench_figures([row_ms] * 50, batch)
        trainer = trainer_vs_bench.trainer_figures(stats, batch)
        result = {"bench": bench, "trainer": trainer, "comparison": trainer_vs_bench.compare(bench, trainer, 0.03)}
        monkeypatch.setattr(trainer_vs_bench, "run", lambda args, overrides, argv: (result, tmp_path / "t.json"))
        assert trainer_vs_bench.main(["--data", str(tmp_path)]) == rc
        assert f"-> {word} (tolerance 3%)" in capsys.readouterr().out
