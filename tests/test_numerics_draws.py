"""benchmarks.speed.numerics_draws: NOTES item 27's rule over several numerics reports (no GPU: reports are input)."""

import json
from pathlib import Path

import pytest

from benchmarks.speed import numerics_draws as nd


def report(cand: float, ctl: float, **changes) -> dict:
    legs = {"reference": {"precision": "fp32", "overrides": []}, "candidate": {"precision": "bf16", "overrides": []},
            "control": {"precision": "fp32", "overrides": ["train.cudnn_benchmark=False"]}}
    r = {"preset": "ddpm-cifar10", "device": "NVIDIA H100 80GB HBM3", "batch_size": 32, "log_every": 20,
         "common_overrides": ["data.batch_size=32"], "steps": 2000, "environment": {"commit": "abc1234567890"},
         "noise_floor": {"candidate": cand, "control": ctl}, "verdict": {"ok": cand <= 1.5 * ctl}, **legs}
    r.update(changes)
    return r


def write(folder, reports):
    for i, r in enumerate(reports):
        (folder / f"draw-{i}").mkdir(parents=True)
        (folder / f"draw-{i}" / "numerics-bf16.json").write_text(json.dumps(r))


def test_the_medians_decide_once_there_are_enough_draws(tmp_path):
    # Alone, draws 0 and 2 fail (7.0 > 1.5 x 4.0); the medians: 6.0 against 1.5 x 4.5 = 6.75: pass
    draws = [report(0.07, 0.04), report(0.05, 0.05), report(0.07, 0.04), report(0.06, 0.05), report(0.05, 0.045),
             report(0.06, 0.045)]
    write(tmp_path / "runs", draws)
    assert nd.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    result = json.loads((tmp_path / "out" / "numerics-draws.json").read_text())
    assert result["verdict"] == "pass" and len(result["draws"]) == 6
    assert result["median_candidate"] == pytest.approx(0.06) and result["bound"] == pytest.approx(1.5 * 0.045)
    assert "**pass**: the median candidate deviation 6.00%" in (tmp_path / "out" / "numerics-draws.md").read_text()
    assert nd.decide([(str(i), r) for i, r in enumerate(draws)], 6, 1.2)["verdict"] == "fail"  # bound 5.4%


def test_fewer_draws_than_the_rule_needs_are_undecided_and_say_which_way_they_lean(capsys):
    draws = [(f"d{i}", report(c, 0.0476)) for i, c in enumerate((0.0684, 0.0734, 0.0718))]
    result = nd.decide(draws, 6, 1.5)
    assert result["verdict"] == "undecided" and result["leaning"] == "fail"
    assert "(the rule needs 6; on these it leans fail)" in nd.render(result, "cmd")


@pytest.mark.parametrize("change,message", [
    ({"device": "NVIDIA H200"}, "d1 is not a draw of the check in d0: they differ in device"),
    ({"batch_size": 64}, "they differ in batch_size"),
    ({"candidate": {"precision": "fp16", "overrides": []}}, "they differ in candidate"),
    ({"noise_floor": None}, "d1: no control leg"),
])
def test_reports_of_different_checks_are_refused_in_one_line(change, message):
    with pytest.raises(ValueError, match=message):
        nd.decide([("d0", report(0.05, 0.04)), ("d1", report(0.05, 0.04, **change))], 6, 1.5)


def test_bad_inputs_are_one_line(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    for argv, message in ((["missing.json"], "no such file: missing.json"), ([str(tmp_path / "bad.json")],
                          "bad.json: not a numerics report"), ([str(tmp_path / "empty")], "no numerics reports")):
        (tmp_path / "empty").mkdir(exist_ok=True)
        assert nd.main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("numerics_draws: error: ") and message in err[0], err


def test_the_committed_h100_draws_lean_fail_and_are_undecided(capsys):
    """The three draws at 0c88903 (NOTES item 27): 7.18% against 1.5 x 4.76% = 7.13%."""
    assert nd.main([str(Path(__file__).resolve().parents[1] / "benchmarks/results/h100/numerics-0c88903")]) == 0
    out = capsys.readouterr().out
    assert "**undecided**: the median candidate deviation 7.18% against 1.5 x the median control's 4.76% = 7.13%, " \
           "over 3 draws (the rule needs 6; on these it leans fail)" in out
