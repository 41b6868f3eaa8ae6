"""GPU power, utilisation, memory, clocks and temperature, sampled through NVML in a background thread.

    tel = GpuTelemetry(run_dir / "telemetry.jsonl", device_index=0).start()
    ...training loop...
    tel.stop()
    stats["telemetry"] = tel.summary(images=steps * batch_size)     # energy J, J/img, mean/max power, ...
    plot_telemetry(run_dir / "telemetry.jsonl", run_dir / "telemetry.png")

    python -m ffcv_ddpm.telemetry runs/00003-ddpm-cifar10/telemetry.jsonl [--images N]   # summary + PNG afterwards

One JSON line per sample, appended as it is taken (a resumed run or several measured blocks share a file; `t`
restarts at 0 in each, `time` is the wall clock). Energy is reported two ways: NVML's total-energy counter read at
start and stop (exact, Volta and newer) and the trapezoid over the power samples (any GPU); J/img uses the counter
when the GPU has one. Without pynvml, an NVIDIA driver or a GPU, the object prints one notice
("no NVIDIA GPU: telemetry off (...)") and does nothing; nothing here ever raises into the training loop.

Cost: each sample is seven NVML queries (ctypes calls that release the GIL, tens of microseconds each) and one
buffered line, ten times a second by default, on a thread that sleeps otherwise. benchmarks/speed/profile.py measures
the loop with and without it.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Protocol

from ffcv_ddpm.checks import SINGLE_FILE_HELP, Parser, fail

# What a sample holds besides its timestamps, in the order the JSONL lines and the plot use.
FIELDS = ("power_w", "gpu_util_pct", "mem_util_pct", "mem_used_gib", "sm_clock_mhz", "mem_clock_mhz", "temp_c")


class SampleSource(Protocol):
    """Where samples come from: NVML on a GPU, a scripted list in tests."""

    name: str  # the device, as shown in summaries and plots
    power_kind: str  # what power_w means (an instantaneous reading or a running average)

    def read(self) -> dict | None:
        """One sample: FIELDS -> number (or None where the GPU does not report it); None when the source is done."""

    def energy_j(self) -> float | None:
        """Energy the device has used since some fixed point (a counter), or None if it has no counter."""

    def close(self) -> None: ...


class NvmlSource:
    """Reads one GPU through NVML. Raises RuntimeError with the reason when NVML or the GPU is not there."""

    def __init__(self, device_index: int = 0):
        try:
            import pynvml
        except ImportError:
            raise RuntimeError("pynvml not installed; pip install nvidia-ml-py") from None
        self.nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:  # LibraryNotFound / DriverNotLoaded / NoPermission ...
            raise RuntimeError(f"NVML not usable: {e}") from None
        try:
            count = pynvml.nvmlDeviceGetCount()
            if count == 0:
                raise RuntimeError("NVML sees no GPU")
            if not 0 <= device_index < count:
                raise RuntimeError(f"device index {device_index} out of range: NVML sees {count} GPU(s)")
            self.handle = _handle(pynvml, device_index)
            name = pynvml.nvmlDeviceGetName(self.handle)
            self.name = name.decode() if isinstance(name, bytes) else name
        except (pynvml.NVMLError, RuntimeError) as e:
            pynvml.nvmlShutdown()
            raise RuntimeError(str(e)) from None
        # Since Ampere (GA100 aside) nvmlDeviceGetPowerUsage is a 1 s running average; the instantaneous field
        # (newer drivers) follows the 100 ms samples better. Use it where the driver has it.
        self._instant = self._field_power() is not None
        self.power_kind = ("instantaneous (NVML_FI_DEV_POWER_INSTANT)" if self._instant
                           else "nvmlDeviceGetPowerUsage (a 1 s average on Ampere and newer)")
        self._has_energy = self.energy_j() is not None

    def _field_power(self) -> float | None:
        nv = self.nvml
        try:
            v = nv.nvmlDeviceGetFieldValues(self.handle, [nv.NVML_FI_DEV_POWER_INSTANT])[0]
        except (nv.NVMLError, AttributeError):
            return None
        if v.nvmlReturn != nv.NVML_SUCCESS:
            return None
        return v.value.uiVal / 1e3  # mW

    def _query(self, fn: Callable, *args):
        # One unsupported query (e.g. memory clock on some cards) blanks its field, not the sample.
        try:
            return fn(self.handle, *args)
        except self.nvml.NVMLError:
            return None

    def read(self) -> dict:
        nv = self.nvml
        power = self._field_power() if self._instant else None
        if power is None:
            mw = self._query(nv.nvmlDeviceGetPowerUsage)
            power = None if mw is None else mw / 1e3
        util = self._query(nv.nvmlDeviceGetUtilizationRates)
        mem = self._query(nv.nvmlDeviceGetMemoryInfo)
        return {
            "power_w": power,
            "gpu_util_pct": None if util is None else util.gpu,
            "mem_util_pct": None if util is None else util.memory,
            "mem_used_gib": None if mem is None else mem.used / 2**30,
            "sm_clock_mhz": self._query(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_SM),
            "mem_clock_mhz": self._query(nv.nvmlDeviceGetClockInfo, nv.NVML_CLOCK_MEM),
            "temp_c": self._query(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU),
        }

    def energy_j(self) -> float | None:
        if getattr(self, "_has_energy", True) is False:
            return None
        mj = self._query(self.nvml.nvmlDeviceGetTotalEnergyConsumption)  # mJ since the driver loaded; Volta+
        return None if mj is None else mj / 1e3

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


def _handle(pynvml, device_index: int):
    """The NVML handle of CUDA device `device_index`: NVML numbers GPUs by PCI order and ignores
    CUDA_VISIBLE_DEVICES, CUDA does neither, so match by UUID when this process already uses CUDA."""
    try:
        import torch

        if torch.cuda.is_initialized():
            uuid = str(torch.cuda.get_device_properties(device_index).uuid)
            return pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
    except Exception:  # an older torch without .uuid, a MIG slice NVML won't resolve: fall back to the index
        pass
    return pynvml.nvmlDeviceGetHandleByIndex(device_index)


class GpuTelemetry:
    """Samples `source` (NVML by default) every `interval_s` on a daemon thread, appending JSON lines to `path`.

    Use as `with GpuTelemetry(path) as tel:` or `tel = GpuTelemetry(path).start(); ...; tel.stop()`. When no GPU
    can be read (or enabled=False) every method is a no-op and summary() says why.
    """

    def __init__(self, path, interval_s: float = 0.1, device_index: int = 0, *, enabled: bool = True,
                 source: SampleSource | None = None, clock: Callable[[], float] = time.monotonic):
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s} must be > 0 (seconds between samples)")
        self.path = Path(path)
        self.interval_s = interval_s  # seconds between samples
        self.clock = clock  # monotonic seconds; injectable so tests can script time
        self.samples: list[dict] = []  # this session's samples (the file may hold earlier sessions too)
        self.error: str | None = None  # why sampling stopped early, if it did
        self.reason: str | None = None  # why telemetry is off, if it is
        self.source = source if enabled else None
        if not enabled:
            self.reason = "disabled"
        elif source is None:
            try:
                self.source = NvmlSource(device_index)
            except RuntimeError as e:
                self.reason = f"no NVIDIA GPU: telemetry off ({e})"
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._file = None
        self._t0 = self._t_end = None
        self._e0 = self._e_end = None

    @property
    def enabled(self) -> bool:
        return self.source is not None

    def start(self) -> "GpuTelemetry":
        if not self.enabled:
            if self.reason != "disabled":
                print(self.reason, flush=True)
            return self
        if self._thread is not None:
            raise RuntimeError("GpuTelemetry.start() called twice; make a new one per measured block")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")
        self._e0 = self.source.energy_j()
        self._t0 = self.clock()
        self._thread = threading.Thread(target=self._run, name="gpu-telemetry", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        next_t = time.monotonic()
        while not self._stop.is_set():
            if not self._sample():
                return
            next_t = max(next_t + self.interval_s, time.monotonic())  # a slow query delays, never bunches, samples
            self._stop.wait(next_t - time.monotonic())

    def _sample(self) -> bool:
        """Take and write one sample; False when the source is done or failed (sampling ends, training goes on)."""
        try:
            values = self.source.read()
            if values is None:
                return False
            sample = {"t": round(self.clock() - self._t0, 6), "time": round(time.time(), 3), **values}
            self.samples.append(sample)
            self._file.write(json.dumps(sample) + "\n")
            self._file.flush()  # a crashed run keeps what was sampled
            return True
        except Exception as e:  # NVML gone (GPU fell off the bus), disk full: stop sampling, not training
            self.error = f"{type(e).__name__}: {e}"
            return False

    def stop(self) -> "GpuTelemetry":
        """Stop the thread, take a last sample (so the record spans the whole block) and close the file."""
        if self._thread is None or self._t_end is not None:
            return self
        self._stop.set()
        self._thread.join()
        if self.error is None:
            self._sample()
        self._t_end = self.clock()
        self._e_end = self.source.energy_j()
        self._file.close()
        self.source.close()
        return self

    def __enter__(self) -> "GpuTelemetry":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def summary(self, images: int | None = None) -> dict:
        """Energy (counter and trapezoid), J/img if `images` given, power, utilisation, memory, clocks, temperature."""
        if not self.enabled:
            return {"enabled": False, "reason": self.reason}
        counter = None
        if self._e0 is not None and self._e_end is not None:
            counter = self._e_end - self._e0
        out = {"enabled": True, "device": self.source.name, "power_kind": self.source.power_kind,
               "interval_s": self.interval_s, "path": str(self.path), "error": self.error}
        out = {**out, **summarize(list(self.samples), energy_counter_j=counter, images=images)}
        if self._t0 is not None:
            end = self._t_end if self._t_end is not None else self.clock()
            out["duration_s"] = end - self._t0
            # The counter covers start..stop exactly; the samples' mean may miss the edges of a short block.
            known = counter is not None and end > self._t0
            out["mean_power_w_counter"] = counter / out["duration_s"] if known else None
        return out


def _values(samples: list[dict], key: str) -> list[float]:
    return [s[key] for s in samples if s.get(key) is not None]


def trapezoid_energy(samples: list[dict]) -> tuple[float | None, float]:
    """(joules, seconds covered) from power samples; a step back in `t` starts a new segment (appended sessions)."""
    points = [(s["t"], s["power_w"]) for s in samples if s.get("power_w") is not None]
    if len(points) < 2:
        return None, 0.0
    energy = span = 0.0
    for (t0, p0), (t1, p1) in zip(points, points[1:]):
        if t1 > t0:
            energy += (t1 - t0) * (p0 + p1) / 2
            span += t1 - t0
    return energy, span


def summarize(samples: list[dict], energy_counter_j: float | None = None, images: int | None = None) -> dict:
    """Figures from samples (as written to the JSONL); J/img from the counter when given, else the trapezoid."""
    trapz, span = trapezoid_energy(samples)
    energy = energy_counter_j if energy_counter_j is not None else trapz
    power = _values(samples, "power_w")
    out = {
        "samples": len(samples),
        "sampled_s": span,
        "energy_j_counter": energy_counter_j,
        "energy_j_trapezoid": trapz,
        "energy_j": energy,
        "energy_source": None if energy is None else ("nvml_counter" if energy_counter_j is not None else "trapezoid"),
        # Time-weighted (samples need not be evenly spaced); one sample is its own mean.
        "mean_power_w": trapz / span if span > 0 else (power[0] if power else None),
        "max_power_w": max(power) if power else None,
        "images": images,
        "j_per_img": energy / images if energy is not None and images else None,
    }
    for key, name, fn in (("gpu_util_pct", "mean_gpu_util_pct", _mean), ("mem_util_pct", "mean_mem_util_pct", _mean),
                          ("mem_used_gib", "max_mem_used_gib", max), ("sm_clock_mhz", "mean_sm_clock_mhz", _mean),
                          ("mem_clock_mhz", "mean_mem_clock_mhz", _mean), ("temp_c", "max_temp_c", max)):
        vals = _values(samples, key)
        out[name] = fn(vals) if vals else None
    return out


def _mean(vals: list[float]) -> float:
    return sum(vals) / len(vals)


def read_jsonl(path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"telemetry file {path} not found")
    samples = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            samples.append(json.loads(line))
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{i} is not a JSON line; expected a file written by GpuTelemetry") from None
    if not samples:
        raise ValueError(f"{path} holds no samples (telemetry was off or the run stopped at once)")
    return samples


def plot_telemetry(jsonl_path, png_path, title: str | None = None) -> Path:
    """Power (+ temperature), utilisation, memory used and clocks over wall time, one panel each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = read_jsonl(jsonl_path)
    # Wall time, not `t`: blocks appended to one file (resumes, measured blocks) line up with their gaps, and a
    # NaN point at each gap keeps the lines from bridging time when nothing was sampled.
    t0 = samples[0].get("time", samples[0]["t"])
    times = [s.get("time", s["t"]) - t0 for s in samples]
    steps = sorted(b - a for a, b in zip(times, times[1:]))
    gap = max(1.0, 10 * steps[len(steps) // 2]) if steps else 1.0
    x, rows = [], []
    for i, (t, s) in enumerate(zip(times, samples)):
        if i and t - times[i - 1] > gap:
            x.append(float("nan"))
            rows.append({})
        x.append(t)
        rows.append(s)

    def series(key):
        return [s.get(key) if s.get(key) is not None else float("nan") for s in rows]

    fig, axes = plt.subplots(4, 1, figsize=(10, 9), sharex=True)
    panels = (("power (W)", (("power_w", "power"),)),
              ("utilisation (%)", (("gpu_util_pct", "GPU (kernel running)"), ("mem_util_pct", "memory bus"))),
              ("memory used (GiB)", (("mem_used_gib", "device memory used"),)),
              ("clock (MHz)", (("sm_clock_mhz", "SM"), ("mem_clock_mhz", "memory"))))
    for ax, (label, keys) in zip(axes, panels):
        for key, name in keys:
            ax.plot(x, series(key), label=name, lw=1)
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend(loc="best", fontsize=8)
    temp = axes[0].twinx()
    temp.plot(x, series("temp_c"), color="tab:red", lw=0.8, alpha=0.6)
    temp.set_ylabel("temperature (C)", color="tab:red")
    axes[1].set_ylim(0, 105)
    axes[-1].set_xlabel("seconds")
    s = summarize(samples)
    energy = f", {s['energy_j_trapezoid']:.0f} J (trapezoid)" if s["energy_j_trapezoid"] is not None else ""
    mean = f"mean {s['mean_power_w']:.0f} W" if s["mean_power_w"] is not None else "no power readings"
    fig.suptitle((title + "\n" if title else "") + f"{len(samples)} samples, {mean}{energy}", fontsize=10)
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m ffcv_ddpm.telemetry",
               doc="Summarise and plot a telemetry.jsonl written by GpuTelemetry.\n\n"
                   "    python -m ffcv_ddpm.telemetry runs/00000-ddpm-cifar10/telemetry.jsonl --images 512000",
               epilog=SINGLE_FILE_HELP)
    p.add_argument("jsonl", type=Path, help="telemetry file (e.g. runs/<id>/telemetry.jsonl)")
    p.add_argument("--images", type=int, help="images trained while sampling, for J/img")
    p.add_argument("--png", type=Path, help="plot path (default: the JSONL's path with .png)")
    args = p.parse_args(argv)
    try:
        summary = summarize(read_jsonl(args.jsonl), images=args.images)
        png = plot_telemetry(args.jsonl, args.png or args.jsonl.with_suffix(".png"))
    except (FileNotFoundError, ValueError, KeyError) as e:
        return fail("telemetry", str(e))
    print(json.dumps(summary, indent=2))
    print(f"telemetry: wrote {png} (energy from the samples' trapezoid; the live summary also has NVML's counter)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
