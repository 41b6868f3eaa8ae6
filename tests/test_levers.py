"""benchmarks.speed.levers on the CPU: its rows, its budget, its one-line errors (the rows themselves need CUDA)."""

import pytest

from benchmarks.speed import levers


def test_rows_are_the_defaults_each_variant_and_the_defaults_again():
    assert levers.parse_variant("bits:model.norm_mask_bits=True,train.seed=3") == (
        "bits", ("model.norm_mask_bits=True", "train.seed=3"))
    rows = levers.plan_rows(list(levers.DEFAULT_VARIANTS))
    assert [name for name, _ in rows] == ["defaults", "all", "residual", "saved-means", "mask-bits", "defaults-again"]
    assert rows[0][1] == rows[-1][1] == ()
    # "all" is every lever that runs alone
    assert set(dict(rows)["all"]) == {o for name, over in rows[2:-1] for o in over}


def test_a_row_starts_only_with_the_time_the_longest_new_row_took():
    """A fake clock: new rows take 100 s, the repeated defaults 10 s. With 350 s: the defaults, two variants, then
    the third is skipped (50 s left < 100 s), and so is the repeat (it needs what the longest new row took)."""
    now, cost = [0.0], {(): 100.0}

    def run(name, overrides):
        now[0] += cost.get(overrides, 100.0) if name != "defaults-again" else 10.0
        return {"status": "ok"}

    rows = levers.plan_rows([("a", ("x=1",)), ("b", ("x=2",)), ("c", ("x=3",))])
    done = levers.run_rows(rows, run, budget=350, clock=lambda: now[0])
    assert [r["status"] for r in done] == ["ok", "ok", "ok", "skipped", "skipped"]
    assert done[3]["error"] == "50 s of the budget left, a new row took up to 100 s"
    assert [r["seconds"] for r in done[:3]] == [100.0, 100.0, 100.0]
    done = levers.run_rows(rows, run, budget=1000, clock=lambda: now[0])
    assert [r["status"] for r in done] == ["ok"] * 5 and done[-1]["seconds"] == 10.0


@pytest.mark.parametrize("argv,message", [
    (["--out", "x", "--variant", "bits"], "--variant 'bits': write NAME:KEY=VALUE"),
    (["--out", "x", "--variant", "b:model.norm_mask_bits"], "--variant 'b:model.norm_mask_bits': write NAME:"),
    (["--out", "x", "--variant", "r:model.norm_residual=True,model.norm_impl=scale-shift"],
     "norm_residual=True is a switch of the fused GroupNorm kernels"),
])
def test_a_bad_variant_is_one_line(argv, message, capsys):
    assert levers.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("levers: error: ") and message in err[0], err
