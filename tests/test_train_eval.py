"""train.eval_every: the trainer samples and logs its quality metric into stats.jsonl at the configured steps (the
digits judge's FD-digits + conditional accuracy, or FID), and a metric that cannot run fails before training."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ffcv_ddpm import fid
from ffcv_ddpm import train as train_mod
from ffcv_ddpm.config import load_config
from ffcv_ddpm.quality import save_judge, train_judge

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_cfg(beton: Path, out: Path, *overrides: str):
    return load_config("tiny", [
        f"data.path={beton}", "data.batch_size=8", "data.num_workers=1", "data.loader=gpu", "data.flip=none",
        "train.device=cpu", "train.precision=fp32", "train.compile=False", "train.progress=False",
        "train.steps=6", "train.log_every=2", "train.ckpt_every=100", "train.sample_every=0",
        "train.warmup_steps=1", "train.eval_every=3", "train.eval_n=10", "train.sample_steps=2",
        f"train.out_dir={out}", *overrides])


def stats(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "stats.jsonl").read_text().splitlines()]


def test_judge_metric_logged_at_eval_steps(digits_dataset, tmp_path):
    judge = tmp_path / "judge.pt"
    save_judge(train_judge(digits_dataset / "digits_train_raw.beton", "cpu", steps=5), judge)
    cfg = tiny_cfg(digits_dataset / "digits_train_raw.beton", tmp_path / "runs", "model.num_classes=10",
                   f"train.eval_judge={judge}", f"train.eval_ref={digits_dataset / 'digits_test_raw.beton'}")
    lines = stats(train_mod.train(cfg))
    assert [s["step"] for s in lines] == [2, 4, 6]
    assert cfg.train.eval_every == 4  # rounded up to a multiple of log_every
    evaluated = [s for s in lines if "fd_digits" in s]
    assert [s["step"] for s in evaluated] == [4, 6]  # every eval_every steps, and the last
    for s in evaluated:
        assert s["fd_digits"] > 0 and 0 <= s["cond_acc"] <= 1 and s["eval_n"] == 10 and s["eval_s"] > 0


def test_fid_metric_and_its_missing_weights(small_dataset, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    beton = small_dataset / "cifar10_train_raw.beton"
    ref = tmp_path / "ref"  # a PNG folder of 8 images keeps Inception's CPU time small
    ref.mkdir()
    from PIL import Image
    for i, im in enumerate(fid.read_images(small_dataset / "cifar10_test_raw.beton")[:8]):
        Image.fromarray(im).save(ref / f"{i + 1}.png")
    args = ["--preset", "tiny", "--data", str(beton), "train.device=cpu", "train.compile=False",
            "train.progress=False", "train.steps=2", "train.log_every=2", "train.eval_every=2", "train.eval_n=8",
            "train.sample_steps=2", "data.batch_size=8", "data.num_workers=1", f"train.eval_ref={ref}", f"train.out_dir={tmp_path / 'runs'}"]
    assert train_mod.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(fid.default_weights_path()) in err[0] and "FFCV_DDPM_OFFLINE=1: no download" in err[0]
    assert not (tmp_path / "runs").exists()  # failed at set-up: no run folder
    fid.default_weights_path().parent.mkdir(parents=True)
    torch.save(fid.random_inception_state(0), fid.default_weights_path())
    assert train_mod.main(args) == 0
    (run_dir,) = (tmp_path / "runs").iterdir()
    (line,) = stats(run_dir)
    assert line["fid"] > 0 and line["eval_n"] == 8
