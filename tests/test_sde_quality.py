"""benchmarks.quality.sde end to end on CPU at toy size with the real digits judge (ffcv_ddpm.quality): both models
trained a few steps, every sampler row measured, a failing row recorded while the study goes on, the sampling budget
counted after the trainings, --guidance as the weight w, bad options refused before any work, a signal during a
training run stopping the whole command."""

import json
import os
import signal

import numpy as np
import pytest

from benchmarks.quality import sde as sde_quality

pytestmark = pytest.mark.usefixtures("one_thread")

TOY = ["--steps", "2", "--n", "10", "--judge-steps", "3", "--ddim-steps", "2", "--em-steps", "3", "--pc-steps", "2",
       "--ode-tols", "0.3", "model.base_channels=8", "model.channel_mult=(1, 2)", "model.num_res_blocks=1",
       "model.norm_groups=4", "model.attn_heads=2", "diffusion.timesteps=20", "train.device=cpu",
       "train.precision=fp32", "data.batch_size=8", "data.num_workers=1", "train.log_every=1", "train.warmup_steps=1"]


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


def test_every_sampler_row_of_both_processes(digits_dataset, tmp_path, scales, monkeypatch):
    import ffcv_ddpm.sde_sampling

    real_flow = ffcv_ddpm.sde_sampling._probability_flow

    def flow(sde, score, x, options):  # the adaptive solver giving up at a tight tolerance, as it can on a GPU
        if options.rtol < 0.1:
            raise AssertionError("underflow in dt 0.0")
        return real_flow(sde, score, x, options)

    monkeypatch.setattr(ffcv_ddpm.sde_sampling, "_probability_flow", flow)
    out = tmp_path / "out"
    argv = ["--data", str(digits_dataset), "--out", str(out), *TOY, "--ode-tols", "0.3,0.01"]
    assert sde_quality.main(argv) == 0
    result = json.loads((out / "sde_quality.json").read_text())
    assert result["complete"] and not result["skipped"] and set(scales) == {1.0}  # w = 0: no guidance
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    nfe = {(r["process"], r["sampler"], r["eta"], r["clip"]): r["nfe"] for r in ok if r["sampler"] != "ode"}
    expected = {("ddpm", "em", None): 3, ("ve", "em", None): 3, ("ddpm", "pc", None): 4, ("ve", "pc", None): 4,
                ("ddpm", "ddim", 0.0): 2, ("ddpm", "ddim", 1.0): 2, ("ddpm", "ddpm", None): 20}
    assert nfe == {(*k, clip): v for k, v in expected.items() for clip in ("static", "off")}  # clipped and not
    odes = {(r["process"], r["tol"], r["clip"]): r for r in result["rows"] if r["sampler"] == "ode"}
    for proc, clip in [(p, c) for p in ("ddpm", "ve") for c in ("static", "off")]:
        assert odes[(proc, 0.3, clip)]["nfe"] > 5
        # the failed row is in the report with its error; the rows after it ran
        assert odes[(proc, 0.01, clip)]["status"] == "failed: AssertionError: underflow in dt 0.0"
    for r in ok:
        assert r["img_per_s"] > 0 and np.isfinite(r["fd_digits"]) and 0 <= r["cond_acc"] <= 1
    assert result["models"]["ve"]["config"]["diffusion"]["process"] == "ve"
    ref = result["reference"]
    assert ref["floor_n"] == 10 and ref["fd_floor"] > 0 and 0 <= ref["judge_test_acc"] <= 1
    assert "10 class-balanced images held out" in ref["judge"]
    md = (out / "sde_quality.md").read_text()
    assert md.count("\n| ve |") == 8 and md.count("\n| ddpm |") == 14 and "rtol=atol=0.3" in md
    assert "| ddpm | ddim eta 1 | off | 2 steps |" in md and "failed: AssertionError: underflow in dt" in md
    assert "ve model: best conditional accuracy" in md and "the 90% target" in md
    # tools.atomic's writer lock (.writer-<pid>.lock) stays until this process exits: not an output.
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".writer-")) == [
        "samples-ddpm.png", "samples-ve.png", "sde_quality.json", "sde_quality.md", "sde_quality.png"]


def test_the_sampling_budget_starts_after_the_trainings(digits_dataset, tmp_path, scales):
    """--budget-s 0: both models are trained all the same (their time is not the sampling's), then no row fits.
    --guidance is the weight w: the sampler gets the scale 1 + w."""
    out = tmp_path / "out"
    argv = ["--data", str(digits_dataset), "--out", str(out), *TOY, "--budget-s", "0", "--guidance", "0.5"]
    assert sde_quality.main(argv) == 0
    result = json.loads((out / "sde_quality.json").read_text())
    assert set(result["models"]) == {"ve", "ddpm"} and result["rows"] == [] and len(result["skipped"]) == 18
    assert set(scales) == {1.5} and len(scales) == 2  # the two untimed warm-up calls
    md = (out / "sde_quality.md").read_text()
    assert ("Not run (sampling budget 0 s): ddpm/ddim/2/clip static, ddpm/ddim eta 1/2/clip static, "
            "ddpm/ddim/2/clip off, ddpm/ddim eta 1/2/clip off, ddpm/em/3/clip static,") in md  # cheapest first


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


@pytest.mark.parametrize("args, message", [
    (["--budget-s", "-1"], "--budget-s: invalid value '-1': expected a number >= 0"),
    (["--ode-tols=-1"], "--ode-tols: invalid value '-1': expected comma-separated numbers > 0"),
    (["--judge-steps", "0"], "--judge-steps: invalid value '0': expected an integer >= 1"),
    (["--guidance=-1"], "--guidance: invalid value '-1': expected a number >= 0"),
    (["--em-steps", "1"], "--em-steps: invalid value '1': expected comma-separated integers >= 2"),
    (["--judge", "missing.pt"], "--judge missing.pt: no such file"),
    (["model.num_classes=0"], "model.num_classes must be >= 2")])
def test_every_bad_option_is_one_line_before_anything_runs(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        sde_quality.main(["--data", str(tmp_path / "d"), "--out", str(tmp_path / "o"), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_the_plan_gives_every_sampler_a_row_before_any_gets_a_second():
    args = sde_quality.parse_args(["--data", "d", "--out", "o"])
    rows = sde_quality.plan_rows(args, 1000)
    groups = {(*g, clip) for clip in ("static", "off") for g in [
        ("ddpm", "em", None), ("ddpm", "pc", None), ("ddpm", "ode", None), ("ddpm", "ddim", 0.0), ("ddpm", "ddim", 1.0),
        ("ddpm", "ddpm", None), ("ve", "em", None), ("ve", "pc", None), ("ve", "ode", None)]}
    key = lambda r: (r["process"], r["sampler"], r.get("eta"), r["clip"])  # noqa: E731
    assert {key(r) for r in rows[:18]} == groups
    assert len(rows) == 2 * (2 * (4 + 4 + 4) + 2 * 4 + 1)
    assert [r["guess"] for r in rows[:18]] == sorted(r["guess"] for r in rows[:18])  # cheapest first in a round
    assert rows[18]["sampler"] == "ddim" and rows[18]["steps"] == 20  # the second round starts cheap again
    # Every sampler but the one-point ancestral gets 3 settings in the first three rounds.
    third = rows[:18 + 16 + 16]
    for group in groups - {("ddpm", "ddpm", None, c) for c in ("static", "off")}:
        assert sum(key(r) == group for r in third) == 3


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
