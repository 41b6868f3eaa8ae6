"""benchmarks.quality.race (issue 48 item 4): each side's clock (evaluations taken off it), the threshold table (the
first evaluation that meets a threshold, not interpolated; the ratio only where both sides reach it), the report from
a pair of curves, the PNG folder the peer reads, the trainer's evaluator hook that ends a run at its budget, our side
end to end on the CPU, and the peer for a few steps when denoising-diffusion-pytorch is installed (it is not a
dependency of the project)."""

import importlib.util
import json

import numpy as np
import pytest
from PIL import Image

from benchmarks.quality import race
from ffcv_ddpm.unet import FUSED_OFF

pytestmark = pytest.mark.usefixtures("one_thread")

# Our side at toy size on a CPU (as tests/test_sde_quality.py's TOY: no Triton GroupNorm, no attention).
TOY = ["model.base_channels=8", "model.channel_mult=(1, 2)", "model.num_res_blocks=1", "model.norm_groups=4",
       "diffusion.timesteps=20", "train.device=cpu", "train.precision=fp32", "data.batch_size=8", "train.log_every=2",
       "train.warmup_steps=1", "train.sample_steps=2", "model.norm_impl=scale-shift", *FUSED_OFF,
       "model.attn_resolutions=()"]


def test_clock_takes_each_evaluation_off_and_says_when_time_is_up(tmp_path, monkeypatch):
    # time.time() as the clock reads it: before the measurement, after it, and for the wall time.
    times = iter([110.0, 113.0, 113.0,   # 10 s of training, a 3 s evaluation
                  120.0, 125.0, 125.0,   # 7 s more training (17 on the clock), a 5 s evaluation
                  150.0, 151.0, 151.0])  # 25 s more training: 42 s on the clock
    monkeypatch.setattr(race.time, "time", lambda: next(times))
    clock = race.Clock(launched=100.0, seconds=30.0, max_wall_s=1000.0, curve=tmp_path / "c.jsonl")
    done = [clock.evaluate(step, lambda: {"fd_digits": 5.0}) for step in (10, 20, 30)]
    assert done == [False, False, True]  # past 30 s on the clock at the third
    points = race.read_curve(tmp_path / "c.jsonl")
    assert [p["clock_s"] for p in points] == [10.0, 17.0, 42.0]
    assert [p["eval_s"] for p in points] == [3.0, 5.0, 1.0] and [p["wall_s"] for p in points] == [13.0, 25.0, 51.0]
    assert [p["step"] for p in points] == [10, 20, 30] and all(p["fd_digits"] == 5.0 for p in points)

    times = iter([110.0, 140.0, 140.0])  # 10 s on the clock, but a 30 s evaluation ends past max_wall_s
    clock = race.Clock(launched=100.0, seconds=30.0, max_wall_s=35.0, curve=tmp_path / "w.jsonl")
    assert clock.evaluate(1, lambda: {"fd_digits": 5.0})

    # Intervals of 20 s wall (15 training + 5 evaluating), max_wall_s 50: the second ends at 40, and a third would end
    # at 60, so the side stops at the second (the next interval would be cut by the call's limit and lost).
    times = iter([115.0, 120.0, 120.0, 135.0, 140.0, 140.0])
    clock = race.Clock(launched=100.0, seconds=1000.0, max_wall_s=50.0, curve=tmp_path / "n.jsonl")
    assert [clock.evaluate(step, lambda: {"fd_digits": 5.0}) for step in (1, 2)] == [False, True]


def curve(*points):
    return [{"step": s, "clock_s": t, "eval_s": 1.0, "fd_digits": fd, "cond_acc": 0.5} for s, t, fd in points]


def test_threshold_is_met_at_the_first_evaluation_that_meets_it_and_ratio_only_where_both_reach_it():
    ours = curve((100, 10.0, 9.0), (200, 20.0, 3.0), (300, 30.0, 1.5), (400, 40.0, 2.5))  # 3.0 crosses 8 and 4 at once
    peer = curve((500, 15.0, 7.9), (1000, 50.0, 4.0), (1500, 90.0, 2.2))
    table = {row["threshold"]: row for row in race.race_table({"ours": ours, "peer": peer})}
    assert list(table) == list(race.THRESHOLDS)
    assert table[8.0]["ours"]["step"] == 200 and table[4.0]["ours"]["step"] == 200  # not interpolated to 10-20 s
    assert table[2.0]["ours"]["clock_s"] == 30.0 and table[1.0]["ours"] is None
    assert table[8.0]["peer"]["clock_s"] == 15.0 and table[4.0]["peer"]["clock_s"] == 50.0  # at or below: 4.0 <= 4
    assert table[2.0]["peer"] is None
    assert table[8.0]["ratio"] == 15.0 / 20.0 and table[4.0]["ratio"] == 50.0 / 20.0
    assert table[2.0]["ratio"] is None and table[1.0]["ratio"] is None  # one side or neither reached it
    # The range the intervals leave: at 8 the peer reached it at its first evaluation (open low end), ours crossed
    # after 10 s; at 4 the peer crossed between 15 and 50 s, ours between 10 and 20 s.
    assert table[8.0]["ratio_range"] == [None, 15.0 / 10.0]
    assert table[4.0]["ratio_range"] == [15.0 / 20.0, 50.0 / 10.0] and table[2.0]["ratio_range"] is None


def test_report_from_a_pair_of_curves(tmp_path):
    result = {"command": "python -m benchmarks.quality.race ...", "device": "NVIDIA H100 + NVIDIA H100",
              "sequential": False, "thresholds": list(race.THRESHOLDS), "settings": {"seconds": 240.0, "n": 500},
              "floor": {"n": 500, "fd_digits": 0.16},
              "sides": {"ours": {"curve": curve((200, 20.0, 6.0), (400, 35.0, 1.8)), "summary": "ours, 1.6M",
                                 "status": "done"},
                        "peer": {"curve": curve((500, 30.0, 9.0), (1000, 70.0, 3.5)), "summary": "peer, 1.5M",
                                 "status": "done"}}}
    race.write_report(result, tmp_path)
    saved = json.loads((tmp_path / "race.json").read_text())
    assert [row["ratio"] for row in saved["table"]] == [70.0 / 20.0, 70.0 / 35.0, None, None]
    md = (tmp_path / "race.md").read_text()
    assert "| 8 | 20 s (step 200) | 50.0% | 70 s (step 1,000) | 3.50 (1.50-?) |" in md
    assert "| 2 | 35 s (step 400) | 50.0% | not reached | - |" in md
    assert "| 1 | not reached | - | not reached | - |" in md
    assert "Floor: FD-digits 0.160 (500 held-out real images)" in md and "at once, one GPU each" in md
    with Image.open(tmp_path / "race.png") as png:
        assert png.size[0] > 400


def test_png_folder_one_file_per_image_at_the_datasets_resolution(digits_dataset, tmp_path):
    from ffcv_ddpm.data import read_beton

    images, _ = read_beton(digits_dataset / "digits_train_raw.beton")
    folder = tmp_path / "png"
    assert race.write_png_folder(digits_dataset / "digits_train_raw.beton", folder) == len(images)
    files = sorted(folder.iterdir())
    assert len(files) == len(images) and all(f.suffix == ".png" for f in files)
    for i in (0, len(files) - 1):
        with Image.open(files[i]) as im:
            assert im.mode == "RGB" and im.size == (images.shape[2], images.shape[1])
            assert np.array_equal(np.asarray(im), images[i])  # lossless, in file order


def test_evaluator_hook_stop_ends_the_run_with_a_checkpoint(digits_dataset, tmp_path):
    from ffcv_ddpm.checkpoint import list_checkpoints
    from ffcv_ddpm.config import load_config
    from ffcv_ddpm.step import TrainingError
    from ffcv_ddpm.train import read_stats, train

    calls = []

    def evaluator(model, diffusion):
        calls.append(model.training)
        return {"seen": len(calls), "stop": len(calls) == 2}

    cfg = load_config("tiny", [f"data.path={digits_dataset / 'digits_train_raw.beton'}", "data.batch_size=8",
                               "data.loader=gpu", "train.device=cpu", "train.precision=fp32", "train.progress=False",
                               "train.steps=100", "train.log_every=2", "train.eval_every=2", "train.ckpt_every=100",
                               "train.sample_every=0", f"train.out_dir={tmp_path / 'runs'}"])
    run_dir = train(cfg, evaluator=evaluator)
    lines = read_stats(run_dir)
    assert [line["step"] for line in lines] == [2, 4] and [line["seen"] for line in lines] == [1, 2]
    assert all("stop" not in line for line in lines)
    assert [p.name for p in list_checkpoints(run_dir)] == ["ckpt-00000004.pt"]
    cfg.train.eval_every = 0
    with pytest.raises(TrainingError, match="train.eval_every > 0"):
        train(cfg, evaluator=evaluator)


@pytest.mark.cpu_only  # with a GPU the side trains on it
def test_ours_end_to_end_on_cpu(digits_dataset, tmp_path, capsys):
    out = tmp_path / "race"
    rc = race.main(["--data", str(digits_dataset), "--out", str(out), "--sides", "ours", "--seconds", "1", "--n", "20",
                    "--judge-steps", "3", "--ours-eval-every", "2", *TOY])
    assert rc == 0, capsys.readouterr()
    result = json.loads((out / "race.json").read_text())
    assert result["complete"] and result["sequential"] and result["device"] == "CPU"
    ours = result["sides"]["ours"]
    assert ours["status"] == "done" and ours["params"] > 0 and "DDIM 2" in ours["sampler"]
    (point,) = ours["curve"]  # 1 s of clock is spent before the first evaluation (start-up counts)
    assert point["step"] == 2 and point["clock_s"] >= 1.0 and point["eval_s"] > 0 and 0 <= point["cond_acc"] <= 1
    assert point["fd_digits"] > 0 and point["wall_s"] >= point["clock_s"] + point["eval_s"]
    assert all(row["ratio"] is None for row in result["table"]) and "peer" not in result["sides"]
    assert (out / "race.md").is_file() and (out / "race.png").is_file()


def test_peer_a_few_steps_on_cpu(digits_dataset, tmp_path):
    if importlib.util.find_spec("denoising_diffusion_pytorch") is None:  # not imported here: torchvision first
        pytest.skip("the peer's wheels (.peer-wheels/) are not installed")
    from benchmarks.quality import peer_ddpm
    from ffcv_ddpm.quality import save_judge, train_judge

    judge = tmp_path / "judge.pt"
    save_judge(train_judge(digits_dataset / "digits_train_raw.beton", "cpu", steps=3), judge)
    race.write_png_folder(digits_dataset / "digits_train_raw.beton", tmp_path / "png")
    curve_path = tmp_path / "peer.jsonl"
    rc = peer_ddpm.main(["--images", str(tmp_path / "png"),
                         "--test-beton", str(digits_dataset / "digits_test_raw.beton"),
                         "--judge", str(judge), "--curve", str(curve_path), "--seconds", "0.1", "--n", "10",
                         "--eval-every", "2", "--batch", "16", "--dim", "8", "--dim-mults", "1,2", "--precision", "no",
                         "--sampling-steps", "3", "--train-seed", "5", "--work", str(tmp_path / "work")])
    assert rc == 0
    (point,) = race.read_curve(curve_path)
    assert point["step"] == 2 and point["fd_digits"] > 0 and point["eval_s"] > 0
    info = json.loads((tmp_path / "peer-info.json").read_text())
    assert info["params"] > 0 and info["sampler"] == "DDIM eta 0, 3 steps" and info["package"]["ema-pytorch"]
    assert info["train_seed"] == 5 and "training seed 5" in info["summary"]
