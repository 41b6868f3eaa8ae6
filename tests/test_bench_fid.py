"""benchmarks.quality.fid end to end on the synthetic CIFAR-shaped data: a trained run's samples scored against the test
split with a randomly initialised Inception (the report says the number is not FID and the data is synthetic);
without the weights file, one clear line; a VE run sampled as VE; every option checked before the reference
statistics; a signal stops it with nothing written."""
from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from benchmarks.quality import fid as fid_cli
from ffcv_ddpm import train as train_mod
from ffcv_ddpm.config import load_config

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_run(data, out, *overrides):
    cfg = load_config("tiny", [f"data.path={data / 'cifar10_train_raw.beton'}", "data.batch_size=8",
                               "data.num_workers=1", "train.device=cpu", "train.precision=fp32",
                               "train.compile=False", "train.progress=False", "train.steps=2", "train.log_every=2",
                               "train.sample_every=0", "train.telemetry=False", f"train.out_dir={out}", *overrides])
    return train_mod.train(cfg)


@pytest.fixture(scope="module")
def run_dir(small_dataset, tmp_path_factory):
    return tiny_run(small_dataset, tmp_path_factory.mktemp("runs"))


def test_fid_of_a_run_on_synthetic_data(small_dataset, small_dataset_arrays, run_dir, tmp_path, capsys):
    # A copy of the test split (and its manifest) of its own: the statistics are cached beside the data, and another
    # test of this worker may have cached them beside small_dataset's first (the tests start in order of cost).
    (tmp_path / "data").mkdir()
    for name in ("cifar10_test_raw.beton", "manifest.json"):
        shutil.copy(small_dataset / name, tmp_path / "data" / name)
    ref = tmp_path / "data" / "cifar10_test_raw.beton"
    common = ["--data", str(ref), "--max-ref", "10", "--random-inception", "0", "--sample-batch", "5", "--out",
              str(tmp_path)]
    assert fid_cli.main([*common, "--run", str(run_dir), "--n", "10", "--sample-steps", "2"]) == 0
    result = json.loads((tmp_path / f"fid-{run_dir.name}-ddim.json").read_text())
    assert result["fid"] > 0 and result["network"] == "random-inception-seed0"
    assert result["samples"] == {"run": str(run_dir), "step": 2, "weights": "EMA", "sampler": "ddim", "steps": 2,
                                 "process": "ddpm", "guidance": None, "n": 10, "seed": 0}
    assert result["reference"]["n"] == 10 and result["reference"]["synthetic"] is True
    assert not result["reference"]["stats_were_cached"]
    md = (tmp_path / f"fid-{run_dir.name}-ddim.md").read_text()
    assert "NOT FID" in md and "SYNTHETIC reference data" in md
    out = capsys.readouterr().out
    assert "NOTE: SYNTHETIC" in out
    # An image set instead of samples (10 train images as PNGs); the reference statistics now from the cache.
    from PIL import Image
    png = tmp_path / "train10"
    png.mkdir()
    for i, im in enumerate(small_dataset_arrays.train.images[:10]):
        Image.fromarray(im).save(png / f"{i + 1}.png")
    assert fid_cli.main([*common, "--images", str(png)]) == 0
    again = json.loads((tmp_path / "fid-train10.json").read_text())
    assert again["reference"]["stats_were_cached"] and again["samples"]["n"] == 10 and again["fid"] > 0


def test_missing_weights_is_one_line(small_dataset, run_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    rc = fid_cli.main(["--data", str(small_dataset / "cifar10_test_raw.beton"), "--run", str(run_dir),
                       "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("fid: error: Inception weights ")
    assert str(tmp_path / "torch" / "hub" / "checkpoints" / "pt_inception-2015-12-05-6726825d.pth") in err[0]
    assert not (tmp_path / "out").exists()


def test_overrides_change_the_run_config_but_not_its_shape(small_dataset, run_dir, tmp_path, capsys):
    common = ["--data", str(small_dataset / "cifar10_test_raw.beton"), "--max-ref", "10", "--random-inception", "0",
              "--sample-batch", "5", "--out", str(tmp_path), "--run", str(run_dir), "--n", "5", "--sample-steps", "1"]
    assert fid_cli.main([*common, "model.attn_impl=math"]) == 0  # same weights, another attention kernel
    assert fid_cli.main([*common, "model.base_channels=64"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit the model" in err[0] and "model.base_channels=64" in err[0]


def test_a_ve_run_is_sampled_as_ve(small_dataset, tmp_path, capsys):
    """load_run builds the run's own process: a VE run is sampled by the VE samplers (predictor-corrector by
    default), never as DDPM; a DDPM-only sampler is refused before the reference statistics are computed."""
    from ffcv_ddpm.evaluate import default_sampler, load_run
    from ffcv_ddpm.sde import VEDiffusion

    ve = tiny_run(small_dataset, tmp_path / "runs", "diffusion.process=ve")
    _, _, process, _ = load_run(ve, "cpu")
    assert isinstance(process, VEDiffusion) and default_sampler(process) == "pc"
    ref = small_dataset / "cifar10_test_raw.beton"
    common = ["--data", str(ref), "--max-ref", "9", "--random-inception", "0", "--sample-batch", "5", "--out",
              str(tmp_path / "out"), "--run", str(ve), "--n", "5", "--sample-steps", "2"]
    cache = list(small_dataset.glob("*-n9-*.npz"))
    assert fid_cli.main([*common, "--sampler", "ddim"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sampler 'ddim' does not sample a diffusion.process=ve run" in err[0]
    assert list(small_dataset.glob("*-n9-*.npz")) == cache  # refused before any statistics
    assert fid_cli.main(common) == 0
    result = json.loads((tmp_path / "out" / f"fid-{ve.name}-pc.json").read_text())
    assert result["samples"]["process"] == "ve" and result["samples"]["sampler"] == "pc" and result["fid"] > 0
    assert fid_cli.main([*common, "diffusion.process=ddpm"]) == 2
    assert "sampled as that process" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--n", "0"], "--n: invalid value '0': expected an integer >= 2"),
    (["--device", "gpu"], "--device: invalid value 'gpu': expected auto, cpu, cuda or cuda:N"),
    (["--sample-batch", "0"], "--sample-batch: invalid value '0': expected an integer >= 1"),
    (["--guidance=-1"], "--guidance: invalid value '-1': expected a number >= 0"),
    (["--sampler", "euler"], "--sampler: invalid value 'euler': expected one of ddpm, ddim, em, pc, ode")])
def test_bad_options_are_one_line_before_anything_runs(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        fid_cli.main(["--data", str(tmp_path / "d.beton"), "--run", str(tmp_path / "run"), "--out",
                      str(tmp_path / "o"), *args])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def test_options_the_run_refuses_fail_before_the_reference_statistics(small_dataset, run_dir, tmp_path, capsys):
    common = ["--data", str(small_dataset / "cifar10_test_raw.beton"), "--max-ref", "11", "--random-inception", "0",
              "--out", str(tmp_path / "o"), "--run", str(run_dir), "--n", "4"]
    cache = list(small_dataset.glob("*-n11-*.npz"))
    assert fid_cli.main([*common, "--sample-steps", "5000"]) == 2
    assert "--sample-steps 5000: at most the run's diffusion.timesteps=1000" in capsys.readouterr().err
    assert fid_cli.main([*common, "--guidance", "1"]) == 2
    assert "is unconditional" in capsys.readouterr().err
    assert list(small_dataset.glob("*-n11-*.npz")) == cache and not (tmp_path / "o").exists()


def test_a_signal_stops_it_with_nothing_written(small_dataset, run_dir, tmp_path, monkeypatch, capsys):
    real = fid_cli.generate

    def generate(*a, **k):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the samples are drawn
        return real(*a, **k)

    monkeypatch.setattr(fid_cli, "generate", generate)
    rc = fid_cli.main(["--data", str(small_dataset / "cifar10_test_raw.beton"), "--max-ref", "10",
                       "--random-inception", "0", "--sample-batch", "5", "--out", str(tmp_path / "o"),
                       "--run", str(run_dir), "--n", "5", "--sample-steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 130 and err == ["fid: stopped by SIGINT during sampling. Kept: nothing."]
    assert not (tmp_path / "o").exists()
