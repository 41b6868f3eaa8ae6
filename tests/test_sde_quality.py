"""benchmarks.sde_quality end to end on CPU at toy size: two betons, a fake judge standing in for ffcv_ddpm.quality
(issue 14's module; only its interface is used), both models trained a few steps, every sampler row measured."""

import json
import sys
import types

import numpy as np
import pytest
import torch

from benchmarks import sde_quality
from conftest import write_beton


def fake_quality_module() -> types.ModuleType:
    """The ffcv_ddpm.quality interface with a judge that needs no training: 4x4 mean-pooled grey levels as features,
    the mean brightness bucket as the class."""
    from scipy import linalg

    class Judge:
        def features(self, images_u8):
            grey = images_u8.float().mean(1, keepdim=True) / 255  # (N, 1, 32, 32)
            return torch.nn.functional.avg_pool2d(grey, 8).flatten(1)  # (N, 16)

        def predict(self, images_u8):
            return (images_u8.float().mean((1, 2, 3)) / 25.6).long().clamp(0, 9)

    def frechet_distance(a, b):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        ca, cb = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
        covmean = linalg.sqrtm(ca @ cb).real
        return float(((a.mean(0) - b.mean(0)) ** 2).sum() + np.trace(ca + cb - 2 * covmean))

    def evaluate_samples(judge, images_u8, labels, reference_images_u8):
        assert images_u8.dtype == torch.uint8 and images_u8.shape[1:] == (3, 32, 32)
        fd = frechet_distance(judge.features(images_u8).numpy(), judge.features(reference_images_u8).numpy())
        acc = None if labels is None else float((judge.predict(images_u8) == labels).float().mean())
        return {"fd_digits": fd, "cond_acc": acc, "n": len(images_u8)}

    module = types.ModuleType("ffcv_ddpm.quality")
    module.Judge, module.frechet_distance, module.evaluate_samples = Judge, frechet_distance, evaluate_samples
    module.train_judge = lambda train_beton, device, steps=10, seed=0: Judge()
    module.load_judge = lambda path, device: Judge()
    module.save_judge = lambda judge, path: None
    return module


@pytest.fixture
def digits_like(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ffcv_ddpm.quality", fake_quality_module())
    data = tmp_path / "data"
    data.mkdir()
    write_beton(data / "toy_train_raw.beton", 48, seed=1)
    write_beton(data / "toy_test_raw.beton", 24, seed=2)
    return data


TOY = ["--steps", "4", "--n", "16", "--ddim-steps", "2", "--em-steps", "3", "--pc-steps", "2", "--ode-tols", "0.1",
       "model.base_channels=8", "model.channel_mult=(1, 2)", "model.num_res_blocks=1", "model.norm_groups=4",
       "model.attn_heads=2", "diffusion.timesteps=20", "train.device=cpu", "train.precision=fp32",
       "data.batch_size=8", "data.num_workers=1", "train.log_every=2", "train.warmup_steps=1"]


def test_every_sampler_row_of_both_processes(digits_like, tmp_path):
    out = tmp_path / "out"
    assert sde_quality.main(["--data", str(digits_like), "--out", str(out), *TOY]) == 0
    result = json.loads((out / "sde_quality.json").read_text())
    assert result["complete"] and not result["skipped"]
    nfe = {(r["process"], r["sampler"]): r["nfe"] for r in result["rows"]}
    assert {k: v for k, v in nfe.items() if k[1] != "ode"} == {
        ("ddpm", "em"): 3, ("ve", "em"): 3, ("ddpm", "pc"): 4, ("ve", "pc"): 4, ("ddpm", "ddim"): 2,
        ("ddpm", "ddpm"): 20}
    assert nfe[("ddpm", "ode")] > 5 and nfe[("ve", "ode")] > 5
    for r in result["rows"]:
        assert r["img_per_s"] > 0 and np.isfinite(r["fd_digits"]) and 0 <= r["cond_acc"] <= 1
    assert result["models"]["ve"]["config"]["diffusion"]["process"] == "ve"
    assert result["reference"]["floor_n"] == 16 and result["reference"]["judge_test_acc"] is not None
    md = (out / "sde_quality.md").read_text()
    assert md.count("\n| ve |") == 3 and md.count("\n| ddpm |") == 5 and "rtol=atol=0.1" in md
    # tools.atomic's writer lock (.writer-<pid>.lock) stays until this process exits: not an output.
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(".writer-")) == [
        "samples-ddpm.png", "samples-ve.png", "sde_quality.json", "sde_quality.md", "sde_quality.png"]


def test_rows_past_the_budget_are_listed_not_run(digits_like, tmp_path):
    out = tmp_path / "out"
    assert sde_quality.main(["--data", str(digits_like), "--out", str(out), *TOY, "--budget-s", "0"]) == 0
    result = json.loads((out / "sde_quality.json").read_text())
    assert result["rows"] == [] and len(result["skipped"]) == 8
    assert "Not run (time budget 0 s): ddpm/ddim/2, ddpm/em/3," in (out / "sde_quality.md").read_text()  # cheapest first


def test_a_folder_without_the_betons_is_one_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ffcv_ddpm.quality", fake_quality_module())
    assert sde_quality.main(["--data", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "*_train_raw.beton" in err and "SOURCE=digits" in err


def test_the_plan_gives_every_sampler_a_row_before_any_gets_a_second():
    args = sde_quality.parse_args(["--data", "d", "--out", "o"])
    rows = sde_quality.plan_rows(args, 1000)
    groups = {("ddpm", "em"), ("ddpm", "pc"), ("ddpm", "ode"), ("ddpm", "ddim"), ("ddpm", "ddpm"),
              ("ve", "em"), ("ve", "pc"), ("ve", "ode")}
    assert {(r["process"], r["sampler"]) for r in rows[:8]} == groups
    assert len(rows) == 2 * (4 + 4 + 4) + 4 + 1
    assert [r["guess"] for r in rows[:8]] == sorted(r["guess"] for r in rows[:8])  # cheapest first in a round
    assert rows[8]["sampler"] == "ddim" and rows[8]["steps"] == 20  # the second round starts cheap again
