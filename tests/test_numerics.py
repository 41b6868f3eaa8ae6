"""benchmarks.numerics on CPU: two paired trainer runs (fp32 reference, bf16 candidate) and the check between them."""

import json

import pytest

from benchmarks import numerics


def _stats(losses, every=10):
    return [{"step": every * (i + 1), "loss": x} for i, x in enumerate(losses)]


def test_check_is_paired_smoothed_and_skips_the_start():
    ref = _stats([1.0, 0.5, 0.4, 0.3, 0.2, 0.2])
    # A 50% jump in the first interval (before --skip ends) is ignored; the rest is +2% then -2%, averaging 0.
    cand = _stats([1.5, 0.51, 0.392, 0.306, 0.196, 0.204])
    c = numerics.check(ref, cand, tol=0.03, skip=0.2, smooth=2)
    assert c["checked_from_step"] == 20 and c["ok"]
    assert c["ratio_minus_1"][1] == pytest.approx(0.02) and c["ratio_minus_1"][2] == pytest.approx(-0.02)
    assert c["max_abs_smoothed"] == pytest.approx(0.0, abs=1e-12)
    assert not numerics.check(ref, cand, tol=0.03, skip=0.0, smooth=2)["ok"]  # the jump counts from step 0
    with pytest.raises(ValueError, match="different steps"):
        numerics.check(ref, ref[:-1], tol=0.1, skip=0.0, smooth=1)


def test_bf16_against_fp32_on_cpu(small_dataset, tmp_path, capsys):
    args = ["--data", str(small_dataset), "--preset", "tiny", "--batch", "16", "--steps", "30", "--log-every", "5",
            "--smooth", "2", "--out", str(tmp_path), "train.device=cpu", "data.num_workers=1"]
    rc = numerics.main([*args, "--tol", "0.5"])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    r = json.loads((tmp_path / "numerics-bf16.json").read_text())
    ref, cand = r["reference"]["stats"], r["candidate"]["stats"]
    assert [s["step"] for s in ref] == [s["step"] for s in cand] == [5, 10, 15, 20, 25, 30]
    assert ref != cand  # two runs, in two precisions...
    assert r["check"]["max_abs_smoothed"] < 0.5  # ...of the same training (same batches, timesteps and noise)
    assert r["config"]["train"]["seed"] == r["seed"] and "SYNTHETIC" in r["dataset"]
    assert "within tolerance" in (tmp_path / "numerics-bf16.md").read_text()
    assert (tmp_path / "numerics-bf16.png").stat().st_size > 10_000
    # No tolerance at all: the same runs fail the check, and say so.
    assert numerics.main([*args, "--tol", "0"]) == 1
    assert "OUTSIDE TOLERANCE" in capsys.readouterr().out
    assert "OUTSIDE tolerance" in (tmp_path / "numerics-bf16.md").read_text()


def test_too_few_steps_is_an_error(tmp_path, capsys):
    assert numerics.main(["--data", str(tmp_path), "--steps", "10", "--log-every", "10"]) == 2
    assert "fewer than two logged intervals" in capsys.readouterr().err
