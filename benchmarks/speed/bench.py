"""`make bench`: the training-step tables (the published MFU table's rows, then ours), each row in a fresh process.

    python -m benchmarks.speed.bench --data data          # CUDA: the headline (4 rows, minutes); no CUDA: 'quick'
    python -m benchmarks.speed.bench --data data --table full   # both models, every row (= --table both; over an hour cold)
    python -m benchmarks.speed.bench --data data --table ddpm --warm 3   # compile the rows' graphs 3 at a time first
    python -m benchmarks.speed.bench --data data --table small --measure-peak --sampling
    python -m benchmarks.speed.bench --table sampling     # DDIM and DDPM sampling, eager vs compiled (no data read)
    python -m benchmarks.speed.bench --list --table both  # print the rows and their overrides, run nothing
    python -m benchmarks.speed.bench --data data --table loaders-e2e   # per loader (issue 6); `make dataset-png` first
    python -m benchmarks.speed.bench --data data --rows best --name headline-cudnn train.cudnn_benchmark=True  # a switch

A row is a RunConfig (`load_config(preset, overrides)`) plus a batch rule (benchmarks.speed.rows). For each row a child
process (benchmarks.speed.jobs, started by benchmarks.speed.runner) builds the trainer and loader, runs the first step
(compilation: reported as seconds to first step, not timed, with the compile cache's size before it), `--warmup`
more steps, then times `--iters` steps with timing.timed_steps: CUDA events per iteration, the wait for the next
batch inside each iteration, one sync at the end. Compiled kernels are kept in the compile cache folder
(ffcv_ddpm.env.compile_cache): a row whose graph an earlier row or run compiled starts in seconds. Results (raw
per-iteration times, environment, full configs, dataset source) go to benchmarks/results/<card>/<table>.json,
with the Markdown table and PNG chart beside it (benchmarks.speed.report), rewritten after every row.
Before anything starts, the files every selected row reads are checked (runner.check_row_data): one missing
(a PNG folder never exported, say) stops the command with the rows that read it and how to make it.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common import BenchError
from benchmarks.speed.rows import TABLES, resolve_rows
from benchmarks.speed.runner import add_options, baseline_loader, check_overrides, cuda_available, run_table
from ffcv_ddpm.checks import Parser
from ffcv_ddpm.env import compile_cache
from ffcv_ddpm.stopping import run_command


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = Parser(prog="python -m benchmarks.speed.bench", doc=__doc__, overrides=True,
               epilog="The overrides apply to every row, after its own; data.batch_size=N runs every row at N (no "
                      "probing).")
    p.add_argument("--table", choices=sorted(TABLES), help="row set (default: headline with CUDA, quick without)")
    p.add_argument("--list", action="store_true", help="print the rows and their overrides and exit")
    p.add_argument("--name", help="output file stem (default: the table name)")
    add_options(p)
    args, overrides = p.parse_with_overrides(argv)
    if not args.list:  # --data is checked when a row reads it (run_table)
        p.check_paths(outputs=[("--out", args.out)])
    return args, overrides


def main(argv: list[str] | None = None) -> int:
    """SIGTERM/SIGINT stop the rows' processes too (ffcv_ddpm.stopping): one line, exit 128 + signal."""
    argv = sys.argv[1:] if argv is None else argv
    compile_cache()  # the rows' processes inherit the folder: a graph compiled by one row is loaded by the next
    return run_command("bench", lambda stop: run(argv), errors=(BenchError,))


def run(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    table = args.table or ("headline" if cuda_available() else "quick")
    table_rows = TABLES[table](baseline_loader(args))
    rows = resolve_rows(table_rows, args.rows)
    if args.list:
        check_overrides(rows, overrides)
        for i, row in enumerate(rows, 1):
            batch = row.batch if isinstance(row.batch, int) or row.batch == "max" else f"as in '{row.batch}'"
            print(f"{i:2d}. [{row.preset}] {row.name}  (batch: {batch})\n"
                  f"    {' '.join([*row.overrides, *overrides])}")
        return 0
    rc, _ = run_table(rows, table, args, overrides, argv, name=args.name, table_rows=table_rows)
    return rc


if __name__ == "__main__":
    sys.exit(main())
