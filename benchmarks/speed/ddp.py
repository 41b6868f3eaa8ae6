"""`make bench-ddp`: images/s and MFU per GPU of the real trainer under torchrun on 1, 2, 4 GPUs of one host.

    python -m benchmarks.speed.ddp --data data  # ddpm-cifar10, bf16, compile, batch 512 per GPU
    python -m benchmarks.speed.ddp --data data --gpus 1,2 --mode global   # global batch fixed instead of per-GPU batch
    python -m benchmarks.speed.ddp --data data --gpus 1,4 --mode per-gpu --control --allreduce \
        --variant bf16-grads:train.ddp_grad_dtype=bf16 --variant ddp:train.ddp_reduce=ddp   # where time goes
    python -m benchmarks.speed.ddp --data data --mode per-gpu --variant graph-cuts:"train.ddp_reduce=ddp train.ddp_split=True"
    python -m benchmarks.speed.ddp --data data --device cpu --preset tiny data.batch_size=16 --steps 12   # gloo, for CI

Each point is one `torchrun --standalone --nproc_per_node N -m ffcv_ddpm.train ...` run: the trainer's own loop,
FFCV shards per rank (`distributed=True`), CPU cores split evenly among ranks as FFCV workers. Throughput and data
wait come from the run's stats.jsonl (CUDA events on rank 0, the wait for data inside each iteration); the first
log interval (compilation, FFCV's first epoch) is dropped. img/s = the other intervals' images over their seconds
(a stalled interval counts with all its time; their median rate and the trainer's images over wall time beside it);
scaling efficiency = img/s(N) / (N x img/s(1)). --rederive recomputes committed files by this formula. The modes'
one-process points at the same batch (--mode both) are one run, recorded in both with `same_run_as`.
NVLink multicast stays off in every rank (ffcv_ddpm.train.NO_MULTICAST, also put in the children's environment).
A compiled CUDA run first compiles every graph its points use, all at once (--warm: each point would otherwise compile
cold in turn, ~150 s for a DDP graph), so a 1, 2, 4-GPU comparison fits in one 10-minute GPU call.

Where a loss comes from: --control runs N independent single-GPU trainers at once (no process group), the host's own
ceiling for N GPUs (shared cores, memory, power); --allreduce times an all-reduce of the model's gradient size, the
communication a step must hide behind its backward; --variant reruns the DDP points with other settings: DDP's own
(train.ddp_*: bucket size, bf16 all-reduce, graph cut at the buckets) or any other (the loader, CUDA graphs, the
batch per GPU), which run one process too and scale against it; every rank's data wait is in each point's
stats, and its step time as median and mean: a mean well above the median means some steps stalled.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import (DATA_HELP, DEFAULT_DATA, REPO, BenchError, commit_text, ensure_dataset, md_table,
                               pyplot, results_out, save_figure, write_json, write_text)
from benchmarks.common import parse_variant as parse_any_variant
from benchmarks.speed.flops import train_flops_per_image
from benchmarks.speed.peaks import lookup_peak
from ffcv_ddpm import stopping
from ffcv_ddpm.checks import Parser, above, at_least, fail, int_list, option
from ffcv_ddpm.config import load_config
from ffcv_ddpm.env import environment
from ffcv_ddpm.step import noise_seed
from ffcv_ddpm.train import NO_MULTICAST, img_per_s_over, read_stats
from ffcv_ddpm.unet import build_model

CONTROL = "independent (no DDP)"  # the control's mode name in the results


def trainer_args(args, overrides: list[str], beton: Path, out_dir: Path, per_rank_batch: int, workers: int) -> list:
    """The trainer's command-line arguments of one point (after `-m ffcv_ddpm.train`)."""
    common = [f"data.num_workers={workers}", f"train.steps={args.steps}",
              f"train.log_every={args.log_every}", "train.ckpt_every=1000000000", "train.sample_every=0",
              "train.progress=False", "train.telemetry=True", f"train.out_dir={out_dir}",
              f"train.device={args.device}", *overrides, f"data.batch_size={per_rank_batch}"]
    if args.device == "cpu":
        common += ["train.precision=fp32", "train.compile=False"]
    return ["--preset", args.preset, "--data", str(beton), *common]


def throughput(stats: list[dict]) -> dict:
    """img/s of a run from its stats.jsonl lines, the first interval (compilation, FFCV's first-epoch JIT) dropped:
    img_per_s, the steady intervals' images over their seconds (an interval that stalled counts with all its time;
    stalls are likelier with more ranks, so a median of the intervals' rates flatters the larger points);
    img_per_s_median, that median, kept beside it (the two apart: some interval stalled); img_per_s_wall, the images
    over the wall time from line to line (the log intervals' syncs and all-gathers too), where the trainer logs it."""
    steady, after = (stats[1:], stats[0]["step"]) if len(stats) > 1 else (stats, 0)
    out = {"img_per_s": img_per_s_over(steady, after),
           "img_per_s_median": float(np.median([s["img_per_s"] for s in steady]))}
    if all("img_per_s_wall" in s for s in steady):
        out["img_per_s_wall"] = img_per_s_over(steady, after, "img_per_s_wall")
    return out


def read_run(out_dir: Path) -> dict:
    """Throughput of one finished run from its stats.jsonl (throughput: the first interval dropped), its data
    wait and the other figures of its steady intervals."""
    (run_dir,) = [p for p in out_dir.iterdir() if p.is_dir()]
    stats = read_stats(run_dir)
    steady = stats[1:] or stats
    point = {"stats": stats, **throughput(stats),
             "data_wait_share": float(np.median([s["data_wait_share"] for s in steady])),
             "peak_mem_gib": steady[-1]["peak_mem_gib"],
             "config": json.loads((run_dir / "config.json").read_text())}
    if "rank_data_wait_share" in steady[-1]:  # every rank's data wait: the slowest rank sets the pace
        point["max_rank_data_wait_share"] = float(np.median([max(s["rank_data_wait_share"]) for s in steady]))
    point["slowest_step_ms"] = max(s["iter_ms_max"] for s in steady)
    if "gc_ms" in steady[-1]:  # the most time any rank spent in Python's collections in one interval
        point["gc_ms_worst_interval"] = max(max(s.get("rank_gc_ms", [s["gc_ms"]])) for s in steady)
    if "rank_allreduce_ms_mean" in steady[-1]:  # flat: the rank that arrives last waits least
        point["allreduce_ms_by_rank"] = np.median([s["rank_allreduce_ms_mean"] for s in steady], axis=0).tolist()
    gpu = gpu_state(run_dir / "telemetry.jsonl", after_s=stats[0]["wall_s"] if len(stats) > 1 else 0.0)
    if gpu:
        point["gpu0"] = gpu
    return point


def gpu_state(path: Path, after_s: float) -> dict | None:
    """GPU 0's SM clock and power over the measured intervals (NVML samples after the first interval): a point
    slower than its twin with the same settings shows here whether the card throttled (clock, power) or not."""
    if not path.exists():
        return None
    samples = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    samples = [s for s in samples if s["t"] >= after_s]
    clock = [s["sm_clock_mhz"] for s in samples if s.get("sm_clock_mhz") is not None]
    power = [s["power_w"] for s in samples if s.get("power_w") is not None]
    if not clock or not power:
        return None
    return {"samples": len(samples), "sm_clock_mhz_p10": float(np.percentile(clock, 10)),
            "sm_clock_mhz_median": float(np.median(clock)), "power_w_median": float(np.median(power)),
            "power_w_max": float(max(power))}


def _text(*outputs) -> str:
    """The end of a stopped child's output (TimeoutExpired holds bytes or str, or None)."""
    text = "".join(o.decode(errors="replace") if isinstance(o, bytes) else (o or "") for o in outputs)
    return text[-3000:]


def child_env(workers: int) -> dict:
    """A trainer process's environment: NVLink multicast off, OpenMP threads to its share of the cores."""
    return {**os.environ, **NO_MULTICAST, "OMP_NUM_THREADS": str(workers)}


def torchrun_cmd(args, overrides: list[str], beton: Path, out_dir: Path, nproc: int, per_rank_batch: int,
                 workers: int) -> list[str]:
    """`torchrun --standalone --nproc_per_node N -m ffcv_ddpm.train ...`: a point, or its warm-up (the same command
    with fewer steps, so that it compiles the graph the point will load)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", "ffcv_ddpm.train", *trainer_args(args, overrides, beton, out_dir, per_rank_batch, workers)]


def run_point(args, overrides: list[str], beton: Path, nproc: int, per_rank_batch: int, out_dir: Path) -> dict:
    """One `torchrun --nproc_per_node N -m ffcv_ddpm.train` run."""
    workers = max(1, (os.cpu_count() or 1) // nproc)
    cmd = torchrun_cmd(args, overrides, beton, out_dir, nproc, per_rank_batch, workers)
    env = child_env(workers)
    try:
        proc = stopping.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as e:  # recorded like a failure: the points after it still run
        return {"nproc": nproc, "error": f"stopped after --timeout {args.timeout:g} s\n" + _text(e.stdout, e.stderr)}
    if proc.returncode != 0:
        return {"nproc": nproc, "error": (proc.stdout + proc.stderr)[-3000:]}
    return {"nproc": nproc, "per_rank_batch": per_rank_batch, "global_batch": per_rank_batch * nproc,
            "workers_per_rank": workers, **read_run(out_dir)}


WARM_IMAGES_PER_GPU = 2048  # per-rank batch summed over the warm-up runs sharing an 80 GB GPU (ddpm-cifar10: ~50 GB)


def warm_images_per_gpu(total_bytes: int) -> int:
    """WARM_IMAGES_PER_GPU scaled to a GPU's memory, in steps of 512: 2048 on an H100 (79 GiB), 3584 on an H200 (139
    GiB), where the global-batch warm-up (512 x 4, 1024 x 2 and 2048 x 1 per rank) then compiles in one round, not two
    (305 s on 4 H200s: results/h200/ddp-scaling/flat-1024)."""
    return max(512, int(WARM_IMAGES_PER_GPU * total_bytes / (79 * 2**30)) // 512 * 512)


def warm_jobs(plan: list) -> list[tuple[int, int, tuple[str, ...]]]:
    """The distinct compiled graphs the plan's points run, as (processes, per-rank batch, overrides); an independent
    trainer runs the one-process graph of its batch."""
    jobs = []
    for _, ns, per_gpu, runner, extra, batch in plan:
        for n in ns:
            job = (1 if runner is run_independent else n, batch if per_gpu else batch // n, tuple(extra))
            if job not in jobs:
                jobs.append(job)
    return jobs


def warm_up(args, jobs: list, beton: Path, gpus: int, images_per_gpu: int = WARM_IMAGES_PER_GPU) -> dict:
    """Compiles every graph the timed points will run before any of them is timed, all at once (compilation is
    CPU-bound, so N graphs at once take little longer than one), each a 3-step run of the trainer that leaves its
    kernels in the compile cache (ffcv_ddpm.env); each timed point then loads them instead of compiling cold
    (a DDP graph compiled for ~150 s on 4 H100s). GPUs are shared by at most `images_per_gpu` of per-rank batch at
    a time; a one-process run goes to the least loaded GPU. A warm-up that fails is recorded and costs nothing else:
    its point compiles for itself."""
    print(f"bench-ddp: compiling the {len(jobs)} graphs of the points at once, before timing any", flush=True)
    t0 = time.perf_counter()
    load = [0] * max(gpus, 1)
    # Multi-process runs placed first, so that the one-process runs go to the GPUs they leave least loaded.
    pending, running, done = sorted(jobs, key=lambda j: -j[0]), [], []
    with tempfile.TemporaryDirectory() as tmp:
        while pending or running:
            for job in list(pending):
                n, per_rank, extra = job
                used = ([g % len(load) for g in range(n)] if n > 1  # (on the CPU one slot stands for the host)
                        else [min(range(len(load)), key=load.__getitem__)])
                if running and any(load[g] + per_rank > images_per_gpu for g in used):
                    continue
                pending.remove(job)
                for g in used:
                    load[g] += per_rank
                out_dir = Path(tmp) / f"w{len(done) + len(running)}"
                out_dir.mkdir()
                env = child_env(2)
                if n == 1 and args.device != "cpu":
                    env["CUDA_VISIBLE_DEVICES"] = str(used[0])  # seen as cuda:0, as in the timed point: one graph
                warm = argparse.Namespace(**{**vars(args), "steps": 3, "log_every": 1})
                cmd = torchrun_cmd(warm, list(extra), beton, out_dir, n, per_rank, 2)
                with open(out_dir / "log.txt", "w") as log:  # a file, not a pipe: no run waits on a full pipe
                    proc = stopping.start(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
                running.append((job, used, proc, time.perf_counter(), out_dir / "log.txt"))
            job, used, proc, started, log_path = running.pop(0)
            note = ""
            try:
                stopping.finish(proc, timeout=max(1.0, args.timeout - (time.perf_counter() - started)))
            except subprocess.TimeoutExpired:  # finish killed it and all it started
                note = f"\nstopped after --timeout {args.timeout:g} s"
            output = log_path.read_text(errors="replace") + note
            for g in used:
                load[g] -= job[1]
            done.append({"nproc": job[0], "per_rank_batch": job[1], "overrides": list(job[2]),
                         "seconds": time.perf_counter() - started, "rc": proc.returncode,
                         **({"error": output[-1500:]} if proc.returncode else {})})
            print(f"bench-ddp: warm-up {job[0]} process(es), batch {job[1]} per rank"
                  f"{' ' + ' '.join(job[2]) if job[2] else ''}: "
                  f"{'rc ' + str(proc.returncode) if proc.returncode else 'compiled'} "
                  f"({done[-1]['seconds']:.0f} s)", flush=True)
    return {"seconds": time.perf_counter() - t0, "runs": done}


def run_independent(args, overrides: list[str], beton: Path, nproc: int, per_rank_batch: int, out_dir: Path) -> dict:
    """The control: N single-GPU trainers at once, one per GPU, no process group. Their summed img/s is what this
    host gives N GPUs without any communication (shared CPU cores, host memory, power); DDP's loss beyond it is
    DDP's own."""
    workers = max(1, (os.cpu_count() or 1) // nproc)
    procs = []
    for i in range(nproc):
        run_out = out_dir / f"gpu{i}"
        run_out.mkdir()
        env = child_env(workers)
        if args.device != "cpu":
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        cmd = [sys.executable, "-m", "ffcv_ddpm.train",
               *trainer_args(args, overrides, beton, run_out, per_rank_batch, workers)]
        procs.append(stopping.start(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True))
    try:
        logs = [stopping.finish(p, timeout=args.timeout)[0] for p in procs]
    except subprocess.TimeoutExpired as e:
        stopping.end(procs, grace=0)
        return {"nproc": nproc, "error": f"stopped after --timeout {args.timeout:g} s\n" + _text(e.stdout)}
    if any(p.returncode != 0 for p in procs):
        return {"nproc": nproc, "error": "\n".join(log[-1500:] for log in logs)}
    runs = [read_run(out_dir / f"gpu{i}") for i in range(nproc)]
    return {"nproc": nproc, "per_rank_batch": per_rank_batch, "global_batch": per_rank_batch * nproc,
            "workers_per_rank": workers, **sum_of_processes([r["stats"] for r in runs]),
            "per_process_stats": [r["stats"] for r in runs],
            "data_wait_share": max(r["data_wait_share"] for r in runs),
            "peak_mem_gib": runs[0]["peak_mem_gib"], "config": runs[0]["config"],
            **({"gpu0": runs[0]["gpu0"]} if "gpu0" in runs[0] else {})}


def sum_of_processes(stats: list[list[dict]]) -> dict:
    """The control's throughput: each independent process's (throughput), summed; per_process_img_per_s beside."""
    runs = [throughput(s) for s in stats]
    out = {key: sum(r[key] for r in runs) for key in runs[0] if all(key in r for r in runs)}
    return {**out, "per_process_img_per_s": [r["img_per_s"] for r in runs]}


def parse_variant(text: str) -> tuple[str, list[str]]:
    """--variant NAME:KEY=VALUE[,KEY=VALUE...]: a DDP setting to measure beside the default
    (benchmarks.common.parse_variant: commas or spaces between the overrides, as levers takes them)."""
    name, overrides = parse_any_variant(text, "bf16-grads:train.ddp_grad_dtype=bf16")
    return name, list(overrides)


def _allreduce_worker(rank: int, nproc: int, store: str, numel: int, iters: int, results, cuda: bool) -> None:
    import torch
    import torch.distributed as dist

    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{store}", rank=rank, world_size=nproc)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        buf = torch.randn(numel, device=device).to(dtype)  # random, not zeros: a link may compress nothing, but still
        for _ in range(3):
            dist.all_reduce(buf)
        ms = []
        for _ in range(iters):
            dist.barrier()
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dist.all_reduce(buf)
                end.record()
                end.synchronize()
                ms.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                dist.all_reduce(buf)
                ms.append((time.perf_counter() - t0) * 1e3)
        t = float(np.median(ms))
        nbytes = numel * buf.element_size()
        # NCCL's bus bandwidth: what each link carries in a ring all-reduce, comparable across process counts.
        out[name] = {"bytes": nbytes, "ms_median": t, "ms_min": float(min(ms)),
                     "bus_gb_per_s": nbytes * 2 * (nproc - 1) / nproc / (t / 1e3) / 1e9}
    if rank == 0:
        results.update(out)
    dist.destroy_process_group()


def allreduce_point(nproc: int, numel: int, cuda: bool, iters: int = 20) -> dict:
    """All-reduce of a buffer the size of the model's gradients across `nproc` GPUs (NCCL; `cuda` False: processes
    over gloo, as --device cpu trains) in fp32, as DDP sends them by default, and bf16: the communication each step
    has to hide behind the backward."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        results = mp.Manager().dict()
        workers = mp.spawn(_allreduce_worker, args=(nproc, f"{tmp}/store", numel, iters, results, cuda), nprocs=nproc,
                           join=False)
        stopping.track(workers.processes)  # a signal stops them with the command
        try:
            while not workers.join(timeout=stopping.POLL_S):
                stopping.check()
        finally:
            stopping.end(workers.processes)
        return {"nproc": nproc, "numel": numel, **dict(results)}


LOSS_MARGIN = 1.5  # an N-GPU curve may stray from the one-GPU curve 1.5x as far as another run's random draws do


def many_of(counts: list[int]) -> list[int]:
    return [n for n in counts if n > 1]


def variant_counts(counts: list[int], extra: list[str]) -> list[int]:
    """The process counts a variant runs: N > 1 alone when it sets only DDP's own settings (train.ddp_*: one process
    runs the same without them); else one process too, so that its scaling is against one GPU with its settings (CUDA
    graphs or another loader change one GPU's speed as well: NOTES item 18)."""
    ddp_only = all(item.split("=", 1)[0].lstrip("-").startswith("train.ddp_") for item in extra)
    return many_of(counts) if ddp_only else counts


def loss_control(args, overrides: list[str], beton: Path, batch: int, cfg, nproc: int) -> dict:
    """One process at the global batch, the same initial weights, other random draws: another data order (data.seed)
    and another noise, timestep and dropout stream (train.noise_seed, none of the N ranks' streams). That is all an
    N-process run changes, so the control's curve shows how far two equally valid runs stray from each other."""
    draws = [f"data.seed={cfg.data.seed + 1}", f"train.noise_seed={noise_seed(cfg, nproc)}"]
    with tempfile.TemporaryDirectory() as tmp:
        return run_point(args, [*overrides, *draws], beton, 1, batch, Path(tmp))


def loss_check(points: list[dict], control: dict) -> dict:
    """Each N-process curve against the one-process curve of the same global batch (numerics.check's statistic:
    the largest moving average of loss(N) / loss(1) - 1 after the first 10% of steps), with the random-draws
    control's value of that statistic x LOSS_MARGIN as the tolerance."""
    from benchmarks.speed.numerics import check

    one = next(p for p in points if p["nproc"] == 1)
    if "error" in one or "error" in control:
        return {"error": "the one-process run or its random-draws control failed: see their points"}
    floor = check(one["stats"], control["stats"], tol=float("inf"), skip=0.1, smooth=3)
    tol = LOSS_MARGIN * floor["max_abs_smoothed"]
    out = {"control": control, "floor": floor["max_abs_smoothed"], "tol": tol, "margin": LOSS_MARGIN, "checks": []}
    for p in points:
        if p["nproc"] > 1 and "error" not in p:
            c = check(one["stats"], p["stats"], tol=tol, skip=0.1, smooth=3)
            out["checks"].append({"nproc": p["nproc"], **c})
    return out


def add_metrics(result: dict) -> None:
    flops = result["flops_per_image"]
    # Efficiency is against one process of the same mode; modes without one (the control, variants of DDP's own
    # settings) use the per-GPU point: one process has no DDP settings to vary.
    reference = next((p["img_per_s"] for p in result["points"].get("per-GPU", [])
                      if p["nproc"] == 1 and "error" not in p), None)
    for mode, points in result["points"].items():
        ok = [p for p in points if "error" not in p]
        one = next((p["img_per_s"] for p in ok if p["nproc"] == 1), reference)
        for p in ok:
            per_gpu = p["img_per_s"] / p["nproc"]
            p["img_per_s_per_gpu"] = per_gpu
            p["tflops_per_gpu"] = per_gpu * flops / 1e12
            peak = result["peak_tflops"]
            p["mfu_per_gpu"] = p["tflops_per_gpu"] / peak if peak else None
            if executed := result.get("executed_flops_per_image"):  # older files: not recorded
                p["executed_mfu_per_gpu"] = per_gpu * executed / 1e12 / peak if peak else None
            p["scaling_efficiency"] = p["img_per_s"] / (p["nproc"] * one) if one else None


def step_ms(p: dict) -> tuple[float, float] | None:
    """(median, mean) ms per step of a point, or None without per-interval stats (the independent control): the
    median over the measured intervals of each one's median step, and the mean step over all of them (the global
    batch over the point's img/s: their time over their steps). A mean well above the median means some steps
    stalled."""
    if not p.get("stats"):
        return None
    steady = p["stats"][1:] or p["stats"]
    mean = p["per_rank_batch"] * p["nproc"] / p["img_per_s"] * 1e3
    return float(np.median([s["iter_ms_median"] for s in steady])), mean


def rederive(result: dict) -> dict:
    """A copy of a result with every point's img/s recomputed from its intervals by today's formula (throughput) and
    the figures derived from it (add_metrics): a file written before the formula changed, read as one written now.
    A point without intervals (the independent control before its processes' stats were kept) keeps the file's
    img/s (a sum of median intervals), marked "img_per_s_not_rederived"."""
    out = copy.deepcopy(result)
    for p in (p for points in out["points"].values() for p in points if "error" not in p):
        if p.get("stats"):
            p.update(throughput(p["stats"]))
        elif p.get("per_process_stats"):
            p.update(sum_of_processes(p["per_process_stats"]))
        else:
            p["img_per_s_not_rederived"] = True
    add_metrics(out)
    return out


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


REDERIVED = "rederived.md"  # the note --rederive writes in each folder it is given


def rederived_note(folder: Path) -> str:
    """The note on the DDP results under `folder` (every JSON with points, as the ledger reads them): each point's
    img/s, scaling efficiency and MFU per GPU as its file holds them and as rederive computes them now."""
    rows, kept = [], False
    for path in sorted(folder.rglob("*.json")):
        try:
            result = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise BenchError(f"cannot read {path}: {e}") from None
        if not (isinstance(result, dict) and "points" in result and "flops_per_image" in result):
            continue
        now, link = rederive(result), path.relative_to(folder).as_posix()
        for mode, points in result["points"].items():
            for old, new in zip(points, now["points"][mode]):
                if "error" in old:
                    continue
                kept |= bool(new.get("img_per_s_not_rederived"))
                rows.append([f"[{link}]({link})", mode, str(old["nproc"]), f"{old['img_per_s']:,.0f}",
                             "not re-derivable: no intervals kept" if new.get("img_per_s_not_rederived")
                             else f"{new['img_per_s']:,.0f} ({new['img_per_s'] / old['img_per_s'] - 1:+.2%})",
                             *(f"{_pct(old.get(k))} -> {_pct(new.get(k))}"
                               for k in ("scaling_efficiency", "mfu_per_gpu"))])
    shown = folder.resolve().relative_to(REPO) if folder.resolve().is_relative_to(REPO) else folder
    return "\n".join([
        "# DDP img/s re-derived: images over seconds", "",
        f"Generated by `python -m benchmarks.speed.ddp --rederive {shown.as_posix()}` from the result files below: "
        "do not edit by hand. Their img/s was the median of the steady log intervals' rates (the first interval, "
        "compilation, dropped), which leaves a stalled interval out; today's is the same intervals' images over "
        "their seconds (`benchmarks.speed.ddp.throughput`), and the scaling efficiency and MFU per GPU follow from "
        "it." + (" The independent control kept no intervals: its img/s stays the sum of its processes' median "
                 "intervals, its efficiency is against the re-derived one-GPU point." if kept else ""), "",
        *md_table(["file", "mode", "GPUs", "img/s as filed (median interval)", "img/s re-derived (images / seconds)",
                   "scaling efficiency, filed -> re-derived", "MFU per GPU, filed -> re-derived"], rows), ""])


def render(result: dict, out: Path) -> None:
    lines = [f"# DDP scaling: {result['preset']} on {result['device_name'] or 'CPU (gloo)'}", "",
             f"- commit {commit_text(result['environment'], 40)}, torch {result['environment'].get('torch')}, "
             f"{result['environment'].get('date_utc')}; command: `{result['command']}`",
             f"- data: {result['dataset']} ; {result['flops_per_image'] / 1e9:.2f} GFLOP/img fwd+bwd; peak "
             f"{result['peak_tflops'] or 'n/a'} TFLOP/s per GPU ({result['precision']})", ""]
    for mode, points in result["points"].items():
        lines += [f"## {mode}", "", "| GPUs | batch per GPU | global batch | img/s | img/s: median interval / wall "
                  "| img/s per GPU | MFU per GPU (executed FLOPs) | scaling efficiency | step ms (median / mean) "
                  "| data wait (rank 0) "
                  "| data wait (slowest rank) | slowest step ms, most GC ms in an interval "
                  "| all-reduce ms by rank (flat) | peak mem GiB "
                  "| GPU 0 SM clock MHz (p10 / median), power W (median) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in points:
            if "error" in p:
                lines.append(f"| {p['nproc']} | failed: see JSON | | | | | | | | | | | | | |")
                continue
            other = " / ".join(f"{p[k]:,.0f}" if k in p else "-" for k in ("img_per_s_median", "img_per_s_wall"))
            mem = f"{p['peak_mem_gib']:.1f}" if p["peak_mem_gib"] is not None else "n/a"
            slowest = f"{p['max_rank_data_wait_share']:.2%}" if "max_rank_data_wait_share" in p else "-"
            ms = step_ms(p)
            ms = f"{ms[0]:.1f} / {ms[1]:.1f}" if ms else "-"
            slow = (f"{p['slowest_step_ms']:.1f}, {p['gc_ms_worst_interval']:.1f}" if "gc_ms_worst_interval" in p
                    else f"{p['slowest_step_ms']:.1f}" if "slowest_step_ms" in p else "-")
            ar = " / ".join(f"{x:.2f}" for x in p.get("allreduce_ms_by_rank", [])) or "-"
            g = p.get("gpu0")
            gpu = (f"{g['sm_clock_mhz_p10']:.0f} / {g['sm_clock_mhz_median']:.0f}, {g['power_w_median']:.0f}" if g
                   else "-")
            gpus = f"{p['nproc']} (the {p['same_run_as']} run)" if "same_run_as" in p else p["nproc"]
            lines.append(f"| {gpus} | {p['per_rank_batch']} | {p['global_batch']} | {p['img_per_s']:,.0f} | "
                         f"{other} | {p['img_per_s_per_gpu']:,.0f} | {_pct(p['mfu_per_gpu'])}"
                         + (f" ({_pct(p['executed_mfu_per_gpu'])})" if p.get("executed_mfu_per_gpu") is not None
                            else "")
                         + " "
                         f"| {_pct(p['scaling_efficiency'])} | {ms} | {p['data_wait_share']:.2%} "
                         f"| {slowest} | {slow} | {ar} | {mem} | {gpu} |")
        lines.append("")
    lc = result.get("loss_check")
    if lc and "error" not in lc:
        lines += ["## Loss curves: N GPUs against one, same global batch", "",
                  f"Statistic: the largest moving average over 3 log intervals of loss(N) / loss(1) - 1 after the "
                  f"first 10% of steps. Tolerance: {LOSS_MARGIN}x the same statistic for a one-GPU run from the same "
                  f"weights with other random draws (data.seed, train.noise_seed): {lc['floor']:.2%} x {LOSS_MARGIN} "
                  f"= {lc['tol']:.2%}.", "",
                  "| GPUs | max deviation | at step | mean ratio - 1 | within tolerance |", "|---|---|---|---|---|"]
        lines += [f"| {c['nproc']} | {c['max_abs_smoothed']:.2%} | {c['at_step']} | {c['mean_ratio_minus_1']:+.2%} "
                  f"| {'yes' if c['ok'] else 'NO'} |" for c in lc["checks"]]
        lines.append("")
    elif lc:
        lines += ["## Loss curves", "", lc["error"], ""]
    if result.get("allreduce"):
        lines += ["## All-reduce of the gradients (one bucket of all of them)", "",
                  "| GPUs | dtype | MB | ms (median) | bus GB/s |", "|---|---|---|---|---|"]
        lines += [f"| {a['nproc']} | {dt} | {a[dt]['bytes'] / 1e6:.0f} | {a[dt]['ms_median']:.2f} | "
                  f"{a[dt]['bus_gb_per_s']:.0f} |" for a in result["allreduce"] for dt in ("fp32", "bf16")]
        lines.append("")
    write_text(out.with_suffix(".md"), "\n".join(lines))

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for mode, points in result["points"].items():
        ok = [p for p in points if "error" not in p]
        ax.plot([p["nproc"] for p in ok], [p["img_per_s"] for p in ok], "o-", label=mode)
    ns = sorted({p["nproc"] for pts in result["points"].values() for p in pts})
    one = [p["img_per_s"] for p in result["points"].get("per-GPU", []) if p.get("nproc") == 1 and "error" not in p]
    if one:
        ax.plot(ns, [n * one[0] for n in ns], "k:", label="linear")
    ax.set_xlabel("GPUs (processes)")
    ax.set_ylabel("images/s")
    ax.set_xticks(ns)
    ax.set_title(f"DDP scaling, {result['preset']}")
    ax.legend()
    fig.tight_layout()
    save_figure(fig, out.with_suffix(".png"), 120)


def main(argv: list[str] | None = None) -> int:
    """SIGTERM/SIGINT stop the trainer processes too (ffcv_ddpm.stopping): one line, exit 128 + signal."""
    return stopping.run_command("ddp", lambda stop: run(argv))


def run(argv: list[str] | None) -> int:
    p = Parser(prog="python -m benchmarks.speed.ddp", doc=__doc__, overrides=True,
               epilog="The overrides go to every trainer process. data.batch_size (default here 512) is the batch per "
                      "GPU in per-gpu mode and the global batch, split among the processes, in global mode.")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help=DATA_HELP)
    p.add_argument("--preset", default="ddpm-cifar10")
    p.add_argument("--gpus", type=int_list(at_least(1)), default="1,2,4", help="process counts (comma-separated)")
    p.add_argument("--mode", choices=("per-gpu", "global", "both"), default="both",
                   help="keep the batch per GPU fixed, the global batch fixed (data.batch_size / N per GPU), or both")
    p.add_argument("--steps", type=option(int, at_least(1)), default=150, help="training steps per point (train.steps)")
    p.add_argument("--log-every", type=option(int, at_least(1)), default=25, help="steps per stats interval")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="cuda",
                   help="where the ranks run (train.device): cuda (NCCL) | cpu (gloo) | auto (cuda if there is one)")
    p.add_argument("--timeout", type=option(float, above(0)), default=1200, help="seconds per point")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<card>)")
    p.add_argument("--control", action="store_true",
                   help="also run N independent single-GPU trainers at once (no DDP) for each N > 1: what the host "
                        "gives N GPUs without communication")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:KEY=VALUE[,KEY=VALUE...]",
                   help="also run the per-GPU points with these overrides (repeatable), e.g. "
                        "'bf16-grads:train.ddp_grad_dtype=bf16' or 'gpu-data:data.loader=gpu'; one process too "
                        "unless it sets train.ddp_* keys alone")
    p.add_argument("--loss-check", action="store_true",
                   help="global mode: compare each N-process loss curve with the one-process curve at the same global "
                        "batch, against a one-process run from the same weights with other random draws (data order, noise, "
                        "timesteps, dropout: the tolerance); exit 1 if a curve strays further")
    p.add_argument("--allreduce", action="store_true",
                   help="also time an all-reduce of the model's gradient size (fp32 and bf16) on each N > 1")
    p.add_argument("--warm", choices=("auto", "on", "off"), default="auto",
                   help="compile every point's graph at once before timing any (3-step runs filling the compile "
                        "cache): auto = on for compiled CUDA runs")
    p.add_argument("--rederive", type=Path, action="append", default=[], metavar="FOLDER",
                   help=f"run nothing: write FOLDER/{REDERIVED}, the DDP result files under FOLDER with their img/s "
                        "recomputed from their intervals by today's formula beside the figures they hold (repeatable)")
    args, overrides = p.parse_with_overrides(argv)
    if args.rederive:
        for folder in args.rederive:
            if not folder.is_dir():
                return fail("ddp", f"--rederive {folder}: no such folder")
            try:
                write_text(folder / REDERIVED, rederived_note(folder))
            except BenchError as e:
                return fail("ddp", f"--rederive: {e}")
            print(f"bench-ddp: wrote {folder / REDERIVED}")
        return 0
    p.check_paths(outputs=[("--out", args.out)])
    import torch

    counts = args.gpus
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:  # the trainer's config, checked before any dataset is built or process started
        cfg = load_config(args.preset, ["data.batch_size=512", *overrides])
    except ValueError as e:
        return fail("ddp", str(e))
    try:
        variants = []  # (name, settings, batch): data.batch_size in a variant is its batch per GPU
        for text in args.variant:
            name, extra = parse_variant(text)  # its ValueError names the --variant
            try:
                vcfg = load_config(args.preset, ["data.batch_size=512", *overrides, *extra])
            except ValueError as e:
                raise ValueError(f"--variant {text!r}: {e}") from None
            variants.append((name, extra, vcfg.data.batch_size))
    except ValueError as e:
        return fail("ddp", str(e))
    batch = cfg.data.batch_size
    if args.loss_check and (args.mode == "per-gpu" or 1 not in counts or not many_of(counts)):
        return fail("ddp", "--loss-check compares global-batch points with one process: give --mode global "
                           "(or both) and --gpus with 1 and a larger count")
    if args.mode != "per-gpu" and batch < max(counts):
        return fail("ddp", f"data.batch_size={batch} is the global batch in --mode {args.mode}: it must be "
                           f"at least the largest process count, {max(counts)}")
    if args.device != "cpu":
        have = torch.cuda.device_count()
        if have == 0:
            return fail("ddp", "no CUDA GPU; use --device cpu (gloo) for a functional check")
        if max(counts) > have:
            return fail("ddp", f"--gpus asks for {max(counts)} GPUs but this machine has {have}")
    device_name = torch.cuda.get_device_name(0) if args.device != "cpu" else None
    try:
        out = results_out(args.out, device_name) / "ddp.json"
        beton, built = ensure_dataset(args.data, num_synthetic=50_000)
    except BenchError as e:
        return fail("ddp", str(e))
    peak = lookup_peak(device_name, cfg.train.precision).tflops if device_name else None
    modes = {"per-gpu": ["per-GPU"], "global": ["global"], "both": ["per-GPU", "global"]}[args.mode]
    flops = train_flops_per_image(cfg.model)
    result = {"preset": args.preset, "device_name": device_name, "precision": cfg.train.precision,
              "command": "python -m benchmarks.speed.ddp " + " ".join(sys.argv[1:] if argv is None else argv),
              "environment": environment(), "dataset": str(beton), "dataset_built_now": built,
              "flops_per_image": flops["fwd_bwd"], "executed_flops_per_image": flops["executed_fwd_bwd"],
              "peak_tflops": peak,
              "points": {}}
    out.parent.mkdir(parents=True, exist_ok=True)
    many = many_of(counts)
    # (mode, process counts, per-rank batch rule, how a point runs, overrides, batch): the default first, so a call
    # cut short keeps the headline points.
    plan = [(m, counts, m == "per-GPU", run_point, overrides, batch) for m in modes[:1]]
    if args.control:
        plan.append((CONTROL, many, True, run_independent, overrides, batch))
    plan += [(f"per-GPU, {name}", variant_counts(counts, extra), True, run_point, [*overrides, *extra], vbatch)
             for name, extra, vbatch in variants]
    plan += [(m, counts, m == "per-GPU", run_point, overrides, batch) for m in modes[1:]]
    if args.warm == "on" or (args.warm == "auto" and args.device != "cpu" and cfg.train.compile):
        stopping.doing("the warm-up")
        cuda = args.device != "cpu"
        result["warm_up"] = warm_up(args, warm_jobs(plan), beton, torch.cuda.device_count() if cuda else 1,
                                    warm_images_per_gpu(torch.cuda.get_device_properties(0).total_memory) if cuda
                                    else WARM_IMAGES_PER_GPU)
        write_json(out, result, indent=2)
    if args.allreduce:
        stopping.doing("the all-reduce timing")
        result["allreduce"] = []
        numel = sum(p.numel() for p in build_model(cfg.model).parameters() if p.requires_grad)
        for n in many:
            result["allreduce"].append(allreduce_point(n, numel, cuda=args.device != "cpu"))
            a = result["allreduce"][-1]
            print(f"bench-ddp: all-reduce of {numel:,} gradients on {n}: fp32 {a['fp32']['ms_median']:.2f} ms "
                  f"({a['fp32']['bus_gb_per_s']:.0f} GB/s bus), bf16 {a['bf16']['ms_median']:.2f} ms", flush=True)
            write_json(out, result, indent=2)
    # A point two modes share (one process at the same batch: per-GPU's and global's first) runs once.
    ran = {}
    for mode, ns, per_gpu, runner, extra, mode_batch in plan:
        result["points"].setdefault(mode, [])
        for n in ns:
            per_rank = mode_batch if per_gpu else mode_batch // n
            key = (runner, n, per_rank, tuple(extra))
            if key in ran:
                point = {**copy.deepcopy(ran[key][1]), "same_run_as": ran[key][0]}
            else:
                stopping.doing(f"the point {mode}, {n} process(es)")
                with tempfile.TemporaryDirectory() as tmp:
                    point = runner(args, extra, beton, n, per_rank, Path(tmp))
                ran[key] = (mode, point)
            result["points"][mode].append(point)
            msg = point.get("error", "").splitlines()[-1:] or [f"{point['img_per_s']:,.0f} img/s, data wait "
                                                                 f"{point['data_wait_share']:.2%}"]
            shared = f" (the {point['same_run_as']} point's run)" if "same_run_as" in point else ""
            print(f"bench-ddp: {mode}, {n} process(es), batch {per_rank} per rank{shared}: {msg[0]}", flush=True)
            add_metrics(result)
            write_json(out, result, indent=2)
            stopping.keep("report", f"{out} ({sum(map(len, result['points'].values()))} points)")
    if args.loss_check:
        stopping.doing("the loss check's control run")
        control = loss_control(args, overrides, beton, batch, cfg, max(counts))
        result["loss_check"] = lc = loss_check(result["points"]["global"], control)
        write_json(out, result, indent=2)
        for c in lc.get("checks", []):
            print(f"bench-ddp: loss curve on {c['nproc']} vs 1: largest deviation {c['max_abs_smoothed']:.2%} at "
                  f"step {c['at_step']}, tolerance {lc['tol']:.2%}: {'within' if c['ok'] else 'OUTSIDE'}", flush=True)
    stopping.done()  # all measured: the report is written whatever comes
    render(result, out)
    print(f"bench-ddp: wrote {out}, {out.with_suffix('.md').name}, {out.with_suffix('.png').name}")
    failed = any("error" in p for pts in result["points"].values() for p in pts)
    lc = result.get("loss_check", {})
    return 1 if failed or "error" in lc or not all(c["ok"] for c in lc.get("checks", [])) else 0


if __name__ == "__main__":
    sys.exit(main())
