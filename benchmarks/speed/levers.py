"""The fused GroupNorm's levers (NOTES item 31) in the step, in one process: row 24 of the DDPM table (today's
defaults), the same row with each variant, then all of them again, from the compile cache.

    python -m benchmarks.speed.levers --data data --out runs/levers data.batch_size=1024      # CUDA
    python -m benchmarks.speed.levers --data data --out runs/levers --variant bits:model.norm_mask_bits=True

Why one process: a bench row (`python -m benchmarks.speed.bench --table ddpm --rows 24 ...`) is a fresh process,
which on an H100 cost ~60 s besides its compilation (113 s a new variant, 152 s the first: results/h100/step-5f421de),
so a 9-minute call held four rows. Here a row costs its compilation (~50 s with the Triton cache warm) and its
timing, and the convolutions keep the algorithms cuDNN's search chose in the first row (one choice for every row).
Each row is benchmarks.speed.jobs.run_row, the bench's own row (its warm-up, its timed iterations, its figures);
between rows the compiled graphs, their CUDA graphs and the cached memory are let go. Rows run in rounds (the
defaults, then each variant in the order given) while --budget seconds last, each written to OUT/levers.json and
printed as it ends: the first round compiles (a row starts only with as much time left as a new row is priced at,
run_rows), the second loads its graphs from the compile cache (~20 s a row) and gives each setting a second sample,
the defaults first, so that two rows of the same settings also say how far the call drifted. Without --variant: the
defaults alone, `--rounds` times (a setting that is process-wide, like train.cudnn_benchmark_limit, is compared
across processes: one levers call each).
"""

from __future__ import annotations

import gc
import sys
import time
from pathlib import Path

from benchmarks.common import BenchError, ensure_dataset, write_json
from benchmarks.common import parse_variant as parse_any_variant
from ffcv_ddpm.checks import Parser, at_least, fail, option

ROW = "24"  # of the DDPM table: the preset's defaults with GPU-resident data
BATCH = 1024  # unless data.batch_size says otherwise: the batch of the bench's rows of NOTES items 26-28


def parse_variant(text: str) -> tuple[str, tuple[str, ...]]:
    """--variant NAME:KEY=VALUE[,KEY=VALUE...] as (name, overrides): benchmarks.common.parse_variant."""
    return parse_any_variant(text, "bits:model.norm_mask_bits=True")


def plan_rows(variants: list[tuple[str, tuple[str, ...]]], rounds: int = 2) -> list[tuple[str, tuple[str, ...]]]:
    """The rows in the order they run: `rounds` times the defaults, then each variant."""
    return [("defaults", ()), *variants] * rounds


def run_rows(rows: list[tuple[str, tuple[str, ...]]], run, budget: float, clock=time.perf_counter) -> list[dict]:
    """Each row's `run(name, overrides)` entry, in order, while `budget` seconds last: a row starts only if the time
    left is at least the longest a row of its kind has taken so far (a new one: it compiles; a repeated one: its
    graphs come from the compile cache; before any repeat, half the longest new row); skipped rows are listed as
    such. The process's first row also pays what no later row pays again (the cold caches, cuDNN's search of every
    shape: 94-195 s to its first step on an H200, where a later new row took 32-45 s), so it counts as its time
    less half its first step. Each entry gets its name, overrides, round (its place among its setting's rows: a
    skipped second row is round 2 though the first was skipped too) and seconds."""
    t0, longest, done = clock(), {True: 0.0, False: 0.0}, []
    rounds: dict[tuple[str, ...], int] = {}
    ran: set[tuple[str, ...]] = set()  # settings compiled in this process: their next row loads from the cache
    for name, overrides in rows:
        new = overrides not in ran
        need = longest[new] or longest[True] / 2
        left = budget - (clock() - t0)
        round_ = rounds[overrides] = rounds.get(overrides, 0) + 1
        if left < need:
            done.append({"name": name, "overrides": list(overrides), "round": round_, "status": "skipped",
                         "error": f"{left:.0f} s of the budget left, such a row is priced at {need:.0f} s"})
            continue
        start = clock()
        entry = {"name": name, "overrides": list(overrides), "round": round_, **run(name, overrides)}
        entry["seconds"] = clock() - start
        once = entry.get("raw", {}).get("first_step_s", 0.0) / 2 if not ran else 0.0  # the process's one-time costs
        longest[new] = max(longest[new], entry["seconds"] - once)
        ran.add(overrides)
        done.append(entry)
    return done


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="python -m benchmarks.speed.levers", doc=__doc__, overrides=True,
               epilog="The overrides apply to every row, after its own (data.batch_size=1024: the bench's rows).")
    p.add_argument("--data", type=Path, default=Path("data"), help="dataset folder or .beton (synthetic if none)")
    p.add_argument("--out", type=Path, required=True, help="folder for levers.json")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE...]",
                   help="a row: row 24 with these overrides (repeatable; none: the defaults alone)")
    p.add_argument("--budget", type=option(float, at_least(60)), default=450,
                   help="seconds the rows may take, compilation included (default 450: a 9-minute call with the "
                        "dataset built)")
    p.add_argument("--rounds", type=option(int, at_least(1)), default=2,
                   help="times each setting runs (the first compiles it; later ones load it from the cache)")
    p.add_argument("--iters", type=option(int, at_least(1)), default=50, help="timed iterations per row")
    p.add_argument("--warmup", type=option(int, at_least(0)), default=10, help="warm-up iterations per row")
    args, overrides = p.parse_with_overrides(argv)
    try:
        variants = [parse_variant(v) for v in args.variant]
        return measure(args, overrides, plan_rows(variants, args.rounds), argv)
    except (ValueError, BenchError) as e:
        return fail("levers", str(e))


def measure(args, overrides: list[str], rows: list[tuple[str, tuple[str, ...]]], argv: list[str] | None) -> int:
    import torch

    from benchmarks.speed.jobs import run_row
    from benchmarks.speed.report import row_metrics
    from benchmarks.speed.rows import TABLES, resolve_rows, row_overrides
    from benchmarks.speed.runner import check_overrides, fixed_batch, flops_of
    from ffcv_ddpm.env import compile_cache, environment

    (row,) = resolve_rows(TABLES["ddpm"](("data.loader=torch-memory",)), ROW)
    for _, over in rows:  # every row's config, before anything runs: a bad one is one line
        check_overrides([row], [*overrides, *over])
    if not torch.cuda.is_available():
        raise BenchError("needs a CUDA GPU (row 24 compiles with CUDA graphs)")
    batch, overrides = fixed_batch(overrides)
    batch = batch or BATCH
    beton, _ = ensure_dataset(args.data, 50_000)
    base = row_overrides(row, (f"data.path={beton}",), beton.parent)
    compile_cache()
    device_name = torch.cuda.get_device_name()
    # FLOPs per image of each setting (the reference network's: the same for all), before the budget's clock starts.
    flops = {over: flops_of(row, [*overrides, *over]) for _, over in rows}
    result = {"command": ["python", "-m", "benchmarks.speed.levers", *(sys.argv[1:] if argv is None else argv)],
              "environment": environment(),
              "device_name": device_name, "row": row.name, "batch_size": batch, "rows": []}
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"levers: {device_name}; row {ROW} ({row.name}) at batch {batch}, {len(rows)} rows in one "
          f"process within {args.budget:.0f} s", flush=True)

    def run(name: str, over: tuple[str, ...]) -> dict:
        spec = {"preset": row.preset, "overrides": [*base, *overrides, *over], "batch_size": batch,
                "iters": args.iters, "warmup": args.warmup}
        try:
            raw = run_row(spec)
        except Exception as e:  # out of memory, a kernel that does not compile: the row fails, the call goes on
            entry = {"status": "failed", "error": f"{type(e).__name__}: {str(e).strip()[:500]}"}
        else:
            raw.pop("config")
            m = row_metrics({"raw": raw}, flops[over], device_name, None)
            entry = {"status": "ok", "metrics": m, "raw": raw}
            print(f"levers: {name} [{' '.join(over)}]: {m['ms_median']:.2f} ms/iter (p10 {m['ms_p10']:.2f}, "
                  f"p90 {m['ms_p90']:.2f}), {m['img_per_s']:,.0f} img/s, MFU {100 * m['mfu']:.1f}% "
                  f"({100 * m['executed_mfu']:.1f}% of the executed FLOPs), first step "
                  f"{raw['first_step_s']:.0f} s, peak {raw['peak_mem_bytes'] / 2**30:.1f} GiB", flush=True)
        torch._dynamo.reset()  # the compiled graphs and their CUDA graphs go; the next row compiles its own
        gc.collect()
        torch.cuda.empty_cache()
        result["rows"].append({"name": name, "overrides": list(over), **entry})
        write_json(args.out / "levers.json", result)  # after every row: a cut call keeps what it measured
        return entry

    done = run_rows(rows, run, args.budget)
    result["rows"] = done
    write_json(args.out / "levers.json", result)
    for r in done:
        figure = f"{r['metrics']['ms_median']:.2f} ms" if r["status"] == "ok" else f"{r['status']}: {r['error']}"
        print(f"levers: {r['name']:12s} round {r['round']}  {figure}")
    return 0 if all(r["status"] == "ok" for r in done) else 1


if __name__ == "__main__":
    sys.exit(main())
