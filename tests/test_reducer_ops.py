"""benchmarks.speed.reducer_ops on CPU (2 gloo ranks, the tiny preset): what DDP's reducer adds per gradient."""

import json
import shutil

from benchmarks import ledger
from benchmarks.speed import reducer_ops


def test_ddp_adds_one_multiply_per_gradient_that_the_flat_all_reduce_does_not(tmp_path):
    """NOTES item 19's reading of DDP's reducer, counted: with .grad set to None before each backward (as the trainer's
    optimizer leaves it) DDP multiplies each gradient into its bucket with an op of its own; the flat path adds
    views and one cat, no per-gradient arithmetic. Fails if a torch release changes either."""
    assert reducer_ops.main(["--preset", "tiny", "--out", str(tmp_path), "model.image_size=8"]) == 0
    result = json.loads((tmp_path / "reducer_ops.json").read_text())
    params = result["params"]
    extra = result["ddp_minus_flat"]["aten_ops"]
    assert params > 10 and extra["aten::mul"] == params
    assert result["counts"]["flat"]["aten_ops"]["aten::cat"] >= 1
    assert all(v > 0 for k, v in extra.items() if k in ("aten::mul", "aten::copy_"))
    assert "| aten::mul |" in (tmp_path / "reducer_ops.md").read_text()
    # The results ledger lists it, its headline read from the file.
    root = tmp_path / "results"
    (root / "cpu" / "reducer-ops").mkdir(parents=True)
    shutil.copy(tmp_path / "reducer_ops.json", root / "cpu" / "reducer-ops")
    assert ledger.main(["--results", str(root)]) == 0
    page = (root / "README.md").read_text()
    assert f"tiny, {params} parameters, cpu: DDP adds aten::mul +{params}, " in page
