"""benchmarks.speed.kernel_regs on the CPU: the occupancy arithmetic, the command line, and one offline sm_90 build
of the fused GroupNorm's kernels (Triton's own ptxas; no GPU)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.speed import kernel_regs

ROOT = Path(__file__).resolve().parents[1]


def test_programs_per_sm_follows_registers_and_shared_memory():
    # 4 warps a program: registers allocated per warp in units of 256 (168 x 32 = 5376 = 21 units)
    assert [kernel_regs.programs_per_sm(r, 0, 4) for r in (168, 128, 96, 64)] == [3, 4, 5, 8]
    assert kernel_regs.programs_per_sm(32, 100 * 1024, 4) == 2  # 228 KB an SM, 1 KB reserved a program
    assert kernel_regs.programs_per_sm(16, 0, 4) == 16  # the thread limit: 2048 threads
    assert kernel_regs.programs_per_sm(16, 0, 1) == 32  # the program limit


def test_a_bad_site_or_plan_is_one_line(capsys):
    for argv in (["--site", "1,2"], ["--site", "a,b,c,d"], ["--site", "1024,100,32,32"], ["--plan", "3,3"]):
        assert kernel_regs.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("kernel_regs: error: "), err


def _triton_tools() -> bool:
    import triton

    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return all(os.path.exists(os.path.join(bin_dir, t)) for t in ("ptxas", "cuobjdump"))


@pytest.mark.skipif(not _triton_tools(), reason="needs Triton's bundled ptxas and cuobjdump")
def test_every_kernel_and_variant_builds_for_sm90():
    """In a process of its own: the test suite imports Triton under its interpreter, whose kernels do not compile."""
    code = ("import json; from benchmarks.speed import kernel_regs; "
            "print(json.dumps(kernel_regs.rows((2048, 65536, 4, 4), (1024, 128, 32, 32), 90)))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads(done.stdout)
    assert {r["kernel"] for r in rows} == set(kernel_regs.KERNELS)
    # every variant of every kernel is built once; the statistics kernel reads only TWO and the residual sum's flags,
    # so four builds cover it (with and without two parts, each with and without a residual sum)
    for kernel in kernel_regs.KERNELS:
        assert sorted(v for r in rows if r["kernel"] == kernel for v in r["variants"]) == sorted(
            kernel_regs.VARIANTS), kernel
    assert len([r for r in rows if r["kernel"] == "_stats_kernel"]) == 4
    for r in rows:
        assert 16 <= r["registers"] <= 255 and r["stack"] >= 0 and r["programs_per_sm"] >= 1, r
    reduce = {v: r["registers"] for r in rows if r["kernel"] == "_bwd_reduce_kernel" for v in r["variants"]}
    # the add + dropout variant carries a third sum and the mask's hash: more registers than the plain one; the sum
    # from the forward's means (model.norm_saved_means) takes registers off it, so more programs fit an SM
    assert reduce["res block norm2 (add, dropout)"] > reduce["res block norm1"]
    assert reduce["norm2, saved means"] < reduce["res block norm2 (add, dropout)"]
    occupancy = {v: r["programs_per_sm"] for r in rows if r["kernel"] == "_bwd_reduce_kernel" for v in r["variants"]}
    assert occupancy["norm2, saved means"] > occupancy["res block norm2 (add, dropout)"]


def test_kernels_under_the_interpreter_are_refused_in_one_line(capsys):
    import triton

    if not triton.knobs.runtime.interpret:
        pytest.skip("the suite imported Triton without its interpreter")
    assert kernel_regs.main([]) == 2
    assert "unset it" in capsys.readouterr().err
