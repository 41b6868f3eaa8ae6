"""train.tensorboard=True: the events hold stats.jsonl's numbers and the sample grids, one history across --resume,
host numbers only; without the package the run stops before its folder exists, in one line."""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ffcv_ddpm import train as train_mod
from ffcv_ddpm.checkpoint import list_checkpoints
from ffcv_ddpm.tblog import TensorBoardLog
from test_train import beton, read_stats, tiny_cfg  # noqa: F401  (beton: the fixture)


def events(run_dir) -> EventAccumulator:
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "images": 0})
    acc.Reload()
    return acc


def scalars(acc: EventAccumulator, tag: str) -> dict[int, float]:
    steps = [e.step for e in acc.Scalars(tag)]
    assert len(steps) == len(set(steps)), f"{tag}: a step logged twice: {steps}"
    return {e.step: e.value for e in acc.Scalars(tag)}


def test_events_hold_the_stats_lines_and_the_sample_grid(beton, tmp_path):  # noqa: F811
    run_dir = train_mod.train(tiny_cfg(beton, tmp_path, "train.tensorboard=True", "train.sample_every=8",
                                       "train.sample_n=4", "train.sample_steps=2"))
    acc, stats = events(run_dir), read_stats(run_dir)
    for key, tag in (("loss", "train/loss"), ("lr", "train/lr"), ("img_per_s", "speed/img_per_s"),
                     ("data_wait_ms", "data/wait_ms"), ("data_wait_share", "data/wait_share")):
        logged = scalars(acc, tag)
        assert sorted(logged) == [s["step"] for s in stats] == [2, 4, 6, 8]
        np.testing.assert_allclose([logged[s["step"]] for s in stats], [s[key] for s in stats], rtol=1e-6)  # fp32
    assert "memory/peak_gib" not in acc.Tags()["scalars"]  # None on the CPU: nothing to plot
    (grid,) = acc.Images("samples")
    with Image.open(run_dir / "samples-00000008.png") as png:
        assert (grid.step, grid.width, grid.height) == (8, *png.size)


def test_a_resumed_run_keeps_one_history(beton, tmp_path):  # noqa: F811
    """Stopped after logging step 6 with the newest checkpoint at step 4: the resumed run logs 6 and 8 again, and
    TensorBoard shows each step once, the resumed run's value (as stats.jsonl keeps it)."""
    run_dir = train_mod.train(tiny_cfg(beton, tmp_path, "train.tensorboard=True"))
    list_checkpoints(run_dir)[-1].unlink()  # as if killed after the stats of step 8, before its checkpoint
    train_mod.train(tiny_cfg(beton, tmp_path, "train.tensorboard=True", f"train.resume={run_dir}"))
    logged = scalars(events(run_dir), "train/loss")
    assert sorted(logged) == [2, 4, 6, 8]
    np.testing.assert_allclose([logged[s["step"]] for s in read_stats(run_dir)],
                               [s["loss"] for s in read_stats(run_dir)], rtol=1e-6)


def test_evaluation_metrics_and_host_numbers_only(tmp_path):
    board = TensorBoardLog(tmp_path)
    board.stats({"step": 5, "loss": 0.5, "fid": 12.5, "cond_acc": 0.9, "peak_mem_gib": None, "wall_s": 3.0,
                 "rank_data_wait_share": [0.25, 0.5]})  # a DDP run's per-rank figures
    for bad in (torch.tensor(0.5), [0.1, torch.tensor(0.5)]):
        with pytest.raises(TypeError, match="host numbers"):
            board.stats({"step": 6, "loss": bad})  # would be read (synced) here
    board.close()
    acc = events(tmp_path)
    assert sorted(acc.Tags()["scalars"]) == ["data/wait_share_of_rank/0", "data/wait_share_of_rank/1", "eval/cond_acc",
                                             "eval/fid", "train/loss"]
    assert scalars(acc, "eval/fid") == {5: 12.5} and scalars(acc, "data/wait_share_of_rank/1") == {5: 0.5}


def test_without_the_package_the_run_stops_before_its_folder(beton, tmp_path, monkeypatch, capsys):  # noqa: F811
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    out = tmp_path / "runs"
    rc = train_mod.main(["--preset", "tiny", "--data", str(beton), "data.batch_size=8", "train.device=cpu",
                         "train.tensorboard=True", f"train.out_dir={out}"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("train: error: train.tensorboard=True needs the tensorboard package") and \
        "pip install tensorboard==" in err[0]
    assert not out.exists() or list(out.iterdir()) == []
