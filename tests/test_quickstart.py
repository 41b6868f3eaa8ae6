"""The README's quick start, in its own order, on a fresh clone: `make bench`, then what `make test` checks of the
tree it leaves (issue 45: make bench wrote a git-ignored result that the ledger's test then read, and a shell's OUT
sent make bench's files elsewhere). The rest of `make test` is this suite itself."""

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
    assert "table 'quick'" in bench.stdout and (clone / "benchmarks/results/cpu/quick.json").is_file()
    assert not (tmp_path / "env-out").exists() and not (tmp_path / "env-data").exists()
    # What make test reads of the tree make bench left: nothing but ignored files changed, the ledger current.
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True, check=True)
    assert status.stdout == ""
    tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "tests/test_ledger.py"], cwd=clone, capture_output=True, text=True, timeout=600)
    assert tests.returncode == 0, tests.stdout[-3000:]
