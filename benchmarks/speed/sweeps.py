"""Sweeps through the benchmark harness: training speed vs batch size, AMP x compile, and loader workers.

    python -m benchmarks.speed.sweeps --data data                   # all three (CUDA: ddpm-cifar10; CPU: tiny)
    python -m benchmarks.speed.sweeps --data data --sweep batch,workers --iters 30
    python -m benchmarks.speed.sweeps --sweep amp-compile --list     # the rows and their overrides; runs nothing

Each sweep is a row table (`sweep-batch`, `sweep-amp-compile`, `sweep-workers`) run by benchmarks.speed.runner as bench
runs its tables: every row in a fresh process, warm-up, CUDA-event timing with the data wait inside, JSON + Markdown
+ bar chart in benchmarks/results/<card>/. On top of that this module draws the sweep as a curve
(<name>-curve.png): x = the swept setting, y = images/s, with peak memory or the data-wait share beneath.
It takes bench's run options (--iters, --warmup, --row-timeout, --baseline-loader, ...).

Every row starts from the trainer's defaults (`load_config(preset)`: bf16, compile, SDPA, channels_last, fused AdamW,
the FFCV loader, GPU flips, the default GroupNorm) and changes only the swept setting, so each curve isolates one
knob of what `make train` runs; the reports say so. The command's KEY=VALUE overrides apply to every row.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from benchmarks.common import BenchError, commit_text, pyplot, save_figure
from benchmarks.speed.report import row_peak_mem
from benchmarks.speed.rows import Row, merge, resolve_rows
from benchmarks.speed.runner import add_options, baseline_loader, check_overrides, cuda_available, run_table
from ffcv_ddpm.checks import Parser, fail
from ffcv_ddpm.stopping import run_command
from ffcv_ddpm.unet import PRESETS

# Where every sweep row starts: the trainer's defaults, no override (not bench's stack, which carries switches that
# are still being measured).
DEFAULTS: tuple[str, ...] = ()
NOTE = ("Every row starts from the trainer's defaults (load_config(preset), no override) and changes only the swept "
        "setting.")


@dataclass(frozen=True)
class Sweep:
    rows: Callable[[str, tuple[str, ...], bool], list[Row]]  # (preset, bench's baseline loader, cuda) -> rows
    x: Callable[[dict], object]  # a result row -> its x value
    series: Callable[[dict], str]  # a result row -> the curve it belongs to
    xlabel: str  # x axis label
    lower: str  # what the lower panel shows: "mem" (peak GiB) or "wait" (data-wait share)
    log_x: bool = False  # powers of two read best on a log axis


def batch_rows(preset: str, _loader, cuda: bool) -> list[Row]:
    sizes = (64, 128, 256, 512, 1024, 2048) if cuda else (4, 8)
    return [Row(f"batch {b}", preset, DEFAULTS, b, baseline=i == 0) for i, b in enumerate(sizes)]


def amp_compile_rows(preset: str, _loader, cuda: bool) -> list[Row]:
    # fp16 needs a GradScaler on CUDA and compile is a no-op on CPU, so the CPU grid is fp32/bf16 eager only.
    precisions = ("fp32", "tf32", "bf16", "fp16") if cuda else ("fp32", "bf16")
    rows = []
    for compile_ in ((False, True) if cuda else (False,)):
        for p in precisions:
            name = f"{p}, {'compile' if compile_ else 'eager'}"
            rows.append(Row(name, preset, merge(DEFAULTS, (f"train.precision={p}", f"train.compile={compile_}")),
                            256 if cuda else 8, baseline=not rows))
    return rows


def worker_rows(preset: str, loader: tuple[str, ...], cuda: bool) -> list[Row]:
    """FFCV and bench's baseline loader (a torch DataLoader) at several worker counts, flips in the loader: the
    question is whether the loader keeps the GPU fed, so it gets the flip work a CPU pipeline would do."""
    name = loader[0].split("=", 1)[1]
    counts = {"ffcv": (1, 2, 4, 8, 12, 16), name: (0, 2, 4, 8, 12, 16)} if cuda else {"ffcv": (1, 2), name: (0, 2)}
    rows = []
    for kind, extra in (("ffcv", ("data.loader=ffcv",)), (name, loader)):
        for w in counts[kind]:
            overrides = merge(DEFAULTS, extra, ("data.flip=cpu", f"data.num_workers={w}"))
            rows.append(Row(f"{kind}, {w} workers", preset, overrides, 256 if cuda else 8, baseline=not rows))
    return rows


SWEEPS = {
    "batch": Sweep(batch_rows, x=lambda r: r["raw"]["batch_size"], series=lambda r: "img/s", xlabel="batch size",
                   lower="mem", log_x=True),
    "amp-compile": Sweep(amp_compile_rows, x=lambda r: r["config"]["train"]["precision"],
                         series=lambda r: "compiled" if r["config"]["train"]["compile"] else "eager",
                         xlabel="precision", lower="mem"),
    "workers": Sweep(worker_rows, x=lambda r: r["config"]["data"]["num_workers"],
                     series=lambda r: r["config"]["data"]["loader"], xlabel="loader workers", lower="wait"),
}


# ---------------------------------------------------------------------------------------------------- the curve


def plot_sweep(result: dict, sweep: Sweep, path: Path) -> Path:
    """img/s against the swept setting, one line per series; peak memory or data wait below. Failed rows
    (out of memory, ...) are listed in the title instead of plotted."""
    plt = pyplot()

    ok = [r for r in result["rows"] if r.get("metrics")]
    failed = [r["name"] for r in result["rows"] if not r.get("metrics")]
    xs = list(dict.fromkeys(sweep.x(r) for r in ok))
    categorical = any(isinstance(x, str) for x in xs)
    fig, (top, low) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(2, 1))
    for series in dict.fromkeys(sweep.series(r) for r in ok):
        rows = [r for r in ok if sweep.series(r) == series]
        x = [xs.index(sweep.x(r)) if categorical else sweep.x(r) for r in rows]
        top.plot(x, [r["metrics"]["img_per_s"] for r in rows], "o-", label=series)
        if sweep.lower == "mem":
            mem = [row_peak_mem(r)[0] for r in rows]
            low.plot(x, [m / 2**30 if m is not None else float("nan") for m in mem], "o-", label=series)
        else:
            low.plot(x, [100 * r["metrics"]["data_wait_share"] for r in rows], "o-", label=series)
    top.set_ylim(bottom=0)
    top.set_ylabel("images / s (training step)")
    if sweep.lower == "mem" and all(row_peak_mem(r)[0] is None for r in ok):
        low.text(0.5, 0.5, "peak memory: n/a (no CUDA)", ha="center", va="center", transform=low.transAxes)
    low.set_ylabel("peak memory (GiB)" if sweep.lower == "mem" else "waiting for data (% of step)")
    low.set_xlabel(sweep.xlabel)
    if categorical:
        low.set_xticks(range(len(xs)), xs)
    elif sweep.log_x:
        low.set_xscale("log", base=2)
        low.set_xticks(xs, [str(x) for x in xs])
    for ax in (top, low):
        ax.grid(alpha=0.3)
    if len({sweep.series(r) for r in ok}) > 1:
        top.legend(fontsize=8)
    env = result["environment"]
    preset = result["rows"][0]["preset"] if result["rows"] else "?"
    title = (f"{result['table']} ({preset}) - {result.get('device_name') or 'CPU'} - torch {env.get('torch')} - "
             f"{commit_text(env)}")
    if failed:
        title += "\nnot plotted (failed): " + ", ".join(failed)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, 110)
    return path


# ---------------------------------------------------------------------------------------------------- command


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = Parser(prog="python -m benchmarks.speed.sweeps", doc=__doc__, overrides=True,
               epilog="The overrides apply to every row, after the swept setting.")
    p.add_argument("--sweep", default="all", help=f"comma-separated: {', '.join(SWEEPS)}, or all")
    p.add_argument("--preset", choices=list(PRESETS),
                   help="model preset (default: ddpm-cifar10 with CUDA, tiny without)")
    p.add_argument("--list", action="store_true", help="print each sweep's rows and their overrides and exit")
    add_options(p)
    args, overrides = p.parse_with_overrides(argv)
    if not args.list:  # --data is checked when a row reads it (run_table)
        p.check_paths(outputs=[("--out", args.out)])
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    """SIGTERM/SIGINT stop the rows' processes too (ffcv_ddpm.stopping): one line, exit 128 + signal."""
    argv = sys.argv[1:] if argv is None else argv
    return run_command("sweeps", lambda stop: run(argv), errors=(BenchError,))


def run(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    names = list(SWEEPS) if args.sweep == "all" else [s.strip() for s in args.sweep.split(",") if s.strip()]
    unknown = [n for n in names if n not in SWEEPS]
    if unknown or not names:
        return fail("sweeps", f"unknown sweep {', '.join(unknown) or repr(args.sweep)}; choose from "
                              f"{', '.join(SWEEPS)} or all")
    cuda = cuda_available()  # no CUDA context here: the rows' processes own the GPU
    preset = args.preset or ("ddpm-cifar10" if cuda else "tiny")
    rc = 0
    loader = baseline_loader(args)
    for name in names:
        table = f"sweep-{name}"
        table_rows = SWEEPS[name].rows(preset, loader, cuda)
        rows = resolve_rows(table_rows, args.rows)
        if args.list:
            check_overrides(rows, overrides)
            print(f"{table} ({preset}):")
            for i, row in enumerate(rows, 1):
                print(f"{i:2d}. {row.name}  (batch: {row.batch})\n    {' '.join([*row.overrides, *overrides])}")
            continue
        print(f"\nsweeps: {table} ({preset})", flush=True)
        stem = table + ("" if preset == "ddpm-cifar10" else f"-{preset}")
        code, json_path = run_table(rows, table, args, overrides, argv, command="benchmarks.speed.sweeps",
                                    name=stem, note=NOTE, table_rows=table_rows)
        rc = max(rc, code)
        result = json.loads(json_path.read_text())
        png = plot_sweep(result, SWEEPS[name], json_path.with_name(f"{stem}-curve.png"))
        print(f"sweeps: wrote {png}", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
