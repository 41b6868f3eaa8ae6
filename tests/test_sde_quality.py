"""benchmarks.quality.sde end to end on CPU at toy size with the real digits judge (ffcv_ddpm.quality): the two parts,
the second continuing the first's report with its judge, four models trained a few steps, every sampler row of every
model clipped and not, a failing row recorded while the study goes on, the targets checked, the sampling budget
counted after the trainings, --guidance as the weight w, bad options and reports refused before any work, a signal
during a training run stopping the whole command."""

import json
import os
import signal

import numpy as np
import pytest

from benchmarks.quality import sde as sde_quality
from benchmarks.quality import sde_report
from ffcv_ddpm.unet import FUSED_OFF

pytestmark = pytest.mark.usefixtures("one_thread")

TOY = ["--steps", "2", "--n", "10", "--judge-steps", "3", "--heun-steps", "5", "--dpm-steps", "3", "--ddim-steps",
       "2", "--em-steps", "3", "--pc-steps", "2", "--ode-tols", "0.3", "model.base_channels=8",
       "model.channel_mult=(1, 2)", "model.num_res_blocks=1", "model.norm_groups=4", "model.attn_heads=2",
       "diffusion.timesteps=10", "train.device=cpu", "train.precision=fp32", "data.batch_size=8",
       "data.num_workers=1", "train.log_every=1", "train.warmup_steps=1", "--budget-s", "1000",
       # The fused GroupNorm's Triton kernels run interpreted on a CPU (seconds a forward), attention is not needed:
       # ~0.05 s a forward of 10 images on one core.
       "model.norm_impl=scale-shift", *FUSED_OFF, "model.attn_resolutions=()"]
# NFE per image of each (sampler, steps, eta, churn) row of TOY but the ODE's (adaptive).
TOY_NFE = {("heun", 5, None, 0.0): 9, ("heun", 5, None, 30.0): 9, ("dpm2m", 3, None, 0.0): 3,
           ("em", 3, None, 0.0): 3, ("pc", 2, None, 0.0): 4}
TOY_DDPM_NFE = {("ddim", 2, 0.0, 0.0): 2, ("ddim", 2, 1.0, 0.0): 2, ("ddpm", 10, None, 0.0): 10}


@pytest.fixture
def scales(monkeypatch):
    """The guidance_scale of every sampler call (recorded, then sampled as asked)."""
    import ffcv_ddpm.sde_sampling

    real, seen = ffcv_ddpm.sde_sampling.sample, []

    def sample(*a, guidance_scale=1.0, **k):
        seen.append(guidance_scale)
        return real(*a, guidance_scale=guidance_scale, **k)

    monkeypatch.setattr(ffcv_ddpm.sde_sampling, "sample", sample)
    return seen


def test_both_parts_every_sampler_row_of_every_model(digits_dataset, tmp_path, scales, monkeypatch, capsys):
    import ffcv_ddpm.sde_sampling

    real_flow = ffcv_ddpm.sde_sampling._probability_flow

    def flow(sde, score, x, options):  # the adaptive solver giving up at a tight tolerance, as it can on a GPU
        if options.rtol < 0.1:
            raise AssertionError("underflow in dt 0.0")
        return real_flow(sde, score, x, options)

    monkeypatch.setattr(ffcv_ddpm.sde_sampling, "_probability_flow", flow)
    first, second = tmp_path / "part1", tmp_path / "part2"
    toy = [*TOY, "--ode-tols", "0.3,0.01"]
    assert sde_quality.main(["--data", str(digits_dataset), "--out", str(first), "--part", "1", *toy]) == 0
    part1 = json.loads((first / "sde_quality.json").read_text())
    assert part1["complete"] and list(part1["models"]) == ["ve", "ddpm"] and (first / "judge.pt").is_file()
    assert sde_quality.main(["--data", str(digits_dataset), "--out", str(second), "--part", "2", "--continue-from",
                             str(first / "sde_quality.json"), *toy]) == 0
    result = json.loads((second / "sde_quality.json").read_text())
    assert result["complete"] and not result["skipped"] and set(scales) == {1.0}  # w = 0: no guidance
    assert list(result["models"]) == ["ve", "ddpm", "ve-edm", "ddpm-edm"] and len(result["parts"]) == 2
    assert [(m["process"], m["param"]) for m in result["models"].values()] == [
        ("ve", "eps"), ("ddpm", "eps"), ("ve", "edm"), ("ddpm", "edm")]
    assert result["models"]["ve-edm"]["config"]["diffusion"]["param"] == "edm"
    # One judge and one floor for both parts: the second loaded the first's.
    assert result["reference"]["fd_floor"] == part1["reference"]["fd_floor"]
    assert f"part 2 loaded it from {first / 'judge.pt'}" in result["reference"]["judge"]
    assert result["rows"][:len(part1["rows"])] == part1["rows"]

    ok = [r for r in result["rows"] if r["status"] == "ok"]
    nfe = {(r["model"], r["sampler"], r["steps"], r["eta"], r["churn"], r["clip"]): r["nfe"]
           for r in ok if r["sampler"] != "ode"}
    expected = {(m, *k, clip): v for m in sde_quality.MODELS for clip in ("static", "off")
                for k, v in {**TOY_NFE, **(TOY_DDPM_NFE if m.startswith("ddpm") else {})}.items()}
    assert nfe == expected  # every sampler of every model, clipped and not, with its NFE
    for r in result["rows"]:
        if r["sampler"] == "ode":
            # the failed row is in the report with its error; the rows after it ran
            assert r["nfe"] > 5 if r["tol"] == 0.3 else r["status"] == "failed: AssertionError: underflow in dt 0.0"
        assert r["precision"] == ("fp32" if r["sampler"] == "ode" else "tf32")
        assert r["deterministic"] == (r["sampler"] in ("dpm2m", "ode") or (r["sampler"] == "heun" and not r["churn"])
                                      or (r["sampler"] == "ddim" and r["eta"] == 0.0))
    for r in ok:
        assert r["img_per_s"] > 0 and np.isfinite(r["fd_digits"]) and 0 <= r["cond_acc"] <= 1
    ref = result["reference"]
    assert ref["floor_n"] == 10 and ref["fd_floor"] > 0 and 0 <= ref["judge_test_acc"] <= 1

    md = (second / "sde_quality.md").read_text()
    assert md.count("\n| ve-edm |") == 2 * 7 and md.count("\n| ddpm-edm |") == 2 * 10 and "rtol=atol=0.3" in md
    assert "| ddpm-edm | heun churn 30 | off | 5 steps | 9 | tf32 |" in md and "failed: AssertionError" in md
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sde: target ")]
    assert len(printed) == 2 * len(sde_report.TARGETS)  # each part printed the targets once
    assert all(f"- {line[len('sde: '):]}" in md for line in printed[-3:])
    # tools.atomic's writer lock (.writer-<pid>.lock) stays until this process exits: not an output.
    assert sorted(p.name for p in second.iterdir() if not p.name.startswith(".writer-")) == [
        "judge.pt", "samples-ddpm-edm.png", "samples-ve-edm.png", "sde_quality.json", "sde_quality.md",
        "sde_quality.png"]


def toy_row(**kw) -> dict:
    row = {"model": "ve", "process": "ve", "sampler": "em", "steps": 10, "eta": None, "churn": 0.0, "clip": "static",
           "status": "ok", "nfe": 10, "fd_digits": 1.0, "cond_acc": 0.9}
    return {**row, **kw}


def test_targets_name_the_cheapest_row_that_meets_them():
    """Per model: the fewest NFE that meets each target, or else the best within its NFE; only deterministic
    samplers count for the second; the FD target is a multiple of the floor."""
    rows = [toy_row(nfe=10, cond_acc=0.975, fd_digits=0.5),
            toy_row(sampler="heun", nfe=9, cond_acc=0.99, fd_digits=0.25),
            toy_row(sampler="heun", churn=30.0, nfe=5, cond_acc=0.99),
            toy_row(sampler="ddim", eta=0.0, nfe=3, cond_acc=0.98, fd_digits=0.9),
            toy_row(sampler="ode", nfe=40, cond_acc=1.0, fd_digits=0.1),
            toy_row(model="ddpm", sampler="ddim", eta=1.0, nfe=10, cond_acc=0.96),
            toy_row(model="ddpm", sampler="dpm2m", nfe=20, cond_acc=0.94, clip="off")]
    result = {"reference": {"fd_floor": 0.15}, "models": {"ve": {}, "ddpm": {}}, "rows": rows}
    (t1, r1), (t2, r2), (t3, r3) = sde_report.target_results(result)
    assert r1["ve"] == (True, rows[3]) and r1["ddpm"] == (False, rows[5])  # 98% at 3 NFE; ddpm's best 96%
    assert r2["ve"] == (True, rows[3]) and r2["ddpm"] == (False, rows[6])  # churned heun is not deterministic
    assert r3["ve"] == (True, rows[1]) and r3["ddpm"][0] is False  # FD 0.25 <= 0.30 at 9 NFE; 0.1 is at 40
    lines = sde_report.target_lines(result)
    assert lines[0] == ("target >= 97% conditional accuracy at <= 10 NFE: MET by ve (ddim, clip static, NFE 3: 98.0%); "
                        "not by ddpm (best at <= 10 NFE: 96.0%, ddim eta 1, clip static, NFE 10)")
    assert lines[2].startswith("target FD-digits within 2x the floor at <= 50 NFE (<= 0.3): MET by ve (heun")
    result["reference"]["fd_floor"] = None
    assert sde_report.target_lines(result)[2].endswith("not checked (no floor: the judge held no images out)")


def test_the_sampling_budget_starts_after_the_trainings(digits_dataset, tmp_path, scales):
    """--budget-s 0: both models are trained all the same (their time is not the sampling's), then no row fits.
    --guidance is the weight w: the sampler gets the scale 1 + w."""
    out = tmp_path / "out"
    argv = ["--data", str(digits_dataset), "--out", str(out), "--part", "1", *TOY, "--budget-s", "0", "--guidance",
            "0.5"]
    assert sde_quality.main(argv) == 0
    result = json.loads((out / "sde_quality.json").read_text())
    rows_per_clip = len(TOY_NFE) + 1 + len(TOY_NFE) + 1 + len(TOY_DDPM_NFE)  # ve, then ddpm (+1: the ODE row)
    assert set(result["models"]) == {"ve", "ddpm"} and result["rows"] == []
    assert len(result["skipped"]) == 2 * rows_per_clip
    assert set(scales) == {1.5} and len(scales) == 2  # the two untimed warm-up calls
    md = (out / "sde_quality.md").read_text()
    assert "Not run (sampling budget 0 s a part): ve/ddim" not in md  # a VE model has no DDIM rows
    assert "Not run (sampling budget 0 s a part): ddpm/ddim/2/clip static, ddpm/ddim eta 1/2/clip static," in md
    assert result["skipped"][-2:] == ["ddpm/ddpm/10/clip static", "ddpm/ddpm/10/clip off"]  # ancestral: last


def test_a_signal_during_a_training_stops_the_command(digits_dataset, tmp_path, monkeypatch, capsys):
    """SIGTERM while the DDPM model (the second) trains: the trainer checkpoints and returns, then the command
    stops: exit 143, that run's folder removed, the finished VE run kept (--runs), the report says so."""
    from ffcv_ddpm.diffusion import GaussianDiffusion

    real = GaussianDiffusion.loss

    def loss(self, *a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(self, *a, **k)

    monkeypatch.setattr(GaussianDiffusion, "loss", loss)
    out, runs = tmp_path / "out", tmp_path / "runs"
    assert sde_quality.main(["--data", str(digits_dataset), "--out", str(out), "--runs", str(runs), *TOY]) == 143
    assert [p.name for p in runs.iterdir() if p.is_dir()] == ["00000-ddpm-cifar10-sde-quality-ve"]
    result = json.loads((out / "sde_quality.json").read_text())
    assert list(result["models"]) == ["ve"] and result["stopped"].startswith("SIGTERM during training")
    assert "STOPPED (SIGTERM during training" in (out / "sde_quality.md").read_text()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "removed its unfinished run folder" in err[0] and "sde-quality-ddpm" in err[0]
    assert f"Kept: the report {out / 'sde_quality.json'} (0 rows measured)." in err[0]


def test_a_folder_without_the_betons_is_one_clear_error(tmp_path, capsys):
    assert sde_quality.main(["--data", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "*_train_raw.beton" in err and "SOURCE=digits" in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda r: r["settings"].update(n=20), "was made with other settings (n 20 there, 10 here): use the same"),
    (lambda r: r["models"].update({"ve-edm": {}}), "already has the model(s) ve-edm: continue it with another --part"),
    (lambda r: r.pop("settings"), "not an sde report (KeyError: 'settings')")])
def test_a_report_that_cannot_be_continued_is_one_line_before_any_work(tmp_path, capsys, edit, message):
    argv = ["--data", str(tmp_path / "d"), "--out", str(tmp_path / "o"), "--part", "2", "--continue-from",
            str(tmp_path / "r.json"), "--n", "10"]
    (tmp_path / "d").mkdir()  # the data folder is checked first (it exists); the report is what is wrong
    (tmp_path / "r.json").write_text("{}")
    report = {"settings": sde_quality.settings_of(sde_quality.parse_args(argv)), "models": {"ve": {}, "ddpm": {}}}
    edit(report)
    (tmp_path / "r.json").write_text(json.dumps(report))
    (tmp_path / "judge.pt").write_bytes(b"")
    assert sde_quality.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("args, message", [
    (["--budget-s", "-1"], "--budget-s: invalid value '-1': expected a number >= 0"),
    (["--ode-tols=-1"], "--ode-tols: invalid value '-1': expected comma-separated numbers > 0"),
    (["--judge-steps", "0"], "--judge-steps: invalid value '0': expected an integer >= 1"),
    (["--guidance=-1"], "--guidance: invalid value '-1': expected a number >= 0"),
    (["--em-steps", "1"], "--em-steps: invalid value '1': expected comma-separated integers >= 2"),
    (["--heun-steps", "1"], "--heun-steps: invalid value '1': expected comma-separated integers >= 2"),
    (["--clips", "on"], "--clips: invalid value 'on': expected comma-separated words"),
    (["--part", "3"], "--part: invalid choice: '3'"),
    (["--continue-from", "missing.json", "--part", "2"], "--continue-from missing.json: no such file"),
    (["--judge", "missing.pt"], "--judge missing.pt: no such file"),
    (["model.num_classes=0"], "model.num_classes must be >= 2")])
def test_every_bad_option_is_one_line_before_anything_runs(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        sde_quality.main(["--data", str(tmp_path / "d"), "--out", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_continuing_needs_a_part_to_add(tmp_path, capsys):
    (tmp_path / "r.json").write_text("{}")
    with pytest.raises(SystemExit):
        sde_quality.parse_args(["--data", str(tmp_path), "--out", str(tmp_path / "o"), "--continue-from",
                                str(tmp_path / "r.json")])
    assert "--continue-from with --part all: there is no model left to add" in capsys.readouterr().err


def test_the_plan_gives_every_group_a_row_before_any_gets_a_second(tmp_path):
    args = sde_quality.parse_args(["--data", str(tmp_path), "--out", str(tmp_path / "o")])
    rows = sde_quality.plan_rows(args, sde_quality.PARTS["1"], 1000)
    key = lambda r: (r["model"], r["sampler"], r["eta"], r["churn"], r["clip"])  # noqa: E731
    samplers = [("heun", None, 0.0), ("heun", None, 30.0), ("dpm2m", None, 0.0), ("em", None, 0.0), ("pc", None, 0.0),
                ("ode", None, 0.0)]
    groups = {(m, *s, clip) for m in ("ve", "ddpm") for s in samplers for clip in ("static", "off")}
    groups |= {("ddpm", "ddim", eta, 0.0, clip) for eta in (0.0, 1.0) for clip in ("static", "off")}
    first = len(groups)
    assert {key(r) for r in rows[:first]} == groups
    assert [r["guess"] for r in rows[:first]] == sorted(r["guess"] for r in rows[:first])  # cheapest first
    assert rows[first]["guess"] < rows[first - 1]["guess"]  # the second round starts cheap again
    assert [key(r) for r in rows[-2:]] == [("ddpm", "ddpm", None, 0.0, c) for c in ("static", "off")]  # ancestral last
    assert len(rows) == 2 * (2 * (5 + 3 + 5 + 5 + 5 + 2) + 2 * 5 + 1)  # churn: only the settings of >= 5 levels
    assert {r["precision"] for r in rows if r["sampler"] == "ode"} == {"fp32"}
    assert {r["precision"] for r in rows if r["sampler"] != "ode"} == {"tf32"}


def test_a_row_cannot_run_past_the_sampling_budget():
    """An adaptive solve's NFE is not known beforehand: the network refuses evaluations past the row's share."""
    import torch

    net = torch.nn.Linear(2, 2)
    net.num_classes = 10
    capped = sde_quality.Capped(net, 3)
    for _ in range(3):
        capped(torch.zeros(1, 2))
    with pytest.raises(sde_quality.OverBudget, match="stopped after 3 network evaluations"):
        capped(torch.zeros(1, 2))
    assert capped.num_classes == 10 and list(capped.parameters()) == list(net.parameters())


def test_an_old_report_renders_with_its_samplers_clip_and_the_targets(tmp_path):
    """A report from before models, clip and targets existed (rows keyed by process; ddpm/ddim clipped, the SDE
    samplers not) renders: the committed H100 run at 1caf6a3."""
    from pathlib import Path

    src = Path(__file__).parents[1] / "benchmarks/results/h100/sde-quality/sde_quality.json"
    path = tmp_path / "sde_quality.json"
    path.write_text(src.read_text())
    assert sde_report.main([str(path)]) == 0
    md = path.with_suffix(".md").read_text()
    assert "| ddpm | ddim eta 1 | static | 10 steps | 10 | fp32 | 1,701 | 1.731 | 95.4% | ok |" in md
    assert "| ve | em | off | 100 steps | 100 | fp32 |" in md
    assert ("target >= 97% conditional accuracy at <= 10 NFE: NOT MET: ve (best at <= 10 NFE: no row measured); "
            "ddpm (best at <= 10 NFE: 95.4%, ddim eta 1, clip static, NFE 10)") in md
    assert path.with_suffix(".png").stat().st_size > 10_000
