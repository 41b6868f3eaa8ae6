"""benchmarks.ddp on CPU: torchrun + gloo with 1 and 2 processes of the tiny preset, results and report written."""

import json

from benchmarks import ddp
from conftest import write_beton


def test_ddp_scaling_benchmark_on_cpu(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    write_beton(data / "cifar10_train_raw.beton", 128)
    out = tmp_path / "res"
    rc = ddp.main(["--data", str(data), "--device", "cpu", "--preset", "tiny", "--gpus", "1,2", "--mode", "per-gpu",
                   "data.batch_size=16", "--steps", "6", "--log-every", "2", "--out", str(out)])
    assert rc == 0
    result = json.loads((out / "ddp.json").read_text())
    points = result["points"]["per-GPU"]
    assert [p["nproc"] for p in points] == [1, 2]
    assert [p["global_batch"] for p in points] == [16, 32]
    for p in points:
        assert p["img_per_s"] > 0 and 0 <= p["data_wait_share"] <= 1 and p["mfu_per_gpu"] is None
        assert [s["step"] for s in p["stats"]] == [2, 4, 6]
    assert points[0]["scaling_efficiency"] == 1.0
    assert (out / "ddp.md").read_text().count("\n| ") >= 3 and (out / "ddp.png").stat().st_size > 0
