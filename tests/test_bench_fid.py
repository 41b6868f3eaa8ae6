"""benchmarks.fid end to end on the synthetic CIFAR-shaped data: a trained run's samples scored against the test
split with a randomly initialised Inception (the report says the number is not FID and the data is synthetic);
without the weights file, one clear line."""
from __future__ import annotations

import json

import pytest

from benchmarks import fid as fid_cli
from ffcv_ddpm import train as train_mod
from ffcv_ddpm.config import load_config

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def run_dir(small_dataset, tmp_path_factory):
    cfg = load_config("tiny", [f"data.path={small_dataset / 'cifar10_train_raw.beton'}", "data.batch_size=8",
                               "data.num_workers=1", "train.device=cpu", "train.precision=fp32",
                               "train.compile=False", "train.progress=False", "train.steps=2", "train.log_every=2",
                               "train.sample_every=0", f"train.out_dir={tmp_path_factory.mktemp('runs')}"])
    return train_mod.train(cfg)


def test_fid_of_a_run_on_synthetic_data(small_dataset, small_dataset_arrays, run_dir, tmp_path, capsys):
    ref = small_dataset / "cifar10_test_raw.beton"
    common = ["--data", str(ref), "--max-ref", "10", "--random-inception", "0", "--sample-batch", "5", "--out",
              str(tmp_path)]
    assert fid_cli.main([*common, "--run", str(run_dir), "--n", "10", "--sample-steps", "2"]) == 0
    result = json.loads((tmp_path / f"fid-{run_dir.name}-ddim.json").read_text())
    assert result["fid"] > 0 and result["network"] == "random-inception-seed0"
    assert result["samples"] == {"run": str(run_dir), "step": 2, "weights": "EMA", "sampler": "ddim", "steps": 2,
                                 "guidance": None, "n": 10, "seed": 0}
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
