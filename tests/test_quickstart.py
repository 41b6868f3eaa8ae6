"""The README's quick start, in its own order, on a fresh clone: `make bench`, then what `make test` checks of the
tree it leaves (issue 45: make bench wrote a git-ignored result that the ledger's test then read, and a shell's OUT
sent make bench's files elsewhere). The rest of `make test` is this suite itself."""

import json
import os
import subprocess
import sys
from pathlib import Path


REPO = Path(__file__).resolve().parent.parent


def test_make_bench_then_make_test_on_a_fresh_clone(tmp_path):
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(clone)], check=True)
    # A shell (the GPU machine, a CI system) that exports OUT, DATA or PY: none of them may redirect make. The GPUs are
    # hidden: on a GPU machine make bench runs the headline table (minutes, files for the card's committed folder);
    # this test checks the CPU path a contributor's machine and CI take.
    env = {**os.environ, "OUT": str(tmp_path / "env-out"), "DATA": str(tmp_path / "env-data"), "PY": "false",
           "CUDA_VISIBLE_DEVICES": ""}
    bench = subprocess.run(["make", "bench", "NO_SETUP=1", f"PY={sys.executable}"], cwd=clone, env=env,
                           capture_output=True, text=True, timeout=1200)
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    assert "table 'quick'" in bench.stdout
    assert not (tmp_path / "env-out").exists() and not (tmp_path / "env-data").exists()
    check_quick_table(bench.stdout, clone / "benchmarks/results/cpu")
    # What make test reads of the tree make bench left: nothing but ignored files changed, the ledger current.
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True, check=True)
    assert status.stdout == ""
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/test_ledger.py"], cwd=clone, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-3000:]


def check_quick_table(stdout: str, out: Path) -> None:
    """What make bench prints and writes on a CPU: the synthetic dataset said up front, the table at the end, three
    rows of the tiny preset (each in its own process, its steps timed, its collector frozen after the warm-up as the
    trainer's is), MFU n/a."""
    said = [line for line in stdout.splitlines() if line.startswith("bench:")]  # not make's own lines
    assert any("SYNTHETIC" in line for line in said[:2]), stdout[:1000]  # said up front, not buried
    table = stdout.rsplit("\ntiny\n", 1)[1].splitlines()  # printed at the end, not only written to files
    assert table[0].split()[:2] == ["row", "batch"] and table[1].startswith("baseline (fp32"), stdout[-2000:]
    result = json.loads((out / "quick.json").read_text())
    assert result["dataset"]["synthetic"] is True and result["dataset_built_now"] is True
    assert [r["name"] for r in result["rows"]] == ["baseline (fp32, eager, math attention, PyTorch DataLoader)",
                                                   "+ SDPA attention", "+ FFCV loading"]
    assert result["planned"] == [[r["preset"], r["name"]] for r in result["rows"]] and result["complete"]
    for row in result["rows"]:
        assert row["status"] == "ok" and row["preset"] == "tiny", row.get("error")
        iter_ms = row["raw"]["iter_ms"]
        assert len(iter_ms) == len(row["raw"]["wait_ms"]) == 5 and all(ms > 0 for ms in iter_ms)
        assert row["metrics"]["img_per_s"] > 0 and row["metrics"]["mfu"] is None
        assert row["config"]["data"]["batch_size"] == 32
        assert row["raw"]["gc_frozen_objects"] > 10_000 and len(row["raw"]["gc_collections"]) == 3
    assert [r["config"]["data"]["loader"] for r in result["rows"]] == ["torch-memory", "torch-memory", "ffcv"]
    assert result["environment"]["torch"] and "commit" in result["environment"]
    assert "n/a (no CUDA)" in (out / "quick.md").read_text() and (out / "quick.png").is_file()
