"""The parent side of a benchmark table: each row in a fresh process (jobs.py), the JSON rewritten after each.

    add_options(parser)                                      # the options bench and sweeps share
    rc, path = run_table(rows, "quick", args, overrides, argv)   # rows from rows.py; writes JSON, .md, .png

Why a fresh process per row: every row then starts from the same state -- an empty CUDA caching allocator (so peak
memory and "largest batch that fits" are the row's own), no compiled graphs or autotuning caches from earlier rows,
default backend flags -- and one row's OOM or crash cannot poison the next. Freeing in-process (dynamo reset, gc,
empty_cache) leaves allocator fragmentation and global state behind and is hard to prove clean. The cost is a few
seconds of process start per row, outside the timed region.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.common import (DATA_HELP, DEFAULT_DATA, PNG_TRAIN, REPO, BenchError, check_data, dataset_files,
                               ensure_dataset, lock_output, results_out, write_json)
from benchmarks.speed.rows import BATCH_LADDER, Row, row_overrides
from ffcv_ddpm import stopping
from ffcv_ddpm.checks import above, at_least, choice_list, matches, option
from ffcv_ddpm.folder_lock import unlock_folder

# The sampling rows' modes: the eager model, then ffcv_ddpm.sampling's compile modes ("off" is spelled eager here).
SAMPLING_MODES = ("eager", "default", "reduce-overhead", "max-autotune-no-cudagraphs")


def add_options(p: argparse.ArgumentParser) -> None:
    """The options of a table run, for every command that runs one (bench, sweeps)."""
    p.add_argument("--rows", help="run only these rows: 1-based indices or name substrings, comma-separated")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help=DATA_HELP)
    p.add_argument("--iters", type=option(int, at_least(1)),
                   help="timed iterations per row, after the warm-up (default: 50 on CUDA, 5 on CPU)")
    p.add_argument("--warmup", type=option(int, at_least(0)),
                   help="warm-up iterations after the first step (default: 10 CUDA, 1 CPU)")
    p.add_argument("--baseline-loader", choices=("auto", "torch-memory", "torch-files"), default="auto",
                   help="loader of the rows before '+ FFCV loading'; auto = torch-files (PNG decode per image) if "
                        f"DATA/{PNG_TRAIN} exists, else torch-memory (a DataLoader over arrays in RAM)")
    p.add_argument("--max-batch", type=option(int, at_least(1)), default=4096,
                   help="cap for the 'largest batch that fits' rows")
    p.add_argument("--mem-fraction", type=option(float, matches("a number in (0, 1]", lambda v: 0 < v <= 1)),
                   default=0.9, help="GPU memory share a probed batch may use")
    p.add_argument("--measure-peak", action="store_true", help="also time large matmuls for a measured peak")
    p.add_argument("--sampling", action="store_true",
                   help="also time whole sampling calls (DDIM, ancestral DDPM), eager and compiled, in bf16 "
                        "(implied by --table sampling)")
    p.add_argument("--sample-n", type=option(int, at_least(1)),
                   help="images per sampling call, the network's batch (default: 256 on CUDA, 4 on CPU)")
    p.add_argument("--ddim-steps", type=option(int, at_least(1)), default=50, help="DDIM steps for the sampling rows")
    p.add_argument("--samplers", type=choice_list(("ddim", "ddpm")), default=["ddim", "ddpm"],
                   help="samplers of the sampling rows, comma-separated: ddim, ddpm (all T steps)")
    p.add_argument("--sample-modes", type=choice_list(SAMPLING_MODES),
                   help="eager and compile modes of the sampling rows, each in a process of its own (default: "
                        "eager,default,reduce-overhead on CUDA; eager,default on CPU)")
    p.add_argument("--sample-presets", type=choice_list(_presets),
                   help="models of the sampling rows (default: the table's models on CUDA, ddpm-cifar10 for "
                        "--table sampling; tiny on CPU)")
    p.add_argument("--num-synthetic", type=option(int, at_least(1)),
                   help="images in a synthetic dataset built when none exists (default: 50000 on CUDA, 4096 on CPU)")
    p.add_argument("--warm", type=option(int, at_least(0)), default=0, metavar="N",
                   help="CUDA: compile the compiled rows' graphs N at a time before timing any (each timed row then "
                        "starts from the compile cache); 0: each row compiles in its turn")
    p.add_argument("--row-timeout", type=option(float, above(0)), default=1800,
                   help="seconds before a row's process is stopped")
    p.add_argument("--out", type=Path, help="output folder (default: benchmarks/results/<card>)")


def _presets() -> tuple[str, ...]:
    from ffcv_ddpm.unet import PRESETS  # imports torch: only when the option is given

    return tuple(PRESETS)


def cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()  # does not create a CUDA context: the children own the GPU


def baseline_loader(args: argparse.Namespace) -> tuple[str, ...]:
    """The overrides of the rows before '+ FFCV loading', from --baseline-loader and what DATA holds."""
    data_dir = args.data.parent if args.data.suffix == ".beton" else args.data
    png_dir = data_dir / PNG_TRAIN
    if args.baseline_loader == "torch-files" and not png_dir.is_dir():
        raise BenchError(f"--baseline-loader torch-files needs the PNG folder {png_dir}; write it with "
                         f"`python -m tools.make_dataset ... --export-png {data_dir / 'png'}`")
    if args.baseline_loader == "torch-files" or (args.baseline_loader == "auto" and png_dir.is_dir()):
        return ("data.loader=torch-files", f"data.png_dir={png_dir}")
    return ("data.loader=torch-memory",)


def fixed_batch(overrides: list[str]) -> tuple[int | None, list[str]]:
    """data.batch_size=N among the command's overrides: every row runs at N (no probing); the rest apply as given."""
    batch, rest = None, []
    for item in overrides:
        key, _, value = item.partition("=")
        if key in ("data.batch_size", "batch_size"):
            batch = int(value)  # its range is checked by check_overrides first
        else:
            rest.append(item)
    return batch, rest


def check_overrides(rows: list[Row], overrides: list[str]) -> None:
    """The command's KEY=VALUE overrides on every row's config: a bad one is one line before anything runs."""
    from ffcv_ddpm.config import load_config

    for row in rows:
        try:
            load_config(row.preset, [*row.overrides, *overrides])
        except ValueError as e:
            raise BenchError(str(e)) from None


def check_row_data(rows: list[Row], data: Path, overrides: list[str], table_rows: list[Row] | None = None) -> None:
    """Every file each row's loader reads (its overrides with the dataset's, then the command's) is there, or is one
    ensure_dataset answers for; else one BenchError naming each row, what it lacks and how to make it or leave the
    row out. Run before anything starts: a row whose PNG folder was never exported used to fail in its turn, after
    the rows before it had compiled and timed for minutes."""
    from ffcv_ddpm.config import load_config
    from ffcv_ddpm.data import missing_input

    beton, provided = dataset_files(data)
    table = table_rows if table_rows and all(r in table_rows for r in rows) else rows  # what --rows numbers
    lacking: dict[str, list[str]] = {}  # what is missing -> the rows that read it, so that it is said once
    runnable = []
    for row in rows:
        i = table.index(row) + 1
        cfg = load_config(row.preset, [*row_overrides(row, (f"data.path={beton}",), beton.parent), *overrides])
        problem = missing_input(cfg.data, assume_present=provided)
        if problem is None:
            runnable.append(str(i))
        else:
            lacking.setdefault(problem, []).append(f"row {i} [{row.preset}] {row.name}")
    if lacking:
        count = sum(map(len, lacking.values()))
        which = (f"{count} of the {len(rows)} rows read" if count < len(rows) else "the row reads" if count == 1
                 else f"all {count} rows read")
        lines = [f"{which} data that is not there (nothing has run):"]
        for problem, names in lacking.items():
            lines += [*(f"  {name}" for name in names), f"    {problem}"]
        if runnable:
            lines.append(f"  or leave {'that row' if count == 1 else 'those rows'} out: --rows {','.join(runnable)}")
        raise BenchError("\n".join(lines))


def flops_of(row: Row, overrides: list[str]) -> dict:
    """FLOPs per image of the row's own model config (its overrides, then the command's): FlopCounterMode's count and
    the published table's; flops.py caches them per config."""
    from benchmarks.speed.flops import published_style_flops_per_image, train_flops_per_image
    from ffcv_ddpm.config import load_config

    model = load_config(row.preset, [*row.overrides, *overrides]).model
    return {"train": train_flops_per_image(model), "published": published_style_flops_per_image(model)}


def row_name(row: Row, overrides: list[str]) -> str:
    """A row's name in the result: the command's own overrides are part of what it ran, so that a table merged from
    several calls (benchmarks.speed.merge) cannot mistake a row with a switch for the row without it."""
    return row.name + (f" [{' '.join(overrides)}]" if overrides else "")


def spawn(kind: str, spec: dict, timeout: float, log: Path | None = None) -> dict:
    """Run one job of benchmarks.speed.jobs in a fresh Python process; its output streams through (or into `log`), its
    result comes back as JSON. A signal to the command stops the job too (ffcv_ddpm.stopping), and a timeout kills
    it with every process it started."""
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "benchmarks.speed.jobs", kind, str(spec_path), str(result_path)]
        try:
            with open(log, "w") if log else contextlib.nullcontext() as out:
                proc = stopping.run(cmd, cwd=REPO, timeout=timeout, stdout=out,
                                    stderr=subprocess.STDOUT if log else None)
        except subprocess.TimeoutExpired:
            return {"status": "failed", "error": f"timed out after {timeout:.0f} s (raise --row-timeout)"}
        if not result_path.is_file():
            return {"status": "failed", "error": f"worker exited with code {proc.returncode} and no result"}
        return json.loads(result_path.read_text())


def warm_rows(rows: list[Row], over: dict, batch_of, args: argparse.Namespace) -> dict:
    """--warm N: compiles the compiled rows' graphs N at a time before any row is timed, each in a one-step run of the
    row's own job, so that each timed row loads its kernels from the compile cache (ffcv_ddpm.env) instead of
    compiling for 60-120 s in its turn. Compilation is mostly CPU work: N graphs at once take far less than N times one
    (bench-ddp's warm-up: 3 graphs in 202 s, one alone ~120 s). Left to compile in their turn: eager rows, autotuning
    compile modes (their choices must be timed on an idle GPU), rows without a batch. The jobs share the GPU, each
    held to 1/N of its memory; a warm-up that fails (out of memory, say) costs its time only: its row compiles in
    its turn. `batch_of(row, known)` is run_table's batch rule (probes run here, alone, before any warm-up job).
    Returns {(preset, row name): {"status", "first_step_s" or "error", "seconds"}}."""
    from ffcv_ddpm.config import load_config

    known, jobs = {}, []
    for row in rows:
        key = (row.preset, row.name)
        batch = batch_of(row, known)[0]
        if batch is None:
            continue
        known[key] = batch
        cfg = load_config(row.preset, over[key])
        if cfg.train.compile and "max-autotune" not in cfg.train.compile_mode:
            jobs.append((key, {"preset": row.preset, "overrides": over[key], "batch_size": batch, "iters": 1,
                               "warmup": 0, "mem_fraction": 1 / args.warm}))
    print(f"\nbench: warm-up: compiling {len(jobs)} rows' graphs, {args.warm} at a time, before timing any", flush=True)
    stopping.doing("the warm-up")
    t0 = time.perf_counter()

    def one(job):
        key, spec = job
        start = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="bench-warm-") as tmp:
            got = spawn("row", spec, args.row_timeout, log=Path(tmp) / "log.txt")
        out = {"status": got["status"], "seconds": round(time.perf_counter() - start, 1)}
        if got["status"] == "ok":
            out["first_step_s"] = got["result"]["first_step_s"]
        else:
            out["error"] = got.get("error")
        print(f"bench: warm-up {key[0]}: {key[1]}: {out['status']} in {out['seconds']:.0f} s"
              + (f" ({out['error']})" if "error" in out else ""), flush=True)
        return key, out

    with ThreadPoolExecutor(max_workers=args.warm) as pool:
        done = dict(pool.map(one, jobs))
    print(f"bench: warm-up done in {time.perf_counter() - t0:.0f} s", flush=True)
    return done


def environment(cuda: bool) -> tuple[dict, str | None]:
    """(environment, GPU name), read in a child: asking torch here would create a CUDA context in this process,
    holding GPU memory the rows' processes should have."""
    env = spawn("env", {}, 120)
    if env["status"] != "ok":
        raise BenchError(f"could not read the environment: {env['error']}")
    env = env["result"]
    return env, (env["gpus"][0]["name"] if cuda and env["gpus"] else None)


def _summary_line(raw: dict, flops: dict, device_name: str | None) -> str:
    from benchmarks.speed.report import row_metrics

    m = row_metrics({"raw": raw}, flops, device_name, None)
    mfu = f"{100 * m['mfu']:.1f}%" if m.get("mfu") is not None else m["peak_note"]
    return (f"{raw['sdpa_backend']}; {m['ms_median']:.2f} ms/iter (p10 {m['ms_p10']:.2f}, p90 {m['ms_p90']:.2f}), "
            f"{m['img_per_s']:,.1f} img/s, data wait {100 * m['data_wait_share']:.1f}%, "
            f"{m['tflops']:.3g} TFLOP/s, MFU {mfu}, first step {raw['first_step_s']:.1f} s")


def sampling_presets(args: argparse.Namespace, cuda: bool, table_presets: list[str]) -> list[str]:
    return args.sample_presets or ((table_presets or ["ddpm-cifar10"]) if cuda else ["tiny"])


def run_sampling_rows(result: dict, json_path: Path, args: argparse.Namespace, cuda: bool, presets: list[str],
                      overrides: list[str]) -> None:
    """The sampling rows: per model (its config with the command's overrides), each mode in a fresh process
    (benchmarks.speed.jobs.run_sampling), eager first so that every compiled row has its eager figure from the same run
    and card; the JSON is rewritten after each."""
    modes = args.sample_modes or (["eager", "default", "reduce-overhead"] if cuda else ["eager", "default"])
    n = args.sample_n or (256 if cuda else 4)
    result["sampling"] = []
    for preset in presets:
        for mode in modes:
            print(f"\nbench: sampling, {preset}, {mode}, {'bf16' if cuda else 'fp32'}, {n} images per call: "
                  f"{', '.join(args.samplers)}", flush=True)
            stopping.doing(f"the sampling row {preset}, {mode}")
            got = spawn("sampling", {"preset": preset, "overrides": overrides, "mode": mode, "n": n,
                                     "ddim_steps": args.ddim_steps, "samplers": args.samplers}, args.row_timeout)
            if got["status"] != "ok":
                result["sampling"].append({"name": preset, "mode": mode, "status": "failed", "error": got["error"]})
                print(f"bench:   sampling FAILED: {got['error']}", flush=True)
            for s in got.get("result") or []:
                result["sampling"].append({**s, "status": "ok"})
                print(f"bench:   {s['sampler']} {s['steps']} steps: {s['img_per_s']:,.1f} img/s, "
                      f"{s['tflops']:.3g} TFLOP/s ({s['seconds']:.2f} s; first call {s['first_call_s']:.1f} s)"
                      + (f"; vs eager: max |diff| {s['vs_eager_max_abs']} of 255" if "vs_eager_max_abs" in s
                         else ""), flush=True)
            save(result, json_path)


def save(result: dict, json_path: Path) -> None:
    """The JSON and its Markdown + PNG as they stand (a call cut short keeps a readable report, too)."""
    from benchmarks.speed.report import write_reports

    write_json(json_path, result)
    write_reports(result, json_path)
    ok = sum(r["status"] == "ok" for r in [*result["rows"], *(result["sampling"] or [])])
    stopping.keep(str(json_path), f"the report {json_path} ({ok} rows measured)")


def run_table(rows: list[Row], table: str, args: argparse.Namespace, overrides: list[str], argv: list[str],
              command: str = "benchmarks.speed.bench", name: str | None = None,
              note: str | None = None, table_rows: list[Row] | None = None) -> tuple[int, Path]:
    """Runs `rows` (each in its own process, the command's `overrides` after each row's) and writes
    <out>/<name or table>.json, .md, .png; returns (exit status: 1 if any row failed, the JSON's path). `note`: a
    line for the report's header (what the rows start from). `table_rows`: the whole table `rows` were selected
    from; a selected row whose batch comes from an unselected one gets the batch that row's own rule gives (its
    probe, if it has one), so that a table split over calls runs each row at its full-table batch."""
    from benchmarks.speed.report import add_metrics, terminal_table, write_reports
    from ffcv_ddpm.data import dataset_info

    cuda = cuda_available()
    iters = args.iters or (50 if cuda else 5)
    warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    loader = baseline_loader(args)
    check_overrides(rows, overrides)
    batch_fixed, overrides = fixed_batch(overrides)
    sampling = args.sampling or table == "sampling"
    sample_presets = sampling_presets(args, cuda, list(dict.fromkeys(r.preset for r in rows))) if sampling else []
    check_overrides([Row("sampling", preset, (), 1) for preset in sample_presets], overrides)  # their configs too
    if rows:  # the sampling rows read no data
        check_data(args.data)
        check_row_data(rows, args.data, overrides, table_rows)

    # ---- first lines: what runs, on what, with which data --------------------------------------------------------
    env, gpu = environment(cuda)
    out_dir = results_out(args.out, gpu if cuda else None)
    lock_output(out_dir)  # before the first timing: two tables into one folder would time each other's load
    where = f"CUDA ({gpu})" if cuda else "CPU only: MFU is n/a (no CUDA)"
    print(f"bench: {where}; table '{table}', {len(rows)} rows; {warmup} warm-up + {iters} timed iterations per row, "
          "each row in a fresh process" + (f"; then sampling rows of {', '.join(sample_presets)}" if sampling else ""),
          flush=True)
    if getattr(args, "warm", 0) and not cuda:
        print("bench: --warm ignored: the rows compile on CUDA only")
    if not cuda and table not in ("quick", "sampling"):
        print(f"bench: WARNING: table '{table}' on a CPU will take a long time; --table quick is sized for CPUs")
    dataset, built, data_dir, data_overrides = None, False, None, ()
    if rows:  # the sampling rows read no data
        beton, built = ensure_dataset(args.data, args.num_synthetic or (50_000 if cuda else 4096))
        data_dir = beton.parent
        try:
            dataset = dataset_info(beton)
        except (FileNotFoundError, ValueError) as e:
            raise BenchError(str(e)) from None
        print(f"bench: data {beton}: {dataset['num_images']} images, source {dataset['source']}"
              + (" -- SYNTHETIC: speed only, not a training result" if dataset["synthetic"] else "")
              + (f"; baseline loader reads PNGs from {data_dir / PNG_TRAIN}" if loader[0].endswith("torch-files")
                 else ""), flush=True)
        data_overrides = (f"data.path={beton}",)

    # ---- FLOPs per image of each row's own model config (meta device, no GPU; counted once per config) -------------
    from benchmarks.speed.peaks import card_slug

    row_flops = [flops_of(row, overrides) for row in rows]
    flops = {}  # per preset, its first row's count: the report's header and the published table's recount
    for row, f in zip(rows, row_flops):
        if row.preset not in flops:
            flops[row.preset] = f
            print(f"bench: {row.preset}: {f['train']['fwd_bwd'] / 1e9:.3f} GFLOP/img fwd+bwd (FlopCounterMode), "
                  f"{f['published']['fwd_bwd'] / 1e9:.3f} counted the published way", flush=True)

    result = {
        "schema": 1,
        "table": table,
        "note": note,
        "complete": False,  # True once every row has run (the file is rewritten after each row)
        "planned": [[row.preset, row_name(row, overrides)] for row in rows],  # what a merge needs for a complete table
        "command": ["python", "-m", command, *argv],
        "environment": env,
        "device_name": gpu,
        "card": card_slug(gpu) if cuda else "cpu",
        "dataset": dataset,
        "dataset_built_now": built,
        "settings": {"iters": iters, "warmup": warmup, "max_batch": args.max_batch,
                     "mem_fraction": args.mem_fraction, "batch_ladder": list(BATCH_LADDER),
                     "baseline_loader": loader[0].split("=")[1], "overrides": overrides},
        "flops": flops,
        "measured_peaks": None,
        "rows": [],
        "sampling": None,
    }
    json_path = out_dir / f"{name or table}.json"

    if args.measure_peak:
        if not cuda:
            print("bench: --measure-peak needs CUDA; skipped")
        else:
            got = spawn("peaks", {}, args.row_timeout)
            result["measured_peaks"] = got.get("result")
            print(f"bench: measured peaks (TFLOP/s): {got.get('result') or got.get('error')}", flush=True)

    # ---- the rows --------------------------------------------------------------------------------------------------
    resolved: dict[tuple[str, str], int] = {}  # (preset, row name) -> the batch it ran at
    cap = min(args.max_batch, dataset["num_images"]) if dataset else None
    over = {(row.preset, row.name): [*row_overrides(row, data_overrides, data_dir), *overrides]
            for row in [*rows, *(table_rows or [])]}  # an unselected row's too: its probe may give a batch
    probes: dict[tuple[str, str], dict] = {}  # a probe runs once, in the warm-up's planning or in the row's turn

    def batch_of(row: Row, known: dict) -> tuple[int | None, str | None, dict | None, str | None]:
        """(batch, how it was chosen, the probe's result, why there is none) of a row; `known`: the batches of the
        rows before it."""
        if batch_fixed:
            return batch_fixed, "fixed by data.batch_size", None, None
        if isinstance(row.batch, int):
            return min(row.batch, dataset["num_images"]), None, None, None
        if row.batch == "max" and not cuda:
            return None, None, None, "the largest-batch probe needs CUDA; pass data.batch_size=N"
        if row.batch == "max":
            key = (row.preset, row.name)
            if key not in probes:
                probes[key] = spawn("probe", {"preset": row.preset, "overrides": over[key], "cap": cap,
                                              "mem_fraction": args.mem_fraction}, args.row_timeout)
            probe = probes[key]
            how = f"largest batch of the ladder fitting {args.mem_fraction:.0%} of GPU memory (eager probe, cap {cap})"
            return (probe.get("result") or {}).get("batch_size"), how, probe, probe.get("error")
        if (row.preset, row.batch) in known:
            return known[(row.preset, row.batch)], None, None, None
        source = next((r for r in table_rows or [] if (r.preset, r.name) == (row.preset, row.batch)), None)
        if source is not None and source not in rows:  # not selected: its batch as its own rule gives it
            batch, how, probe, why = batch_of(source, known)
            return batch, f"as row '{source.name}' (not selected here){': ' + how if how else ''}", probe, why
        return (None, None, None,
                f"its batch comes from row '{row.batch}', which did not run (failed or not selected); pass "
                "data.batch_size=N")

    warmed = warm_rows(rows, over, batch_of, args) if getattr(args, "warm", 0) and cuda else {}
    result["warm"] = {"jobs": args.warm, "rows": len(warmed)} if warmed else None
    for i, (row, row_f) in enumerate(zip(rows, row_flops), 1):
        row_over = over[(row.preset, row.name)]
        entry = {"name": row_name(row, overrides), "group": row.preset,
                 "preset": row.preset, "baseline": row.baseline, "overrides": row_over, "batch_rule": row.batch,
                 "flops": row_f, "status": None, "raw": None, "warm": warmed.get((row.preset, row.name))}
        stopping.doing(f"row {i} of {len(rows)} ({row.preset}: {entry['name']})")
        batch, batch_note, probe, why = batch_of(row, resolved)
        print(f"\nbench: [{i}/{len(rows)}] {row.preset}: {entry['name']} (batch {batch})", flush=True)
        if batch is None:
            entry.update(status="failed", error=why)
        else:
            got = spawn("row", {"preset": row.preset, "overrides": row_over, "batch_size": batch,
                                "iters": iters, "warmup": warmup}, args.row_timeout)
            entry.update(status=got["status"], error=got.get("error"), raw=got.get("result"))
            if entry["raw"] is not None:
                entry["raw"]["batch_note"] = batch_note
                entry["raw"]["batch_probe"] = (probe or {}).get("result")
                entry["config"] = entry["raw"].pop("config")
                resolved[(row.preset, row.name)] = batch
        result["rows"].append(entry)
        save(result, json_path)  # after every row: a crash or timeout mid-table keeps the rows measured
        if entry["status"] == "ok":
            print(f"bench:   {_summary_line(entry['raw'], row_f, result['device_name'])}", flush=True)
        else:
            print(f"bench:   FAILED: {entry['error']}", flush=True)

    if sampling:
        run_sampling_rows(result, json_path, args, cuda, sample_presets, overrides)

    # ---- write ---------------------------------------------------------------------------------------------------
    result["complete"] = True
    add_metrics(result)
    write_json(json_path, result)
    md, png = write_reports(result, json_path)
    failed = [r["name"] for r in result["rows"] if r["status"] != "ok"] + [
        f"sampling {s['name']} {s['mode']}" for s in result["sampling"] or [] if s["status"] != "ok"]
    print(terminal_table(result))
    print(f"\nbench: wrote {json_path}, {md.name}, {png.name}"
          + (f"; {len(failed)} row(s) FAILED: {', '.join(failed)}" if failed else ""))
    unlock_folder(out_dir)  # a table that raised keeps it until this process ends
    return (1 if failed else 0), json_path
