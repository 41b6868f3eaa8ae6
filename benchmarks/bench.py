"""`make bench`: the training-step table (the published MFU table's rows, then ours), each row in a fresh process.

    python -m benchmarks.bench --data data               # CUDA: both models; no CUDA: the CPU-sized 'quick' table
    python -m benchmarks.bench --data data --table small --measure-peak --sampling
    python -m benchmarks.bench --list --table both               # print the rows and their overrides, run nothing
    python -m benchmarks.bench --data data --table loaders-e2e   # end to end per loader, both models (issue 6)
    python -m benchmarks.bench --data data --table ddpm --rows 15,16 data.batch_size=1024   # every row at 1024

A row is a RunConfig (`load_config(preset, overrides)`) plus a batch rule (benchmarks.rows). For each row a child
process (benchmarks.jobs, started by benchmarks.runner) builds the trainer and loader, runs the first step
(compilation: reported as seconds to first step, not timed), `--warmup` more steps, then times `--iters` steps with
timing.timed_steps: CUDA events per iteration, the wait for the next batch inside each iteration, one sync at the
end. Results (raw per-iteration times, environment, full configs, dataset source) go to
benchmarks/results/<card>/<table>.json, with the Markdown table and PNG chart beside it (benchmarks.report).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.common import BenchError
from benchmarks.rows import TABLES, resolve_rows
from benchmarks.runner import add_options, baseline_loader, check_overrides, cuda_available, run_table
from ffcv_ddpm.checks import Parser, fail


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = Parser(prog="python -m benchmarks.bench", doc=__doc__, overrides=True,
               epilog="The overrides apply to every row, after its own; data.batch_size=N runs every row at N (no "
                      "probing).")
    p.add_argument("--table", choices=sorted(TABLES), help="row set (default: both with CUDA, quick without)")
    p.add_argument("--list", action="store_true", help="print the rows and their overrides and exit")
    p.add_argument("--name", help="output file stem (default: the table name)")
    add_options(p)
    return p.parse_with_overrides(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, overrides = parse_args(argv)
        table = args.table or ("both" if cuda_available() else "quick")
        rows = resolve_rows(TABLES[table](baseline_loader(args)), args.rows)
        if args.list:
            check_overrides(rows, overrides)
            for i, row in enumerate(rows, 1):
                batch = row.batch if isinstance(row.batch, int) or row.batch == "max" else f"as in '{row.batch}'"
                print(f"{i:2d}. [{row.preset}] {row.name}  (batch: {batch})\n"
                      f"    {' '.join([*row.overrides, *overrides])}")
            return 0
        rc, _ = run_table(rows, table, args, overrides, argv, name=args.name)
        return rc
    except BenchError as e:
        return fail("bench", str(e))
    except KeyboardInterrupt:
        print("bench: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
