"""The loader-alone benchmark runs end to end on CPU (quick mode) and reports every figure it promises."""

import json
import math

import pytest
from conftest import SMALL_TRAIN, write_png_folder

from benchmarks.speed.loaders import QUICK, QUICK_VARIANTS, main

# libffcv/ffcv#167: numba's finalizer complains when a discarded FFCV Loader is garbage-collected; harmless.
pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <finalize object:pytest.PytestUnraisableExceptionWarning")


def test_quick_mode_writes_json_markdown_and_plot(small_dataset, small_dataset_arrays, tmp_path):
    png = write_png_folder(tmp_path / "png", small_dataset_arrays, with_test=False)
    out = tmp_path / "out"
    assert main(["--data", str(small_dataset), "--png-dir", str(png / "train"), "--out", str(out), "--quick"]) == 0

    result = json.loads((out / "loaders.json").read_text())
    assert result["dataset"]["synthetic"] is True and result["dataset"]["source"] == "synthetic"
    assert result["environment"]["torch"] and result["environment"]["cpu_count"] >= 1 and result["device"]
    measured = [r for r in result["rows"] if "skipped" not in r]
    assert {r["name"] for r in measured} == set(QUICK_VARIANTS)
    for row in measured:
        assert math.isfinite(row["img_s_median"]) and row["img_s_median"] > 0
        assert row["first_epoch_s"] > 0 and row["setup_s"] >= 0
        assert len(row["steady_img_s"]) == QUICK["epochs"]
        assert row["images_per_epoch"] == SMALL_TRAIN // QUICK["batch_size"] * QUICK["batch_size"]
    # FFCV has no 0-worker mode: its 0 row is reported as skipped, not silently dropped
    assert any(r["loader"] == "ffcv" and r["workers"] == 0 and "skipped" in r for r in result["rows"])
    # torch loaders at every worker count of the quick sweep; the GPU-resident one once, without workers
    assert sorted(r["workers"] for r in measured if r["loader"] == "torch-memory") == [0, 1]
    assert [r["workers"] for r in measured if r["loader"] == "gpu"] == [None]

    markdown = (out / "loaders.md").read_text()
    assert all(f"| {name} |" in markdown for name in QUICK_VARIANTS) and "synthetic" in markdown
    assert (out / "loaders.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_missing_png_folder_skips_the_torch_files_rows(small_dataset, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--data", str(small_dataset), "--out", str(out), "--quick", "--loaders", "torch-files,gpu"]
    assert main(argv) == 0
    rows = json.loads((out / "loaders.json").read_text())["rows"]
    files = [r for r in rows if r["loader"] == "torch-files"]
    assert files and all("--export-png" in r["skipped"] for r in files)
    assert "PNG folder" in capsys.readouterr().out and "Skipped" in (out / "loaders.md").read_text()


def test_bad_data_is_a_clear_error_not_a_traceback(small_dataset, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:  # refused with the arguments
        main(["--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out"), "--quick"])
    assert e.value.code == 2 and "make dataset" in capsys.readouterr().err
    assert main(["--data", str(small_dataset), "--out", str(tmp_path / "out"), "data.batch_size=100000"]) == 2
    assert "lower data.batch_size" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_run_cut_mid_sweep_keeps_the_rows_it_measured(small_dataset, tmp_path, monkeypatch):
    # A time limit (here: the third measurement raising) must leave the JSON of the rows before it, marked incomplete.
    from benchmarks.speed import loaders

    real, calls = loaders.measure, []

    def measure(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt  # what `timeout` amounts to: the process stops mid-sweep
        return real(*a, **k)

    monkeypatch.setattr(loaders, "measure", measure)
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        main(["--data", str(small_dataset), "--out", str(out), "--quick", "--loaders", "torch-memory,gpu"])
    result = json.loads((out / "loaders.json").read_text())
    assert not result["complete"] and len([r for r in result["rows"] if "skipped" not in r]) == 2
    assert "INCOMPLETE" in loaders.render_markdown(result)
