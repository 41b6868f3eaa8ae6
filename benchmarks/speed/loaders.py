"""Loader alone: images/s each data loader delivers onto the device, over a sweep of worker counts.

    python -m benchmarks.speed.loaders --data data                             # -> benchmarks/results/<card>/
    python -m benchmarks.speed.loaders --data data --workers 1,4,16 data.batch_size=512 --epochs 3 --out DIR
    python -m benchmarks.speed.loaders --data data --quick                     # CPU / CI-sized data: seconds

Variants (ffcv_ddpm.data loaders). The FFCV baseline is RANDOM order, os_cache on, flip on the device after the
copy; each other FFCV row changes one thing: the flip inside the pipeline, os_cache off, or QUASI_RANDOM (with
os_cache off, the only case it is meant for). Then a torch DataLoader over in-memory arrays and over PNG files (PIL
decode per image), and the GPU-resident tensor (no workers).

Per variant and worker count: setup (constructing the loader: torch-memory and gpu-resident read the whole .beton
here), the first epoch (FFCV compiles its pipeline with numba on first use) and `--epochs` steady-state epochs.
An epoch is timed from the first batch request to the last batch ready on the device: on CUDA one synchronize at the
end of the epoch, none per batch. The loop keeps a reference to each batch and does nothing else, except that rows
whose flip is "gpu" run the device flip, the work the CPU-flip rows move into the loader.

Writes under --out: loaders.json (every figure + environment + dataset source/synthetic flag), loaders.md (tables),
loaders.png (images/s vs workers, one line per variant).
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from benchmarks.common import (DEVICE_HELP, BenchError, commit_text, pyplot, results_out, save_figure, write_json,
                               write_text)
from ffcv_ddpm import stopping
from ffcv_ddpm.checks import Parser, at_least, fail, int_list, option
from ffcv_ddpm.data import DataConfig, dataset_info, flip_images, make_loader, missing_input
from ffcv_ddpm.env import environment
from ffcv_ddpm.step import TrainingError, resolve_device
from ffcv_ddpm.timing import sync


@dataclass(frozen=True)
class Variant:
    name: str              # row label in the tables and plot
    loader: str            # DataConfig.loader
    beton: str = "raw"     # raw | jpg: which train .beton (torch-files reads the PNG folder instead)
    order: str = "random"  # DataConfig.order
    os_cache: bool = True  # DataConfig.os_cache (FFCV only)
    flip: str = "gpu"      # DataConfig.flip: "gpu" rows flip on the device inside the timed loop

    @property
    def uses_workers(self) -> bool:
        return self.loader != "gpu"


VARIANTS = tuple(
    v for fmt in ("raw", "jpg") for v in (
        Variant(f"ffcv-{fmt}", "ffcv", fmt),
        Variant(f"ffcv-{fmt} cpu-flip", "ffcv", fmt, flip="cpu"),
        Variant(f"ffcv-{fmt} no-os-cache", "ffcv", fmt, os_cache=False),
        Variant(f"ffcv-{fmt} no-os-cache quasi-random", "ffcv", fmt, order="quasi_random", os_cache=False),
    )
) + (
    Variant("torch-memory", "torch-memory"),
    Variant("torch-files (PNG)", "torch-files"),
    Variant("gpu-resident", "gpu"),
)

FULL = {"workers": "0,1,2,4,8,16", "batch_size": 512, "epochs": 2}  # batch_size: data.batch_size unless given
# --quick: one row per loader and format, at most one FFCV thread (numba compiles a parallel pipeline much more
# slowly), so CI-sized data finishes in seconds. Its figures only show that everything runs.
QUICK = {"workers": "0,1", "batch_size": 64, "epochs": 1}
QUICK_VARIANTS = ("ffcv-raw", "ffcv-jpg", "torch-memory", "torch-files (PNG)", "gpu-resident")


# What each variant sets itself: an override of one of these would turn every row into the same loader.
VARIANT_FIELDS = ("path", "loader", "order", "os_cache", "flip", "png_dir", "num_workers")


def data_overrides(overrides: list[str]) -> dict:
    """The command's data.* KEY=VALUE overrides as DataConfig fields (parsed and range-checked by the config)."""
    from ffcv_ddpm.config import load_config

    keys = [item.partition("=")[0] for item in overrides]
    for key in keys:
        section, _, name = key.rpartition(".")
        if section != "data" or name in VARIANT_FIELDS:
            raise ValueError(f"{key}: this command measures the loader alone and takes data.* overrides other than "
                             f"{', '.join('data.' + f for f in VARIANT_FIELDS)} (each variant sets those)")
    data = load_config("tiny", overrides).data
    return {key.split(".", 1)[1]: getattr(data, key.split(".", 1)[1]) for key in keys}


def parse_args(argv=None) -> argparse.Namespace:
    p = Parser(prog="python -m benchmarks.speed.loaders", doc=__doc__, overrides=True,
               epilog=f"Only data.* overrides, applied to every variant: data.batch_size (default "
                      f"{FULL['batch_size']}; quick {QUICK['batch_size']}), data.seed, data.drop_last, "
                      "data.pin_memory.")
    p.add_argument("--data", type=Path, default=Path("data"),
                   help="folder with cifar10_train_{raw,jpg}.beton (and manifest.json), from `make dataset`")
    p.add_argument("--png-dir", type=Path,
                   help="PNG folder for torch-files (default DATA/png/train; labels in DATA/png/trainLabels.csv)")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<card or cpu>)")
    p.add_argument("--workers", help=f"comma-separated worker counts (default {FULL['workers']}; quick "
                                     f"{QUICK['workers']}); counts above this machine's cores are skipped")
    p.add_argument("--epochs", type=option(int, at_least(1)),
                   help=f"steady-state epochs timed after the first (default {FULL['epochs']}; quick "
                        f"{QUICK['epochs']})")
    p.add_argument("--loaders", help="only variants whose name contains one of these comma-separated words "
                                     "(default: all; quick: " + ", ".join(QUICK_VARIANTS) + ")")
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--quick", action="store_true", help="small defaults for CPU / CI-sized data")
    args, overrides = p.parse_with_overrides(argv)
    try:
        args.data_overrides = data_overrides(overrides)
    except ValueError as e:
        p.error(str(e))
    args.batch_size = args.data_overrides.pop("batch_size", None)
    defaults = QUICK if args.quick else FULL
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.workers = sorted(set(int_list(at_least(0))(args.workers)))
    except argparse.ArgumentTypeError as e:
        p.error(f"argument --workers: {e}")
    words = [w.strip() for w in (args.loaders or "").split(",") if w.strip()]
    if unknown := [w for w in words if not any(w in v.name for v in VARIANTS)]:
        p.error(f"--loaders: {', '.join(unknown)} matches no variant; the variants: "
                f"{', '.join(v.name for v in VARIANTS)}")
    args.variants = ([v for v in VARIANTS if any(w in v.name for w in words)] if words
                     else [v for v in VARIANTS if not args.quick or v.name in QUICK_VARIANTS])
    p.check_paths(inputs=[("--data", args.data, "folder", "make it with `make dataset`"),
                          ("--png-dir", args.png_dir, "folder", "write it with `make dataset-png`")],
                  outputs=[("--out", args.out)])
    args.png_dir = args.png_dir or args.data / "png" / "train"
    return args


def variant_config(variant: Variant, workers: int | None, args) -> DataConfig:
    return DataConfig(**{"seed": 0, **args.data_overrides},
                      path=str(args.data / f"cifar10_train_{variant.beton}.beton"), loader=variant.loader,
                      batch_size=args.batch_size, num_workers=workers or 0, order=variant.order,
                      os_cache=variant.os_cache, flip=variant.flip, png_dir=str(args.png_dir))


def measure(variant: Variant, workers: int | None, args, device: torch.device) -> dict:
    """Setup, first-epoch and steady-state figures of one loader variant at one worker count."""
    cfg = variant_config(variant, workers, args)
    t0 = time.perf_counter()
    loader = make_loader(cfg, device)
    sync(device)
    setup_s = time.perf_counter() - t0
    epochs = []
    for _ in range(1 + args.epochs):
        images_seen, last, t0 = 0, None, time.perf_counter()
        for images, labels in loader:
            stopping.check()  # a signal stops the command between two batches (an epoch of PNGs takes minutes)
            if variant.flip == "gpu":
                images = flip_images(images)
            last = (images, labels)  # noqa: F841  (held so the batch's work cannot be skipped)
            images_seen += images.shape[0]
        sync(device)
        epochs.append((images_seen, time.perf_counter() - t0))
    del loader, last
    gc.collect()  # free this variant's memory (and torch worker processes) before the next one
    steady_img_s = [n / s for n, s in epochs[1:]]
    return {
        **asdict(variant), "workers": workers, "setup_s": setup_s,
        "first_epoch_s": epochs[0][1], "first_epoch_img_s": epochs[0][0] / epochs[0][1],
        "steady_epoch_s": [s for _, s in epochs[1:]], "steady_img_s": steady_img_s,
        "img_s_median": statistics.median(steady_img_s), "images_per_epoch": epochs[0][0],
    }


def skip_reason(variant: Variant, workers: int | None, args, cores: int) -> str | None:
    if missing := missing_input(variant_config(variant, workers, args)):
        return f"{missing}, or pass --png-dir" if variant.loader == "torch-files" else missing
    if workers is not None and workers > cores:
        return f"{workers} workers > {cores} cores"
    if variant.loader == "ffcv" and workers == 0:
        return "FFCV has no main-process mode (its 0 means all cores)"
    return None


def run(args, device: torch.device, json_path: Path) -> dict:
    """Every variant x worker count; the JSON is rewritten after each row, so a run cut by a time limit keeps the rows
    it measured ("complete" stays false)."""
    env = environment()
    cores = env["cpu_count"]
    result = {
        "benchmark": "loaders",
        "device": _device_name(device),
        "command": " ".join(["python -m benchmarks.speed.loaders", *sys.argv[1:]]),
        "settings": {"batch_size": args.batch_size, "epochs": args.epochs, "workers": args.workers,
                     "quick": args.quick, "data": str(args.data), "png_dir": str(args.png_dir)},
        "dataset": dataset_info(args.data / "cifar10_train_raw.beton"),
        "environment": env,
        "complete": False,
        "rows": [],
    }
    rows = result["rows"]
    skipped = set()
    for v in args.variants:
        for workers in (args.workers if v.uses_workers else [None]):
            reason = skip_reason(v, workers, args, cores)
            if reason is not None:
                if reason not in skipped:  # say each reason once, not once per worker count
                    print(f"loaders: skip {v.name}: {reason}", flush=True)
                    skipped.add(reason)
                rows.append({**asdict(v), "workers": workers, "skipped": reason})
                continue
            stopping.doing(f"{v.name}, {'no' if workers is None else workers} workers")
            row = measure(v, workers, args, device)
            print(f"loaders: {v.name:38s} workers {'-' if workers is None else workers:>2}  "
                  f"{row['img_s_median']:12,.0f} img/s  first epoch {row['first_epoch_s']:6.2f} s  "
                  f"setup {row['setup_s']:5.2f} s", flush=True)
            rows.append(row)
            write_json(json_path, result, indent=2)
            stopping.keep("report", f"{json_path} ({len(rows)} rows)")
    result["complete"] = True
    return result


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({_cpu_model()})"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


# ---- reports -----------------------------------------------------------------------------------------------------

def _pivot(result: dict, cell) -> list[str]:
    """Markdown table: one line per variant, one column per worker count ("-" for the worker-less loader)."""
    counts = result["settings"]["workers"]
    lines = ["| loader | " + " | ".join(f"{w} workers" for w in counts) + " | no workers |",
             "|---|" + "---:|" * (len(counts) + 1)]
    by_name: dict[str, dict] = {}
    for row in result["rows"]:
        by_name.setdefault(row["name"], {})[row["workers"]] = row
    for name, cells in by_name.items():
        texts = [cell(cells[w]) if w in cells else "" for w in (*counts, None)]
        lines.append(f"| {name} | " + " | ".join(texts) + " |")
    return lines


def render_markdown(result: dict) -> str:
    env, data, s = result["environment"], result["dataset"], result["settings"]
    synthetic = {True: "synthetic", False: "real", None: "unknown (no manifest)"}[data["synthetic"]]
    skipped: dict[str, list[str]] = {}  # reason -> variants, so a reason shared by many rows is said once
    for r in result["rows"]:
        if "skipped" in r and r["name"] not in skipped.setdefault(r["skipped"], []):
            skipped[r["skipped"]].append(r["name"])
    lines = [
        f"# Loader alone: images/s delivered onto {result['device']}",
        "",
        f"- data: {data['num_images']:,} images of {data['height']}x{data['width']} from {data['path']} "
        f"(source {data['source']}, {synthetic}); batch {s['batch_size']}, drop_last; "
        f"{s['epochs']} steady-state epoch(s) after the first",
        f"- torch {env['torch']}, CUDA {env['cuda']}, ffcv {env['ffcv']}, {env['cpu_count']} CPU cores, "
        f"commit {commit_text(env, 12)}, {env['date_utc']}",
        f"- command: `{result['command']}`",
        *([] if result.get("complete", True) else ["- INCOMPLETE: the run stopped before its last variant"]),
        "",
        "## Steady-state images/s (median over epochs after the first)",
        "",
        *_pivot(result, lambda r: "skip" if "skipped" in r else f"{r['img_s_median']:,.0f}"),
        "",
        "## First epoch, seconds (FFCV compiles its pipeline here); setup in parentheses",
        "",
        *_pivot(result, lambda r: "skip" if "skipped" in r else f"{r['first_epoch_s']:.2f} ({r['setup_s']:.2f})"),
    ]
    if skipped:
        lines += ["", "Skipped:", *[f"- {', '.join(names)}: {reason}" for reason, names in skipped.items()]]
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    plt = pyplot()

    counts = result["settings"]["workers"]
    fig, ax = plt.subplots(figsize=(9, 5.5))
    names = dict.fromkeys(r["name"] for r in result["rows"] if "skipped" not in r)
    for name in names:
        rows = [r for r in result["rows"] if r["name"] == name and "skipped" not in r]
        if rows[0]["workers"] is None:  # no worker axis: a level line across the sweep
            ax.axhline(rows[0]["img_s_median"], color="black", linestyle="--", label=f"{name} (no workers)")
        else:
            xs = [counts.index(r["workers"]) for r in rows]
            jpg = rows[0]["beton"] == "jpg" and rows[0]["loader"] == "ffcv"  # JPEG dashed beside its raw twin
            ax.plot(xs, [r["img_s_median"] for r in rows], marker="s" if jpg else "o", linestyle="--" if jpg else "-",
                    label=name)
    ax.set_xticks(range(len(counts)), [str(w) for w in counts])
    ax.set_xlabel("workers (FFCV: threads; torch DataLoader: processes)")
    ax.set_ylabel("images/s onto the device (steady state)")
    ax.set_yscale("log")
    ax.set_title(f"Loader alone, batch {result['settings']['batch_size']}: {result['device']}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    save_figure(fig, path, 120)


def write_outputs(result: dict, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "loaders.json", out / "loaders.md", out / "loaders.png"]
    write_json(paths[0], result, indent=2)
    write_text(paths[1], render_markdown(result))
    plot(result, paths[2])
    return paths


def main(argv=None) -> int:
    """SIGTERM/SIGINT stop it between two batches (ffcv_ddpm.stopping): one line, exit 128 + signal."""
    args = parse_args(argv)
    return stopping.run_command("loaders", lambda stop: run_all(args))


def run_all(args) -> int:
    try:  # every variant needs the raw .beton (or its size): fail before measuring anything
        num_images = dataset_info(args.data / "cifar10_train_raw.beton")["num_images"]
        if num_images < args.batch_size:
            raise ValueError(f"{args.data}/cifar10_train_raw.beton holds {num_images} images, fewer than one batch "
                             f"of {args.batch_size}; lower data.batch_size")
        lacking = [missing_input(variant_config(v, None, args)) for v in args.variants]
        if all(lacking):  # nothing would be measured: say why now, not "no finite rate" after the sweep
            raise ValueError("no selected variant has its input: " + "; ".join(dict.fromkeys(lacking)))
        device = resolve_device(args.device)
        out = results_out(args.out, torch.cuda.get_device_name(device) if device.type == "cuda" else None)
    except (BenchError, FileNotFoundError, ValueError, RuntimeError, TrainingError) as e:  # RuntimeError: --device
        return fail("loaders", str(e))
    out.mkdir(parents=True, exist_ok=True)
    result = run(args, device, out / "loaders.json")
    stopping.done()  # measured: the report is written whatever comes
    for path in write_outputs(result, out):
        print(f"loaders: wrote {path}")
    measured = [r["img_s_median"] for r in result["rows"] if "skipped" not in r]
    if not measured or not all(math.isfinite(x) and x > 0 for x in measured):
        print("benchmarks.speed.loaders: no variant produced a finite positive rate", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
