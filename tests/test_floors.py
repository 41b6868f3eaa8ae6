"""benchmarks.speed.floors on CPU: the tiny model's compute calls recorded and replayed alone at the step's batch,
the GroupNorm sites' bytes, the table beside a profile's classes, and the ledger's line for it."""

import json
import math

import pytest

from benchmarks import ledger
from benchmarks.speed import floors

ARGS = ["--preset", "tiny", "--iters", "2", "--copy-mib", "8", "data.batch_size=6", "model.image_size=8"]


def test_recorded_calls_scale_with_the_batch_and_weights_do_not():
    import dataclasses

    import torch

    from benchmarks.speed.flops import _inputs
    from ffcv_ddpm.config import load_config
    from ffcv_ddpm.unet import build_model

    cfg = load_config("tiny", ["model.image_size=8"])
    model = build_model(dataclasses.replace(cfg.model, norm_impl="torch"))
    x, t, y = _inputs(cfg.model, floors.RECORD_BATCH, "cpu")
    calls, norms = floors.record(model.train(), (x, t, *([y] if y is not None else [])))
    convs = [c for c in calls if c.cls == "convolution"]
    assert len(convs) == sum(isinstance(m, (torch.nn.Conv2d, torch.nn.ConvTranspose2d)) for m in model.modules())
    assert len(norms) == sum(isinstance(m, torch.nn.GroupNorm) or "GroupNorm" in type(m).__name__
                             for m in model.modules())
    first = convs[0].args  # the image's conv: the input needs no gradient, the weight does
    assert first[0].shape[0] == floors.RECORD_BATCH and not first[0].requires_grad and not first[0].param
    assert first[1].param and first[1].requires_grad
    replay = floors.Replay(convs[:2], 3, torch.device("cpu"), torch.float32)
    assert replay.args[0][0].shape[0] == 3 and replay.args[0][1].shape == first[1].shape
    assert replay.args[0][0].is_contiguous()  # recorded from a contiguous model: replayed so
    # The layout the call saw, reproduced: a channels_last model's convolutions replay channels_last tensors.
    cl = build_model(cfg.model).to(memory_format=torch.channels_last)
    calls_cl, _ = floors.record(cl.train(), (x.contiguous(memory_format=torch.channels_last), t,
                                             *([y] if y is not None else [])))
    again = floors.Replay([c for c in calls_cl if c.cls == "convolution"][1:2], 3, torch.device("cpu"), torch.float32)
    act, weight = again.args[0][:2]
    assert act.is_contiguous(memory_format=torch.channels_last) and not act.is_contiguous()
    assert weight.is_contiguous(memory_format=torch.channels_last)
    assert replay.wrt[0] and all(t.requires_grad for t in replay.wrt[0])
    replay.fwd()
    replay.fwd_bwd()


def test_convolutions_replay_without_their_bias_as_inductor_calls_them():
    import torch

    conv = torch.nn.Conv2d(4, 6, 3, padding=1)
    up = torch.nn.ConvTranspose2d(6, 4, 4, stride=2, padding=1)
    calls, _ = floors.record(torch.nn.Sequential(conv, up), (torch.randn(floors.RECORD_BATCH, 4, 8, 8),))
    assert [c.name for c in calls] == ["conv2d", "conv_transpose2d"]
    assert all(isinstance(c.args[2], floors.TensorSpec) and c.args[2].param for c in calls)  # recorded with bias
    replay = floors.Replay(calls, 3, torch.device("cpu"), torch.float32)
    assert all(a[2] is None for a in replay.args)
    # Gradients: the first conv's weight; the second's input (the first's output) and weight; no bias gradient.
    assert [[tuple(t.shape) for t in w] for w in replay.wrt] == [[(6, 4, 3, 3)], [(3, 6, 8, 8), (6, 4, 4, 4)]]
    assert floors.without_bias([1, 2, 3, 4], {"bias": 5, "stride": 2}) == ([1, 2, None, 4], {"bias": None, "stride": 2})


def test_floors_beside_a_profile_and_in_the_ledger(tmp_path, capsys):
    prof = tmp_path / "prof"
    prof.mkdir()
    classes = {"convolution fwd": 5.0, "convolution bwd": 9.0, "normalization": 3.0, "elementwise/activation": 4.0}
    (prof / "summary.json").write_text(json.dumps({
        "config": {"data": {"batch_size": 6}, "model": {"image_size": 8, "norm_impl": "fused"}},
        "profile": {"classes": [{"class": k, "ms_per_step": v} for k, v in classes.items()]}}))
    out = tmp_path / "results" / "cpu" / "floors"
    assert floors.main([*ARGS, "--out", str(out), "--profile", str(prof)]) == 0
    r = json.loads((out / "floors.json").read_text())
    m = r["measured"]
    assert m["batch"] == 6 and m["copy_gb_per_s"] > 0 and m["cudnn_benchmark"] is True  # the trainer's default
    assert "cuDNN algorithms by timed search" in (out / "floors.md").read_text()
    conv = m["compute"]["convolution"]
    # Both times measured, not compared: two CPU timings order themselves by the machine's load (under a parallel
    # test run the forward alone once took 388 ms and forward + backward 23).
    assert conv["calls"] > 0 and conv["fwd_ms"] > 0 and conv["fwd_bwd_ms"] > 0
    # FLOPs counted on what the replay executes: the backward does the data and weight gradients (less than twice
    # the forward: the image's convolution has no data gradient).
    assert 0 < conv["fwd_flops"] < conv["bwd_flops"] < 2 * conv["fwd_flops"]
    assert conv["fwd_tflops"] == pytest.approx(conv["fwd_flops"] / conv["fwd_ms"] / 1e9)
    norm = m["memory"]["normalization"]
    # One fp32 pass over every GroupNorm input at batch 6: the recorded shapes' elements, scaled from batch 5.
    assert norm["bytes_per_pass"] % (6 * 4) == 0 and norm["floor_ms_8_passes"] == pytest.approx(
        norm["floor_ms_5_passes"] * 8 / 5)
    rows = {row[0]: row for row in r["table"]}
    assert rows["convolution fwd"][1] == "5.00" and float(rows["convolution fwd"][3]) == pytest.approx(
        5.0 - conv["fwd_ms"], abs=0.01)
    assert rows["elementwise/activation"][1:4] == ["4.00", "-", "-"]  # measured in the step, no floor
    assert rows["attention"][1] == "-"  # not in the profile
    together = rows["normalization + elementwise/activation"]  # however the kernels are named: 3 + 4 ms
    assert together[1] == "7.00" and together[2] == rows["normalization"][2]
    assert float((out / "floors.md").read_text().split("Sum of the floors: ")[1].split(" ms")[0]) == pytest.approx(
        sum(float(r[2]) for name, r in rows.items() if r[2] != "-" and " + " not in name), abs=0.02)
    assert "Sum of the floors" in (out / "floors.md").read_text()
    assert ledger.main(["--results", str(tmp_path / "results")]) == 0
    line = next(ln for ln in (tmp_path / "results" / "README.md").read_text().splitlines() if "floors.json" in ln)
    assert "op-class floors" in line and "tiny, batch 6: convolutions alone" in line
    capsys.readouterr()
    # A profile at another batch is refused before anything is measured or written.
    assert floors.main([*ARGS[:-2], "data.batch_size=4", "model.image_size=8", "--out", str(tmp_path / "x"),
                        "--profile", str(prof)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the profile ran at batch 6" in err[0] and not (tmp_path / "x").exists()
    # And one whose model differs (another image size): the override that matches it, named.
    assert floors.main([*ARGS[:-1], "model.image_size=16", "--out", str(tmp_path / "x"), "--profile", str(prof)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pass model.image_size=8" in err[0] and not (tmp_path / "x").exists()
    assert math.isfinite(norm["floor_ms_5_passes"])
