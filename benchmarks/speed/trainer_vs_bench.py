"""The trainer's own speed beside the benchmark row of the same settings: its stats.jsonl against bench's timing.

    python -m benchmarks.speed.trainer_vs_bench --data data data.batch_size=1024   # the trainer's defaults, batch 1024
    python -m benchmarks.speed.trainer_vs_bench --data data data.batch_size=1024 data.loader=gpu --steps 300
    python -m benchmarks.speed.trainer_vs_bench --data data --preset tiny --steps 6 --log-every 2 --iters 3 train.device=cpu

One config, load_config(--preset, KEY=VALUE overrides), run twice on the same card, one process after the other:
first as a benchmark row (benchmarks.speed.jobs, as `make bench` runs it: the first step, --warmup steps, --iters timed
steps), then by `python -m ffcv_ddpm.train` for --steps steps logged every --log-every (no sample grids; its one
checkpoint, at the end, falls outside every timed interval). The row compiles first, so the trainer loads the same
graph from the compile cache. Compared: img/s (images over timed seconds, both ways: the trainer's over its log
intervals after the first, which holds the compiling step), the median step time and the data-wait share; the
verdict is whether the trainer's img/s is within --tol of the row's.

What the trainer does that the row does not, the places to look when they differ, is TRAINER_EXTRAS (in the
report too). Writes <out>/trainer-vs-bench.json and .md, and the trainer's stats.jsonl, config.json,
environment.json (and telemetry-summary.json on CUDA) under <out>/trainer-vs-bench/.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.common import (DATA_HELP, REPO, BenchError, commit_text, ensure_dataset, md_table, results_dir,
                               write_json, write_text)
from ffcv_ddpm import stopping
from ffcv_ddpm.checks import Parser, above, at_least, option

KEPT = ("stats.jsonl", "config.json", "environment.json", "telemetry-summary.json")  # of the trainer's run folder
TRAINER_EXTRAS = ("it reads the loss and a stop flag at every log interval (one sync), tracks the first non-finite "
                  "loss (one small kernel per step), sets the learning rate every step (the warm-up), writes "
                  "stats.jsonl, samples NVML telemetry in a thread, and runs longer, so it starts more epochs (the "
                  "loader starts one every dataset size / batch steps)")


def trainer_figures(stats: list[dict], batch: int) -> dict:
    """The trainer's speed over its log intervals after the first (which holds compilation): images / seconds as the
    bench row counts them (img_per_s_over), the median of the intervals' median step times, the data-wait share;
    and, where the trainer logs it, its images over wall time (the bookkeeping between the intervals too)."""
    from ffcv_ddpm.train import img_per_s_over  # the trainer's module, after main's compile_cache()

    later = stats[1:]
    if not later:
        raise BenchError("the trainer logged one interval only: give --steps at least twice --log-every")
    start = stats[0]["step"]
    img_per_s = img_per_s_over(later, start)
    steps = later[-1]["step"] - start
    wait_s = sum((line["step"] - prev["step"]) * line["data_wait_ms"] / 1e3 for prev, line in zip(stats, later))
    out = {"img_per_s": img_per_s, "ms_median": float(np.median([line["iter_ms_median"] for line in later])),
           "data_wait_share": wait_s / (steps * batch / img_per_s), "steps_compared": steps,
           "first_line_s": stats[0]["wall_s"], "intervals": len(later)}
    if all("img_per_s_wall" in line for line in later):
        out["img_per_s_wall"] = img_per_s_over(later, start, "img_per_s_wall")
    return out


def compare(bench: dict, trainer: dict, tol: float) -> dict:
    ratio = trainer["img_per_s"] / bench["img_per_s"]
    return {"img_per_s_ratio": ratio, "ms_median_ratio": trainer["ms_median"] / bench["ms_median"],
            "tol": tol, "agree": abs(ratio - 1) <= tol}


def render(result: dict, path: Path) -> None:
    b, t, c, env = result["bench"], result["trainer"], result["comparison"], result["environment"]
    verdict = (f"**agree**: the trainer's img/s is {c['img_per_s_ratio'] - 1:+.1%} from the bench row's (tolerance "
               f"+-{c['tol']:.0%})" if c["agree"] else
               f"**DIFFER**: the trainer's img/s is {c['img_per_s_ratio'] - 1:+.1%} from the bench row's, outside "
               f"+-{c['tol']:.0%}")
    lines = [f"# Trainer vs bench: {result['preset']} on {result['device_name'] or 'CPU'}", "",
             f"- commit {commit_text(env)}, torch {env.get('torch')}, {env.get('date_utc')}; command: "
             f"`{' '.join(result['command'])}`",
             f"- config: `load_config({result['preset']!r})` + `{' '.join(result['overrides']) or 'nothing'}`, "
             f"batch {result['batch_size']}; data {result['dataset']}",
             f"- bench row: first step, {result['warmup']} warm-up steps, {result['iters']} timed steps; trainer: "
             f"{result['steps']} steps logged every {result['log_every']}, compared over its {t['intervals']} "
             f"intervals after the first ({t['steps_compared']} steps)", "", verdict, "",
             *md_table(["", "img/s", "median step ms", "data wait", "first step s (compilation)"],
                       [["bench row", f"{b['img_per_s']:,.1f}", f"{b['ms_median']:.2f}", f"{b['data_wait_share']:.1%}",
                         f"{b['first_step_s']:.1f}"],
                        ["trainer (stats.jsonl)", f"{t['img_per_s']:,.1f}", f"{t['ms_median']:.2f}",
                         f"{t['data_wait_share']:.1%}",
                         f"{t['first_line_s']:.1f} (to its first log line: the first interval included)"],
                        *([["trainer over wall time (not compared)", f"{t['img_per_s_wall']:,.1f}", "", "", ""]]
                          if "img_per_s_wall" in t else [])]), "",
             f"What the trainer does that the row does not: {TRAINER_EXTRAS}.", ""]
    write_text(path.with_suffix(".md"), "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    from ffcv_ddpm.env import compile_cache

    compile_cache()  # the row compiles into it, the trainer loads from it
    argv = sys.argv[1:] if argv is None else argv
    p = Parser(prog="python -m benchmarks.speed.trainer_vs_bench", doc=__doc__, overrides=True,
               epilog="The overrides apply to both runs (the trainer's defaults without any).")
    p.add_argument("--data", type=Path, default=Path("data"), help=DATA_HELP)
    p.add_argument("--preset", default="ddpm-cifar10")
    p.add_argument("--steps", type=option(int, at_least(2)), default=300, help="the trainer's steps (train.steps)")
    p.add_argument("--log-every", type=option(int, at_least(1)), default=50, help="the trainer's train.log_every")
    p.add_argument("--iters", type=option(int, at_least(1)), default=50, help="the bench row's timed iterations")
    p.add_argument("--warmup", type=option(int, at_least(0)), default=10, help="the bench row's warm-up iterations")
    p.add_argument("--tol", type=option(float, above(0)), default=0.03, help="allowed |trainer / bench img/s - 1|")
    p.add_argument("--row-timeout", type=option(float, above(0)), default=1800, help="seconds for each of the runs")
    p.add_argument("--out", type=Path, help="output folder (default: benchmarks/results/<card>)")
    args, overrides = p.parse_with_overrides(argv)
    # SIGTERM/SIGINT stop the row's or the trainer's process too (ffcv_ddpm.stopping): one line, 128 + signal.
    return stopping.run_command("trainer_vs_bench", lambda stop: compare_runs(args, overrides, argv),
                                errors=(BenchError, ValueError))


def compare_runs(args, overrides: list[str], argv: list[str]) -> int:
    result, out = run(args, overrides, argv)
    c = result["comparison"]
    print(f"trainer_vs_bench: bench row {result['bench']['img_per_s']:,.1f} img/s, trainer "
          f"{result['trainer']['img_per_s']:,.1f} img/s: {c['img_per_s_ratio'] - 1:+.1%} -> "
          f"{'agree' if c['agree'] else 'DIFFER'} (tolerance {c['tol']:.0%}); wrote {out}, {out.with_suffix('.md').name}")
    return 0 if c["agree"] else 1


def run(args, overrides: list[str], argv: list[str]) -> tuple[dict, Path]:
    from benchmarks.speed.report import row_metrics
    from benchmarks.speed.rows import Row
    from benchmarks.speed.runner import cuda_available, environment, flops_of, spawn
    from ffcv_ddpm.config import load_config
    from ffcv_ddpm.data import dataset_info
    from ffcv_ddpm.train import read_stats

    if args.steps < 2 * args.log_every:
        raise BenchError(f"--steps {args.steps} gives fewer than two log intervals of {args.log_every}: the first "
                         "holds the compiling step, the comparison needs one more")
    cfg = load_config(args.preset, overrides)  # a bad override is one line, before any run
    cuda = cuda_available()
    env, gpu = environment(cuda)
    beton, built = ensure_dataset(args.data, 50_000 if cuda else 4096)
    batch = cfg.data.batch_size
    row_over = [f"data.path={beton}", *overrides]

    print(f"trainer_vs_bench: the bench row ({args.preset}, batch {batch}, {' '.join(overrides) or 'defaults'})",
          flush=True)
    stopping.doing("the bench row")
    got = spawn("row", {"preset": args.preset, "overrides": row_over, "batch_size": batch, "iters": args.iters,
                        "warmup": args.warmup}, args.row_timeout)
    if got["status"] != "ok":
        raise BenchError(f"the bench row failed: {got['error']}")
    raw = got["result"]
    config = raw.pop("config")
    m = row_metrics({"raw": raw}, flops_of(Row("", args.preset, (), batch), [f"data.path={beton}", *overrides]),
                    gpu, None)
    bench = {**{k: m[k] for k in ("img_per_s", "ms_median", "data_wait_share")}, "first_step_s": raw["first_step_s"],
             "mfu": m.get("mfu"), "raw": raw}

    print(f"trainer_vs_bench: the trainer, {args.steps} steps", flush=True)
    stopping.doing("the trainer's run")
    out = (args.out or results_dir(gpu if cuda else None)) / "trainer-vs-bench.json"
    kept = out.parent / "trainer-vs-bench"
    with tempfile.TemporaryDirectory(prefix="trainer-vs-bench-") as tmp:
        cmd = [sys.executable, "-m", "ffcv_ddpm.train", "--preset", args.preset, "--data", str(beton.resolve()),
               *overrides,
               f"train.steps={args.steps}", f"train.log_every={args.log_every}", f"train.ckpt_every={args.steps}",
               "train.sample_every=0", "train.progress=False", f"train.out_dir={tmp}", "train.desc=trainer-vs-bench"]
        try:
            proc = stopping.run(cmd, cwd=REPO, timeout=args.row_timeout)
        except subprocess.TimeoutExpired:
            raise BenchError(f"the trainer did not finish in {args.row_timeout:.0f} s (raise --row-timeout)") from None
        if proc.returncode != 0:
            raise BenchError(f"the trainer failed with exit status {proc.returncode} (its output is above)")
        (run_dir,) = [d for d in Path(tmp).iterdir() if d.is_dir()]
        stats = read_stats(run_dir)
        kept.mkdir(parents=True, exist_ok=True)
        for name in KEPT:
            if (run_dir / name).is_file():
                shutil.copy2(run_dir / name, kept / name)
    trainer = trainer_figures(stats, batch)
    result = {
        "schema": 1, "command": ["python", "-m", "benchmarks.speed.trainer_vs_bench", *argv], "environment": env,
        "device_name": gpu, "preset": args.preset, "overrides": overrides, "batch_size": batch,
        "dataset": f"{beton}" + (" (SYNTHETIC)" if built or dataset_info(beton)["synthetic"] else ""),
        "steps": args.steps, "log_every": args.log_every, "iters": args.iters, "warmup": args.warmup,
        "config": config, "bench": bench, "trainer": {**trainer, "run_files": str(kept)},
        "comparison": compare(bench, trainer, args.tol),
    }
    write_json(out, result)
    render(result, out)
    return result, out


if __name__ == "__main__":
    sys.exit(main())
