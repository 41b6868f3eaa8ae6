"""GPU telemetry on a machine without one: the off notice, and the sampling/summary code fed by a scripted source."""

import json
import sys
import time

import pytest

from ffcv_ddpm import telemetry
from ffcv_ddpm.telemetry import GpuTelemetry, plot_telemetry, summarize, trapezoid_energy


class Clock:
    """Scripted monotonic time: the source sets it as it hands out each sample."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class Scripted:
    """A SampleSource replaying (t, power W) pairs, then done; an energy counter read at start and stop."""

    name = "Scripted GPU"
    power_kind = "scripted"

    def __init__(self, clock, points, energies=(None, None), fail_after=None):
        self.clock, self.points, self.energies = clock, list(points), list(energies)
        self.fail_after = fail_after
        self.reads = 0
        self.closed = False

    def read(self):
        if self.fail_after is not None and self.reads >= self.fail_after:
            raise OSError("GPU fell off the bus")
        if not self.points:
            return None
        t, watts = self.points.pop(0)
        self.clock.now = t
        self.reads += 1
        return {"power_w": watts, "gpu_util_pct": 50 + self.reads, "mem_util_pct": 10, "mem_used_gib": self.reads / 2,
                "sm_clock_mhz": 1980, "mem_clock_mhz": 2619, "temp_c": 40 + self.reads}

    @property
    def done(self):
        return not self.points

    def energy_j(self):
        return self.energies.pop(0)

    def close(self):
        self.closed = True


POINTS = [(0.0, 100.0), (1.0, 200.0), (2.0, 300.0), (4.0, 200.0)]
TRAPEZOID_J = 150 + 250 + 500  # (100+200)/2*1 + (200+300)/2*1 + (300+200)/2*2


def run_scripted(tmp_path, **kw):
    clock = Clock()
    src = Scripted(clock, POINTS, **kw)
    tel = GpuTelemetry(tmp_path / "run" / "telemetry.jsonl", interval_s=0.001, source=src, clock=clock).start()
    deadline = time.monotonic() + 10
    while not src.done and tel.error is None and time.monotonic() < deadline:
        time.sleep(0.001)
    tel.stop()
    return tel, src


def test_summary_math_through_the_sampling_thread(tmp_path):
    tel, src = run_scripted(tmp_path, energies=(1000.0, 1905.0))
    s = tel.summary(images=90)
    assert s["enabled"] and s["device"] == "Scripted GPU" and s["error"] is None
    assert s["samples"] == 4 and s["duration_s"] == pytest.approx(4.0) and s["sampled_s"] == pytest.approx(4.0)
    assert s["energy_j_trapezoid"] == pytest.approx(TRAPEZOID_J)
    assert s["energy_j_counter"] == pytest.approx(905.0)
    assert s["energy_j"] == pytest.approx(905.0) and s["energy_source"] == "nvml_counter"  # the counter wins
    assert s["j_per_img"] == pytest.approx(905.0 / 90)
    assert s["mean_power_w"] == pytest.approx(TRAPEZOID_J / 4.0)  # time-weighted, not the plain mean (200)
    assert s["mean_power_w_counter"] == pytest.approx(905.0 / 4.0)
    assert s["max_power_w"] == 300.0 and s["max_mem_used_gib"] == 2.0 and s["max_temp_c"] == 44
    assert s["mean_gpu_util_pct"] == pytest.approx(52.5)
    assert src.closed
    # The file holds the same samples, one JSON line each, written as they were taken.
    lines = [json.loads(x) for x in (tmp_path / "run" / "telemetry.jsonl").read_text().splitlines()]
    assert [x["t"] for x in lines] == [0.0, 1.0, 2.0, 4.0] and [x["power_w"] for x in lines] == [100, 200, 300, 200]
    assert all(x["time"] > 1.6e9 for x in lines)
    assert summarize(lines, images=90)["energy_j"] == pytest.approx(TRAPEZOID_J)  # re-derived from the file


def test_without_an_energy_counter_jpi_comes_from_the_trapezoid(tmp_path):
    tel, _ = run_scripted(tmp_path)
    s = tel.summary(images=90)
    assert s["energy_j_counter"] is None and s["energy_source"] == "trapezoid"
    assert s["j_per_img"] == pytest.approx(TRAPEZOID_J / 90)
    assert tel.summary()["j_per_img"] is None  # no image count, no J/img


def test_a_failing_source_ends_sampling_without_raising(tmp_path):
    tel, _ = run_scripted(tmp_path, fail_after=2)
    s = tel.summary(images=10)
    assert s["samples"] == 2 and "GPU fell off the bus" in s["error"]
    assert s["energy_j_trapezoid"] == pytest.approx(150.0)


def test_samples_come_at_the_interval():
    class Endless(Scripted):
        def read(self):
            self.reads += 1
            return {"power_w": 100.0}

    src = Endless(Clock(), [])
    tel = GpuTelemetry("/dev/null", interval_s=0.05, source=src)  # real clock
    with tel:
        time.sleep(0.3)
    n = tel.summary()["samples"]
    assert 3 <= n <= 9, n  # ~6 at 20 Hz plus the final one; a loaded machine can only make it fewer
    assert tel.summary()["mean_power_w"] == pytest.approx(100.0)


def test_trapezoid_restarts_where_t_steps_back():
    # Two sessions appended to one file (a resumed run): no negative-duration slice between them.
    samples = [{"t": 0, "power_w": 100}, {"t": 2, "power_w": 100}, {"t": 0, "power_w": 300}, {"t": 1, "power_w": 300}]
    assert trapezoid_energy(samples) == (pytest.approx(500.0), pytest.approx(3.0))
    assert summarize(samples[:1])["energy_j"] is None and summarize(samples[:1])["mean_power_w"] == 100


def test_no_pynvml_gives_the_notice_and_a_noop(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    path = tmp_path / "telemetry.jsonl"
    with GpuTelemetry(path) as tel:
        pass
    out = capsys.readouterr().out
    assert out.count("no NVIDIA GPU: telemetry off (pynvml not installed") == 1
    s = tel.summary(images=100)
    assert s == {"enabled": False, "reason": tel.reason} and "no NVIDIA GPU" in s["reason"]
    assert not path.exists()


def test_this_machine_without_a_gpu_degrades(tmp_path, capsys):
    try:
        telemetry.NvmlSource(0).close()
        pytest.skip("NVML works here: this is a GPU machine")
    except RuntimeError:
        pass
    tel = GpuTelemetry(tmp_path / "t.jsonl").start()
    tel.stop()
    assert "no NVIDIA GPU: telemetry off (" in capsys.readouterr().out
    assert tel.summary(images=5)["enabled"] is False
    quiet = GpuTelemetry(tmp_path / "t.jsonl", enabled=False, source=Scripted(Clock(), POINTS)).start()
    assert quiet.summary() == {"enabled": False, "reason": "disabled"} and capsys.readouterr().out == ""


def test_plot_and_cli(tmp_path, capsys):
    run_scripted(tmp_path)
    jsonl = tmp_path / "run" / "telemetry.jsonl"
    png = plot_telemetry(jsonl, tmp_path / "t.png", title="scripted")
    assert png.stat().st_size > 10_000
    assert telemetry.main([str(jsonl), "--images", "9"]) == 0
    assert '"j_per_img": 100.0' in capsys.readouterr().out and jsonl.with_suffix(".png").is_file()
    (tmp_path / "bad.jsonl").write_text("not json\n")
    assert telemetry.main([str(tmp_path / "bad.jsonl")]) == 2
    assert "is not a JSON line" in capsys.readouterr().err
    with pytest.raises(ValueError, match="interval_s"):
        GpuTelemetry(tmp_path / "x", interval_s=0)
