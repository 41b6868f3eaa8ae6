"""`make profile`: where a training step's time goes (torch.profiler), and what it costs in power (NVML).

    python -m benchmarks.speed.profile --preset ddpm-cifar10 --data data  # bf16 + compile (defaults)
    python -m benchmarks.speed.profile --preset ddpm-cifar10 --data data train.compile=False --out /tmp/eager
    python -m benchmarks.speed.profile --preset tiny --data data data.batch_size=16 --iters 2  # CPU: CPU activities
    torchrun --standalone --nproc_per_node 4 -m benchmarks.speed.profile --data data --out /tmp/ddp4   # rank 0 of DDP
    python -m benchmarks.speed.profile --from-trace benchmarks/results/h200/profile-ddpm-cifar10/trace.json.gz  # no GPU

One process: build the trainer and loader (as benchmarks.speed.bench does), run `--warmup` steps (the first compiles;
none of it is profiled), then torch.profiler over `--iters` steady-state iterations (schedule: 1 wait, 1 warm-up,
`--iters` active; CPU + CUDA activities, no shapes or stacks). Then the telemetry run: `--telemetry-rounds` rounds
of `--telemetry-iters` iterations without and with GpuTelemetry sampling, alternating which goes first, each timed
with CUDA events (timing.timed_steps): the ratio of the two is the sampler's overhead, the sampled blocks give J/img.

Writes to benchmarks/results/<card>/profile-<preset>/ (or --out):
- trace.json.gz      Chrome/Perfetto trace of the active steps (open in ui.perfetto.dev or chrome://tracing)
- top_ops.md/.json/.png   the 10 most expensive ops (self CUDA time, CPU time, calls, % of step) and, on CUDA,
                          the 10 most expensive GPU kernels with the op that launched them, and which ops
                          asked for the copies (aten::copy_ under convolution_backward, autocast casts, ...)
- op_classes.md/.png      GPU time (CPU time without CUDA) by op class: convolution fwd/bwd, attention, matmul,
                          normalization, elementwise, optimizer, data/copies, other
- telemetry.jsonl/.png    the NVML samples of the telemetry run (CUDA only)
- profile.md              all of the above on one page;  summary.json  every figure + environment + config

The analysis of the trace (op classes, tables, charts; also --from-trace) is benchmarks.speed.profile_analysis; this
module runs the GPU.
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

from benchmarks.common import (DATA_HELP, DEFAULT_DATA, BenchError, check_data, commit_text, ensure_dataset,
                               results_out, write_json, write_text)
from benchmarks.speed.profile_analysis import (DATA_MARK, TraceError, analyse, class_lines, plot_classes, plot_top,
                                               reanalyse, top_ops_lines)
from ffcv_ddpm.checks import Parser, above, at_least, fail, option

TRACE_LIMIT_MB = 15  # above this a trace is awkward to commit and slow to open: fewer --iters


def profile_steps(trainer, data, lr: float, steps: int, device):
    """torch.profiler over `steps` iterations after one skipped and one profiler-warm-up iteration."""
    from ffcv_ddpm.timing import sync
    from torch.profiler import ProfilerActivity, profile, record_function, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    wait, warm = 1, 1
    with warnings.catch_warnings():  # the profiler warns about its own event buffering; nothing to act on
        warnings.simplefilter("ignore")
        with profile(activities=activities, schedule=schedule(wait=wait, warmup=warm, active=steps, repeat=1),
                     record_shapes=False, with_stack=False, profile_memory=False) as prof:
            for i in range(wait + warm + steps):
                with record_function(DATA_MARK):
                    images, labels = next(data)
                trainer.step(images, labels, lr)
                if i in (wait + warm - 1, wait + warm + steps - 1):
                    # The active window starts with an empty GPU queue and ends with its last kernel recorded.
                    sync(device)
                prof.step()
    return prof


def timed_block(trainer, data, lr: float, steps: int, device) -> list[float]:
    """Per-iteration ms of `steps` training iterations (timing.timed_steps: CUDA events, data wait inside, one sync)."""
    import torch

    from ffcv_ddpm.timing import timed_steps

    timed = timed_steps(lambda batch, _i: trainer.step(*batch, lr), lambda: next(data), steps, device)
    if not torch.isfinite(timed.loss_sum):
        raise BenchError("non-finite training loss during the telemetry run")
    return timed.iter_ms


def telemetry_run(trainer, data, lr: float, device, batch: int, steps: int, rounds: int, path: Path,
                  interval_s: float, source_factory=None) -> dict:
    """Blocks of `steps` iterations without and with GpuTelemetry, alternated (ABBA...) so drift cancels.

    Without a readable GPU only the unsampled blocks run (they still give the unprofiled step time)."""
    import numpy as np

    from ffcv_ddpm.telemetry import GpuTelemetry

    def make():
        src = source_factory() if source_factory else None
        return GpuTelemetry(path, interval_s=interval_s, device_index=device.index or 0, source=src)

    probe = make()
    if not probe.enabled:
        probe.start()  # prints the one-line notice
    off, on, summaries = [], [], []
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        for sampled in order:
            if sampled and not probe.enabled:
                continue
            tel = make() if sampled else None
            if tel is not None:
                tel.start()
            ms = timed_block(trainer, data, lr, steps, device)  # ends with a sync: the block's work is done
            if tel is not None:
                tel.stop()
                summaries.append(tel.summary(images=steps * batch))
                on.append(ms)
            else:
                off.append(ms)
    if probe.enabled:
        probe.source.close()  # only asked whether NVML works
    off_ms, on_ms = np.concatenate(off), np.concatenate(on) if on else None
    out = {"enabled": probe.enabled, "reason": probe.reason, "steps_per_block": steps, "rounds": rounds,
           "batch_size": batch, "interval_s": interval_s,
           "ms_per_step_off": float(off_ms.mean()), "ms_median_off": float(np.median(off_ms))}
    if on:
        def agg(key, fn):
            vals = [s[key] for s in summaries if s.get(key) is not None]
            return fn(vals) if vals else None

        energy = [s["energy_j"] for s in summaries]
        images = steps * batch * len(summaries)
        out.update({
            "ms_per_step_on": float(on_ms.mean()), "ms_median_on": float(np.median(on_ms)),
            # Sampled time over unsampled time, both summed over all their blocks: 1.0 = no measurable cost.
            "overhead_ratio": float(on_ms.sum() / off_ms.sum()),
            "overhead_ratio_per_round": [float(np.sum(b) / np.sum(a)) for a, b in zip(off, on)],
            "images": images,
            "energy_j": sum(energy) if None not in energy else None,
            "j_per_img": sum(energy) / images if None not in energy else None,
            "energy_source": summaries[0]["energy_source"],
            "mean_power_w": agg("mean_power_w", np.mean),
            "max_power_w": agg("max_power_w", max),
            "mean_gpu_util_pct": agg("mean_gpu_util_pct", np.mean),
            "max_mem_used_gib": agg("max_mem_used_gib", max),
            "device": summaries[0].get("device"), "power_kind": summaries[0].get("power_kind"),
            "blocks": summaries,
        })
    return out


def _f(x, spec: str, unit: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{unit}"


def telemetry_lines(t: dict) -> list[str]:
    lines = ["### Telemetry (NVML) and its overhead", ""]
    if not t["enabled"]:
        return lines + [f"{t['reason']}. Unprofiled step: {t['ms_per_step_off']:.2f} ms (mean of "
                        f"{t['rounds']} x {t['steps_per_block']} steps)."]
    per_round = ", ".join(f"{r:.4f}" for r in t["overhead_ratio_per_round"])
    energy = (f"{t['j_per_img']:.4f} J/img ({t['energy_j']:.0f} J over {t['images']:,} images, "
              f"{t['energy_source'].replace('_', ' ')})" if t["j_per_img"] is not None else "energy n/a")
    return lines + [
        f"- {t['device']}, {t['rounds']} rounds x 2 blocks x {t['steps_per_block']} steps at batch {t['batch_size']}, "
        f"sampling every {t['interval_s']} s; power = {t['power_kind']}",
        f"- Step time without sampling {t['ms_per_step_off']:.3f} ms, with {t['ms_per_step_on']:.3f} ms: overhead "
        f"ratio **{t['overhead_ratio']:.4f}** (per round: {per_round})",
        f"- **{energy}**; mean power **{_f(t['mean_power_w'], '.0f', ' W')}** (max {_f(t['max_power_w'], '.0f', ' W')})"
        f", GPU busy {_f(t['mean_gpu_util_pct'], '.0f', '%')} of the time (NVML utilization.gpu), up to "
        f"{_f(t['max_mem_used_gib'], '.1f', ' GiB')} used on the device",
    ]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = Parser(prog="python -m benchmarks.speed.profile", doc=__doc__, overrides=True)
    p.add_argument("--preset", default="ddpm-cifar10", help="model preset (ffcv_ddpm.unet.PRESETS)")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help=DATA_HELP)
    p.add_argument("--iters", type=option(int, at_least(1)),
                   help="profiled (active) iterations (default: 10 on CUDA, 2 on CPU)")
    p.add_argument("--warmup", type=option(int, at_least(0)),
                   help="iterations before profiling, the first compiles (default: 20 / 3)")
    p.add_argument("--telemetry-iters", type=option(int, at_least(1)),
                   help="iterations per telemetry block (default: 100 / 2)")
    p.add_argument("--telemetry-rounds", type=option(int, at_least(1)),
                   help="rounds of (unsampled, sampled) blocks (default: 3 / 1)")
    p.add_argument("--interval", type=option(float, above(0)), default=0.1, help="seconds between NVML samples")
    p.add_argument("--top", type=option(int, at_least(1)), default=10, help="rows in the top-ops tables")
    p.add_argument("--num-synthetic", type=int, help="images in a synthetic dataset built when none exists "
                                                     "(default: 50000 on CUDA, 1024 on CPU)")
    p.add_argument("--out", type=Path, help="output folder (default: benchmarks/results/<card>/profile-<preset>)")
    p.add_argument("--from-trace", type=Path, metavar="TRACE",
                   help="run nothing: analyse a saved trace.json.gz again and write reanalysis.md/.json beside it "
                        "(or under --out)")
    args, overrides = p.parse_with_overrides(argv)
    trace_dir = args.from_trace and args.from_trace.parent  # where a re-analysis goes without --out
    p.check_paths(outputs=[("--out" if args.out else "the trace's folder", args.out or trace_dir)])
    return args, overrides  # --data, --from-trace: checked before anything runs (ensure_dataset, reanalyse)


def main(argv: list[str] | None = None, source_factory=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        args, overrides = parse_args(argv)
        if args.from_trace:
            reanalyse(args.from_trace, args.out or args.from_trace.parent, args.top)
        else:
            run(args, overrides, argv=argv, source_factory=source_factory)
    except (BenchError, TraceError, ValueError, FileNotFoundError) as e:
        return fail("profile", str(e))
    except KeyboardInterrupt:
        print("profile: interrupted", file=sys.stderr)
        return 130
    finally:
        import torch.distributed as dist

        # Under torchrun on GPUs: close NCCL's communicators (it warns of leaks otherwise). gloo's group is left to
        # the process's exit, as the trainer leaves it (ffcv_ddpm/train.py, the end of the file).
        if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
            dist.destroy_process_group()
    return 0


def run(args: argparse.Namespace, overrides: list[str], argv: list[str], source_factory=None) -> dict:
    import torch

    from ffcv_ddpm.config import load_config
    from ffcv_ddpm.data import dataset_info, endless, make_loader
    from ffcv_ddpm.env import environment
    from ffcv_ddpm.telemetry import plot_telemetry
    from ffcv_ddpm.step import TrainingError, build, resolve_device
    from ffcv_ddpm.timing import untimed_steps
    from ffcv_ddpm.train import init_distributed

    cfg = load_config(args.preset, overrides)  # ValueError names a bad preset or override
    check_data(args.data)  # before the device: a typo is refused before CUDA starts (or fails, in a forked process)
    # Under torchrun every rank runs the same steps (DDP's all-reduces need them all); rank 0 profiles and writes.
    try:
        ddp = init_distributed(cfg.train.device)
        device = resolve_device(cfg.train.device, ddp)
    except TrainingError as e:
        raise BenchError(str(e)) from None
    cuda = device.type == "cuda"
    steps = args.iters if args.iters is not None else (10 if cuda else 2)
    warmup = args.warmup if args.warmup is not None else (20 if cuda else 3)
    tsteps = args.telemetry_iters if args.telemetry_iters is not None else (100 if cuda else 2)
    rounds = args.telemetry_rounds if args.telemetry_rounds is not None else (3 if cuda else 1)
    device_name = torch.cuda.get_device_name(device) if cuda else None
    out = results_out(args.out, device_name, f"profile-{args.preset}")
    if not ddp.main:  # rank 0 builds a missing dataset; the others read it once it is complete
        torch.distributed.barrier()
    beton, built = ensure_dataset(args.data, args.num_synthetic or (50_000 if cuda else 1024))
    if ddp.main and ddp.world_size > 1:
        torch.distributed.barrier()
    dataset = dataset_info(beton)
    cfg.data.path = str(beton)
    if not ddp.main:
        out = Path(tempfile.mkdtemp(prefix=f"profile-rank{ddp.rank}-"))  # its telemetry samples are not kept
    out.mkdir(parents=True, exist_ok=True)
    where = f"CUDA ({device_name})" if cuda else "CPU only (CPU activities; no GPU telemetry)"
    log = print if ddp.main else (lambda *a, **k: None)
    log(f"profile: {args.preset} on {where}, batch {cfg.data.batch_size}"
        + (f" per rank x {ddp.world_size} ranks (train.ddp_reduce={cfg.train.ddp_reduce})" if ddp.world_size > 1
           else "") + f", {cfg.train.precision}, "
          f"compile={cfg.train.compile and cuda}, attention {cfg.model.attn_impl}, loader {cfg.data.loader}; "
          f"data {beton} ({dataset['num_images']} images"
          + (", SYNTHETIC)" if dataset["synthetic"] else ")"), flush=True)

    loader = make_loader(cfg.data, device, rank=ddp.rank, world_size=ddp.world_size)
    trainer = build(cfg, device, ddp)
    data = endless(loader)
    lr = cfg.train.lr
    # At least one: the compiling step must never be profiled.
    warmup_s = untimed_steps(lambda batch, _i: trainer.step(*batch, lr), lambda: next(data), max(1, warmup), device)
    log(f"profile: {max(1, warmup)} warm-up steps in {warmup_s:.1f} s; profiling {steps} steps", flush=True)

    # Under CUDA graphs the step's tensors live in the pool allocated while recording (in the warm-up): the peak of
    # the profiled steps alone is a fraction of the step's memory (benchmarks.speed.report.graphs_peak).
    peak_incl_warmup = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    prof = profile_steps(trainer, data, lr, steps, device)  # every rank steps (DDP); rank 0's profile is the one kept
    if ddp.main:
        a = analyse(prof.events(), top=args.top)
        peak_mem = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
        peak_incl_warmup = max(peak_incl_warmup, peak_mem) if cuda else None
        trace = out / "trace.json.gz"
        _export_trace(prof, trace)
    del prof

    if ddp.world_size > 1:  # rank 0 spent seconds on the analysis: start the timed blocks together
        torch.distributed.barrier()
    tjsonl = out / "telemetry.jsonl"
    tjsonl.unlink(missing_ok=True)  # GpuTelemetry appends: start this run's file afresh
    log(f"profile: telemetry run: {rounds} x (unsampled, sampled) blocks of {tsteps} steps", flush=True)
    tel = telemetry_run(trainer, data, lr, device, cfg.data.batch_size, tsteps, rounds, tjsonl, args.interval,
                        source_factory)

    if not ddp.main:
        shutil.rmtree(out, ignore_errors=True)
        return {}

    # ---- write ---------------------------------------------------------------------------------------------------
    env = {**environment(), "world_size": ddp.world_size}
    ranks = (f" per rank x {ddp.world_size} ranks (train.ddp_reduce={cfg.train.ddp_reduce}, rank 0 shown)"
             if ddp.world_size > 1 else "")
    title = (f"{args.preset}, batch {cfg.data.batch_size}{ranks}, {cfg.train.precision}, "
             f"compile={cfg.train.compile and cuda}"
             f" - {device_name or 'CPU'} - torch {env['torch']} - {commit_text(env)}")
    files = {"trace": trace.name, "top_ops": "top_ops.md", "op_classes": "op_classes.md", "summary": "summary.json"}
    if tjsonl.is_file():
        plot_telemetry(tjsonl, out / "telemetry.png", title=title)
        files.update(telemetry="telemetry.jsonl", telemetry_plot="telemetry.png")
    summary = {
        "schema": 1,
        "command": ["python", "-m", "benchmarks.speed.profile", *argv],
        "environment": env,
        "device_name": device_name,
        "config": cfg.to_dict(),
        "dataset": dataset,
        "dataset_built_now": built,
        "settings": {"steps": steps, "warmup": warmup, "telemetry_steps": tsteps, "telemetry_rounds": rounds,
                     "interval_s": args.interval, "profiler_schedule": {"wait": 1, "warmup": 1, "active": steps}},
        "warmup_s": warmup_s,
        "peak_mem_gib_profiled": peak_mem,
        "peak_mem_gib_incl_warmup": peak_incl_warmup,
        "profile": a,
        "telemetry": tel,
        "files": files,
    }
    write_json(out / "summary.json", summary)
    write_json(out / "top_ops.json", {"top_ops": a["top_ops"], "top_kernels": a["top_kernels"]})
    head = _header(summary)
    write_text(out / "top_ops.md", "\n".join([f"# Top ops: {title}", "", *head, "", *top_ops_lines(a), ""]))
    write_text(out / "op_classes.md", "\n".join([f"# Op classes: {title}", "", *head, "", *class_lines(a), ""]))
    plot_top(a, out / "top_ops.png", title)
    plot_classes(a, out / "op_classes.png", title)
    pics = ["![top ops](top_ops.png)", "", "![op classes](op_classes.png)"]
    if "telemetry_plot" in files:
        pics += ["", "![telemetry](telemetry.png)"]
    write_text(out / "profile.md", "\n".join([
        f"# Profile: {title}", "", *head, "", *top_ops_lines(a), "", *class_lines(a), "", *telemetry_lines(tel), "",
        *pics, ""]))

    best = sorted(a["classes"], key=lambda c: -c["ms_per_step"])[:3]
    print("profile: " + ", ".join(f"{c['class']} {c['pct_of_total']:.0f}%" for c in best) + f" of {a['basis']}")
    if tel["enabled"]:
        print(f"profile: telemetry overhead ratio {tel['overhead_ratio']:.4f}; "
              + (f"{tel['j_per_img']:.4f} J/img, " if tel["j_per_img"] is not None else "")
              + f"mean power {_f(tel['mean_power_w'], '.0f', ' W')}")
    print(f"profile: wrote {out}/ (profile.md, trace.json.gz, top_ops.*, op_classes.*, summary.json"
          + (", telemetry.*)" if tjsonl.is_file() else ")"))
    return summary


def _export_trace(prof, path: Path) -> None:
    """Chrome trace, gzipped (Perfetto and chrome://tracing open .json.gz); warns when too big to commit."""
    raw = path.with_suffix("")  # trace.json
    prof.export_chrome_trace(str(raw))
    with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst)
    raw.unlink()
    mb = path.stat().st_size / 2**20
    if mb > TRACE_LIMIT_MB:
        print(f"profile: WARNING: {path} is {mb:.1f} MB (> {TRACE_LIMIT_MB} MB): rerun with fewer --iters "
              "before committing it", flush=True)


def _peak_text(s: dict) -> str:
    """The step's peak memory, read as the bench rows read theirs (benchmarks.speed.report.graphs_peak)."""
    from benchmarks.speed.report import graphs_peak

    peak, graphs = graphs_peak(s["config"]["train"].get("compile_mode"), bool(s["device_name"]),
                               s["peak_mem_gib_profiled"], s.get("peak_mem_gib_incl_warmup"))
    if graphs:
        return (f"; peak memory {peak:.1f} GiB including the warm-up (CUDA graphs: the profiled steps alone "
                f"{s['peak_mem_gib_profiled']:.1f} GiB, their pool allocated when recorded)")
    return f"; peak memory {peak:.1f} GiB" if peak else ""


def _header(s: dict) -> list[str]:
    env, a, cfg = s["environment"], s["profile"], s["config"]
    ds = s["dataset"]
    step = (f"GPU step span {a['gpu']['span_ms_per_step']:.2f} ms, kernels busy {a['gpu']['busy_ms_per_step']:.2f} "
            f"ms ({100 * (1 - a['gpu']['idle_share']):.0f}%); CPU {a['cpu_step_ms']:.2f} ms per step"
            if a["gpu"] else f"CPU step {a['cpu_step_ms']:.2f} ms")
    unprof = s["telemetry"]["ms_per_step_off"]
    return [
        f"- Device: {s['device_name'] or 'CPU only'}; torch {env.get('torch')}, CUDA {env.get('cuda')}, "
        f"cuDNN {env.get('cudnn')}, Python {env.get('python')}; commit {commit_text(env)}, {env.get('date_utc')}",
        f"- Command: `{' '.join(s['command'])}`",
        f"- Config: preset {cfg['preset']}, batch {cfg['data']['batch_size']}, {cfg['train']['precision']}, "
        f"compile={cfg['train']['compile'] and bool(s['device_name'])}, attention {cfg['model']['attn_impl']}, "
        f"channels_last={cfg['train']['channels_last']}, fused AdamW={cfg['train']['fused_adam']}, loader "
        f"{cfg['data']['loader']}"
        + (f" ({cfg['data']['num_workers']} workers)" if cfg["data"]["loader"] != "gpu" else "")
        + f", flip {cfg['data']['flip']}",
        f"- Data: {ds.get('path')} ({ds.get('num_images')} images"
        + (", SYNTHETIC: speed only)" if ds.get("synthetic") else ")"),
        f"- Profiled: {a['steps']} steps after {s['settings']['warmup']} warm-up steps + 2 profiler warm-up steps; "
        f"{step} under the profiler; unprofiled step {unprof:.2f} ms"
        + (" (CUDA events)" if s["device_name"] else " (perf_counter)")
        + _peak_text(s),
        f"- Trace: [{s['files']['trace']}]({s['files']['trace']}) (ui.perfetto.dev or chrome://tracing)",
    ]


if __name__ == "__main__":
    sys.exit(main())
