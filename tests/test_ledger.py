"""The results ledger (benchmarks/results/README.md): current with the committed files, built from what each file
says, and refusing a result it cannot read or a page that no longer matches the files."""

import json
from pathlib import Path

from benchmarks import ledger

ENV = {"commit": "0123456789abcdef", "dirty": False, "commit_source": "git", "date_utc": "2026-11-20T09:05:00+00:00",
       "torch": "2.11.0+cu130", "gpu_count": 1, "gpus": [{"name": "NVIDIA H100 80GB HBM3"}]}


def bench_row(name: str, batch: int, ms: float, img_s: float, mfu: float) -> dict:
    return {"name": name, "status": "ok", "raw": {"batch_size": batch, "iter_ms": [ms] * 3},
            "metrics": {"ms_median": ms, "img_per_s": img_s, "mfu": mfu}}


def ddp_lines(*img_per_s: float) -> list[dict]:
    """A DDP point's stats.jsonl lines: 25-step intervals at these rates (the first, compiling, is dropped)."""
    return [{"step": 25 * (i + 1), "img_per_s": r} for i, r in enumerate(img_per_s)]


def results_tree(root):
    """A small results folder in the formats the commands write: a bench table, a DDP run and a trainer run."""
    table = root / "h100" / "headline" / "cold"
    table.mkdir(parents=True)
    (root / "h100" / "headline" / "README.md").write_text("# notes on the headline runs\n")
    bench = {"schema": 1, "table": "headline", "complete": True, "environment": ENV,
             "device_name": "NVIDIA H100 80GB HBM3", "command": ["python", "-m", "benchmarks.bench", "--data", "d"],
             "rows": [bench_row("baseline", 128, 180.38, 709.6, 0.395), bench_row("best", 1024, 119.46, 8534.2, 0.3217),
                      {"name": "broken", "status": "failed", "raw": None}],
             "sampling": None}
    (table / "headline.json").write_text(json.dumps(bench))
    ddp = {"preset": "ddpm-cifar10", "device_name": "NVIDIA H100 80GB HBM3",
           "command": "python -m benchmarks.ddp --gpus 1,4",
           "environment": {**ENV, "gpu_count": 4, "commit_source": "declared (FFCV_DDPM_COMMIT), not verified"},
           "flops_per_image": 3.7e10, "peak_tflops": 989.4,
           # As written before img/s was images over seconds: each point's figure is its median interval's rate.
           # The 4-GPU point's third interval stalled: 24,576.7 images a second by the median, 18,432.5 in all.
           "points": {"per-GPU": [{"nproc": 1, "img_per_s": 6859.5, "scaling_efficiency": 1.0,
                                   "stats": ddp_lines(100.0, 6859.5, 6859.5, 6859.5)},
                                  {"nproc": 4, "img_per_s": 24576.7, "scaling_efficiency": 0.8957,
                                   "stats": ddp_lines(300.0, 24576.7, 24576.7, 24576.7 / 2)}],
                      # a mode cut short after its one-GPU point, and one whose 4-GPU point failed
                      "global": [{"nproc": 1, "img_per_s": 8876.4, "scaling_efficiency": 1.0,
                                  "stats": ddp_lines(90.0, 8876.4, 8876.4)}],
                      "independent (no DDP)": [{"nproc": 4, "error": "timed out"}]},
           "loss_check": {"tol": 0.0072,
                          "checks": [{"nproc": 4, "max_abs_smoothed": 0.0189, "tol": 0.0072, "ok": False}]}}
    (root / "h100" / "ddp.json").write_text(json.dumps(ddp))
    run = root / "h200" / "train-run"
    run.mkdir(parents=True)
    (run / "environment.json").write_text(json.dumps({**ENV, "world_size": 1, "gpus": [{"name": "NVIDIA H200"}]}))
    (run / "config.json").write_text(json.dumps({"preset": "ddpm-cifar10"}))  # not a result: not listed
    (run / "stats.jsonl").write_text("".join(json.dumps({"step": s, "loss": loss, "img_per_s": ips}) + "\n"
                                             for s, loss, ips in ((50, 1.08, 311.0), (100, 0.8202, 5515.8))))
    (root / "h100" / "README.md").write_text("# notes\n")
    return root


def test_the_committed_ledger_is_current(capsys):
    """What keeps benchmarks/results/README.md from drifting: every committed JSON has a reader and is listed."""
    assert ledger.main(["--check"]) == 0, capsys.readouterr().err


def test_the_index_lists_each_file_with_figures_read_from_it(tmp_path, capsys):
    root = results_tree(tmp_path)
    assert ledger.main(["--results", str(root)]) == 0
    page = (root / "README.md").read_text()
    lines = {line.split("](")[1].split(")")[0]: line for line in page.splitlines() if line.startswith("| [")}
    assert set(lines) == {"h100/headline/cold/headline.json", "h100/ddp.json", "h200/train-run/environment.json"}
    bench = lines["h100/headline/cold/headline.json"]
    # The fastest finished row (not the first, not the failed one), its figures, stamp and command.
    assert '2/3 rows ok, "best" (batch 1024): 119.5 ms/step, 8,534 img/s, MFU 32.2%' in bench
    assert "| 2026-11-20 09:05 | 0123456 |" in bench and "`python -m benchmarks.bench --data d`" in bench
    ddp = lines["h100/ddp.json"]
    # Re-derived from the intervals (images over seconds): 18,433 img/s, 67.2% of four times 6,859.5, not 89.6%.
    assert ("per-GPU: 4 GPUs 18,433 img/s, 67.2% scaling efficiency; global: only the 1-GPU point finished, 8,876 "
            "img/s; independent (no DDP): no point finished; loss check, 4 GPUs: largest deviation 1.89% vs "
            "tolerance 0.72%: OUTSIDE; img/s re-derived from the intervals (the file holds the median interval's "
            "rate)") in ddp
    assert "0123456 (declared, not verified)" in ddp and "(4 visible)" in ddp
    run = lines["h200/train-run/environment.json"]
    assert "100 steps, last loss 0.8202, 5,516 img/s in the last interval" in run and "NVIDIA H200" in run
    # Grouped by card, then folder; the card's notes linked; the run's config.json counted as not listed.
    assert page.index("## h100/") < page.index("### h100/ (top level)") < page.index("### h100/headline/cold/") \
        < page.index("## h200/") < page.index("### h200/train-run/")
    assert "## h100/ ([notes](h100/README.md))" in page and "## h200/\n" in page
    assert "### h100/headline/cold/ ([notes](h100/headline/README.md))" in page  # the study's notes, a folder up
    assert "1 x `config.json`" in page
    assert ledger.main(["--check", "--results", str(root)]) == 0


def test_a_json_no_reader_knows_fails_the_check(tmp_path, capsys):
    root = results_tree(tmp_path)
    assert ledger.main(["--results", str(root)]) == 0
    (root / "h200" / "train-run" / "mystery.json").write_text(json.dumps({"speed": 12.5}))
    capsys.readouterr()
    assert ledger.main(["--check", "--results", str(root)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("ledger: error: h200/train-run/mystery.json: no reader recognises this JSON; add one to READERS in "
                   "benchmarks/ledger.py (or its name to NOT_RESULTS if it is no result of its own)")
    # Writing refuses too, and leaves the page as it was.
    before = (root / "README.md").read_text()
    assert ledger.main(["--results", str(root)]) == 2
    assert (root / "README.md").read_text() == before
    assert not list(root.glob(".README.md*"))


def test_a_reader_that_cannot_read_its_file_names_it(tmp_path, capsys):
    root = results_tree(tmp_path)
    ddp = json.loads((root / "h100" / "ddp.json").read_text())
    ddp["points"] = [1, 2]  # points per mode is a dict
    (root / "h100" / "ddp.json").write_text(json.dumps(ddp))
    assert ledger.main(["--check", "--results", str(root)]) == 1
    assert "h100/ddp.json: the DDP scaling reader cannot read it (AttributeError" in capsys.readouterr().err


def test_a_stale_page_fails_the_check(tmp_path, capsys):
    root = results_tree(tmp_path)
    assert ledger.main(["--check", "--results", str(root)]) == 1  # no page yet
    assert "README.md does not exist" in capsys.readouterr().err
    assert ledger.main(["--results", str(root)]) == 0
    # A new result lands without the page being regenerated.
    run = json.loads((root / "h100" / "headline" / "cold" / "headline.json").read_text())
    run["rows"][1]["metrics"]["img_per_s"] = 9000.0
    (root / "h100" / "headline" / "cold" / "again.json").write_text(json.dumps(run))
    capsys.readouterr()
    assert ledger.main(["--check", "--results", str(root)]) == 1
    err = capsys.readouterr().err
    assert "is stale: not listed: h100/headline/cold/again.json (1 files)" in err and len(err.splitlines()) == 1
    # A figure changed in a file already listed.
    (root / "h100" / "headline" / "cold" / "again.json").unlink()
    run["rows"][1]["metrics"]["img_per_s"] = 8000.0
    (root / "h100" / "headline" / "cold" / "headline.json").write_text(json.dumps(run))
    assert ledger.main(["--check", "--results", str(root)]) == 1
    assert "is stale: 2 changed lines, the first at line" in capsys.readouterr().err
    assert ledger.main(["--results", str(root)]) == 0 and ledger.main(["--check", "--results", str(root)]) == 0


def test_a_numerics_line_names_the_control_and_the_verdict_when_the_file_has_them():
    check = {"max_abs_smoothed": 0.1075, "at_step": 1980, "tol": 0.05, "ok": False}
    d = {"candidate": {"precision": "bf16"}, "reference": {"precision": "fp32"}, "steps": 2000, "check": check}
    older = ledger.numerics(None, d)  # written before the control and the verdict existed
    assert older.endswith("largest deviation 10.75% (step 1980), tolerance 5.0%: OUTSIDE")
    d.update(noise_floor={"control": 0.0947}, verdict={"ok": True, "bound": 0.14205, "by": "noise floor"})
    assert ledger.numerics(None, d) == (older + "; the fp32 control strays 9.47%; verdict pass (bound 14.21%, "
                                        "the noise floor)")


def test_a_numerics_draws_line_gives_the_verdict_medians_and_bound():
    d = {"draws": [{}, {}, {}, {}], "need": 6, "noise_factor": 1.5, "median_candidate": 0.0674,
         "median_control": 0.0594, "bound": 0.0891, "verdict": "undecided"}
    assert ledger.numerics_draws(None, d) == (
        "undecided over 4 draws (the rule needs 6): median candidate deviation 6.74% against 1.5 x the median "
        "control's 5.94% = 8.91%")


def test_a_conv_sites_line_names_the_search_and_the_384_channel_dgrads():
    rows = [{"site": "up0-cat384", "case": "dgrad", "ms": 2.214}, {"site": "res128", "case": "fwd", "ms": 0.442},
            {"site": "up0-cat384", "case": "dgrad as 256 + 128", "ms": 1.349}]
    d = {"rows": rows, "batch": 1024, "benchmark_limit": 0}
    assert ledger.conv_sites(Path("x.json"), d) == ("3 cases at batch 1024, cuDNN's search over every engine; "
                                                     "384-channel dgrad 2.214, dgrad as 256 + 128 1.349 ms")
    assert ledger.conv_sites(Path("x.json"), {**d, "rows": rows[1:2], "benchmark_limit": 10}) == (
        "1 cases at batch 1024, cuDNN's search over 10 engines")


def test_a_norm_bench_line_leaves_failed_plans_out_and_counts_them():
    """A plan that failed to compile is a row with an error (norm_bench.sweep): the file is still a GroupNorm layer
    result, its headline names the fastest plan that ran and how many failed."""
    ok = {"impl": "fused", "shape": [1024, 128, 32, 32, 0.1, True], "fwd_ms": 1.0}
    d = {"environment": ENV, "device_name": "NVIDIA H200", "settings": {"plans": "stages"},
         "rows": [{**ok, "plan": [2048, 65536, 4], "fwd_bwd_ms": 3.5}, {**ok, "plan": [2048, 65536, 4, 3],
                                                                      "fwd_bwd_ms": 2.75},
                  {"impl": "fused", "plan": [2048, 65536, 4, 4], "shape": ok["shape"], "error": "RuntimeError: x"}]}
    [reader] = [r for r in ledger.READERS if r.matches(ledger.Path("norm_bench.json"), d)]
    assert reader.kind == "GroupNorm layer"
    assert reader.headline(None, d).endswith("fused (2048, 65536, 4, 3) 2.75 ms fwd+bwd (2 timed, 1 failed)")


def test_a_race_names_both_sides_seconds_and_the_ratio_only_where_both_got_there():
    ours = {"clock_s": 104.2, "step": 2100}
    d = {"environment": ENV, "thresholds": [8, 4], "sides": {}, "floor": {"fd_digits": 0.149},
         "table": [{"threshold": 8.0, "ours": ours, "peer": {"clock_s": 194.3}, "ratio": 194.3 / 104.2},
                   {"threshold": 4.0, "ours": ours, "peer": None, "ratio": None}]}
    [reader] = [r for r in ledger.READERS if r.matches(ledger.Path("race.json"), d)]
    assert reader.kind == "race"
    assert reader.headline(None, d) == ("FD-digits, ours / peer: <= 8: 104 s / 194 s (1.86x); <= 4: 104 s / - "
                                        "(floor 0.149)")


def test_a_conv_dgrad_line_says_where_the_sums_epilogue_was_correct_and_what_it_cost():
    site = {"count": 2, "cudnn_ms": 0.5, "best": {"ms": 0.4}, "passes_ms": 0.1}
    d = {"batch": 1024, "sites": [site]}
    plain = "batch 1024: CUTLASS dgrad at 1 of 1 sites, 1.250x cuDNN's rate (1.0 ms -> 0.8 ms a step)"
    assert ledger.conv_dgrad(Path("x.json"), d).startswith(plain)
    assert "epilogue" not in ledger.conv_dgrad(Path("x.json"), d)
    wrong = {**site, "act_sums": [{"sums_err": 1.0}]}
    assert ledger.conv_dgrad(Path("x.json"), {**d, "sites": [wrong]}).endswith(
        "with the sums in its epilogue: correct at 0 of 1 sites")
    slow = {**site, "act_sums": [{"sums_err": 1e-6}], "fused": {"saved_ms": -0.25}}
    assert ledger.conv_dgrad(Path("x.json"), {**d, "sites": [slow, wrong]}).endswith(
        "correct at 1 of 2 sites, +0.50 ms a step against the plain dgrad and the passes")


def test_only_files_git_tracks_are_indexed(tmp_path, capsys):
    """A local run's files (git-ignored cpu/quick.json, a fresh GPU run's untracked JSON) never make the committed
    page stale: `make bench && make test` on a fresh clone passes. Staging a file brings it in."""
    import subprocess

    root = results_tree(tmp_path / "results")
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], cwd=root, check=True)
    (root / ".gitignore").write_text("/cpu/*\n")
    subprocess.run([*git, "add", "."], cwd=root, check=True)
    assert ledger.main(["--results", str(root)]) == 0
    (root / "cpu").mkdir()
    (root / "cpu" / "quick.json").write_text('{"unreadable by": "any reader"}')  # ignored
    (root / "h100" / "headline.json").write_text('{"a fresh run": true}')  # untracked
    assert ledger.main(["--check", "--results", str(root)]) == 0, capsys.readouterr().err
    subprocess.run([*git, "add", "h100/headline.json"], cwd=root, check=True)
    assert ledger.main(["--check", "--results", str(root)]) == 1
    assert "h100/headline.json: no reader recognises this JSON" in capsys.readouterr().err


def test_a_ddp_point_without_intervals_keeps_its_files_figure_and_says_so():
    """The independent control before its processes' stats were kept: its img/s cannot be re-derived; its
    efficiency is against the re-derived one-GPU point (here 40 img/s: 50 by the median, one interval stalled)."""
    d = {"flops_per_image": 1e9, "peak_tflops": None, "points": {
        "per-GPU": [{"nproc": 1, "img_per_s": 50.0, "stats": ddp_lines(1.0, 50.0, 50.0, 50.0, 25.0)}],
        "independent (no DDP)": [{"nproc": 2, "img_per_s": 100.0}]}}
    assert ledger.ddp(None, d) == ("per-GPU: only the 1-GPU point finished, 40 img/s; independent (no DDP): 2 GPUs "
                                   "100 img/s (the file's figure: no intervals kept), 125.0% scaling efficiency; "
                                   "img/s re-derived from the intervals (the file holds the median interval's rate)")
