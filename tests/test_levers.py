"""benchmarks.speed.levers on the CPU: its rows, its budget, its one-line errors (the rows themselves need CUDA)."""

import pytest

from benchmarks.speed import ddp, levers


def test_rows_are_rounds_of_the_defaults_and_each_variant():
    assert levers.parse_variant("bits:model.norm_mask_bits=True,train.seed=3") == (
        "bits", ("model.norm_mask_bits=True", "train.seed=3"))
    assert levers.parse_variant("plan:model.norm_plan=1024,16384,4,train.seed=3") == (
        "plan", ("model.norm_plan=1024,16384,4", "train.seed=3"))
    # the one parser of levers and ddp: spaces separate overrides too, and ddp takes commas as levers does
    assert levers.parse_variant("b:model.norm_mask_bits=True train.seed=3") == levers.parse_variant(
        "b:model.norm_mask_bits=True,train.seed=3")
    assert ddp.parse_variant("g:train.ddp_grad_dtype=bf16,data.loader=gpu") == (
        "g", ["train.ddp_grad_dtype=bf16", "data.loader=gpu"])
    rows = levers.plan_rows([("a", ("x=1",)), ("b", ("x=2",))])
    assert rows == [("defaults", ()), ("a", ("x=1",)), ("b", ("x=2",))] * 2
    assert levers.plan_rows([], rounds=3) == [("defaults", ())] * 3  # no --variant: the defaults alone


def test_a_row_starts_only_with_the_time_its_kind_took():
    """A fake clock: a setting's first row takes 100 s (it compiles), a repeat 30 s. 400 s hold both rounds of three
    settings. In 250 s: two new rows (50 s left), not the third (it needs 100), a repeat of the defaults (it needs
    half the longest new row, 50), then nothing (20 s left; a repeat now needs 30, b's first row 100)."""
    now, ran = [0.0], set()

    def run(name, overrides):
        now[0] += 30.0 if name in ran else 100.0
        ran.add(name)
        return {"status": "ok"}

    rows = levers.plan_rows([("a", ("x=1",)), ("b", ("x=2",))])
    done = levers.run_rows(rows, run, budget=400, clock=lambda: now[0])
    assert [(r["name"], r["round"], r["status"], r["seconds"]) for r in done] == [
        ("defaults", 1, "ok", 100.0), ("a", 1, "ok", 100.0), ("b", 1, "ok", 100.0), ("defaults", 2, "ok", 30.0),
        ("a", 2, "ok", 30.0), ("b", 2, "ok", 30.0)]
    now[0], ran = 0.0, set()
    done = levers.run_rows(rows, run, budget=250, clock=lambda: now[0])
    assert [(r["name"], r["round"], r["status"]) for r in done] == [
        ("defaults", 1, "ok"), ("a", 1, "ok"), ("b", 1, "skipped"), ("defaults", 2, "ok"), ("a", 2, "skipped"),
        ("b", 2, "skipped")]  # b's second row, its first skipped too (one H200 printed "round 1" twice at 1d6950d)
    assert done[2]["error"] == "50 s of the budget left, such a row is priced at 100 s"


def test_the_first_row_is_priced_without_the_process_one_time_costs():
    """The first row 140 s, 94 of them to its first step (a cold machine): a new row is priced at 140 - 47 = 93 s, so
    110 s left run one (it takes 80); before, its price was the first row's 140 s and every variant was skipped (one
    H200 at 8521720). A later new row's time counts whole."""
    now = [0.0]

    def run(name, overrides):
        first = not now[0]
        now[0] += 140.0 if first else 80.0
        return {"status": "ok", "raw": {"first_step_s": 94.0 if first else 30.0}}

    rows = levers.plan_rows([("a", ("x=1",)), ("b", ("x=2",))], rounds=1)
    done = levers.run_rows(rows, run, budget=250, clock=lambda: now[0])
    assert [r["status"] for r in done] == ["ok", "ok", "skipped"]
    assert done[2]["error"] == "30 s of the budget left, such a row is priced at 93 s"


@pytest.mark.parametrize("argv,message", [
    (["--out", "x", "--variant", "bits"], "--variant 'bits': write NAME:KEY=VALUE"),
    (["--out", "x", "--variant", "b:model.norm_mask_bits"], "--variant 'b:model.norm_mask_bits': write NAME:"),
    (["--out", "x", "--variant", "r:model.norm_residual=True,model.norm_impl=scale-shift"],
     "norm_residual, norm_fast_silu, norm_pair_hash, norm_x_sums are on, but norm_impl='scale-shift' runs no fused"),
])
def test_a_bad_variant_is_one_line(argv, message, capsys):
    assert levers.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("levers: error: ") and message in err[0], err
