"""`make numerics`: does mixed precision change training? bf16's loss curve against an fp32 reference.

    python -m benchmarks.speed.numerics --data data                   # ddpm-cifar10, batch 128, 2000 steps, bf16 vs fp32
    python -m benchmarks.speed.numerics --data data --precision fp16   # fp16 + GradScaler instead
    python -m benchmarks.speed.numerics --data data model.norm_impl=scale-shift model.fused_parts=False \
        model.norm_residual=False model.norm_fast_silu=False model.norm_pair_hash=False model.norm_x_sums=False \
        --control model.norm_impl=torch --parallel   # (the preset's fused-kernel switches off for both)
    python -m benchmarks.speed.numerics --data data data.batch_size=32 model.norm_impl=fused --control \
        train.cudnn_benchmark=False --parallel --gpus 2,3 --time-limit 480 --out OUT   # fused: its own control
    python -m benchmarks.speed.numerics --data data --preset tiny --steps 40 --log-every 5 data.batch_size=16 train.device=cpu

Runs of the trainer (ffcv_ddpm.train, everything else as configured) on the same data with the same seed, called
legs: the reference in true fp32 (TF32 off) and the candidate precision. The same seed gives both the same batches,
timesteps, noise and dropout masks step for step, so the curves are paired: the per-interval ratio of their mean
losses is numerics (and the slow drift of two models that no longer share weights), not sampling noise. The check:
after the first --skip share of the steps, the moving average over --smooth intervals of (candidate / reference - 1)
stays within +-tol, or, with a control leg, within --noise-factor times the control's deviation when that is the
larger bound (two identical fp32 runs drift apart on a GPU: NOTES item 16). Exit status 1 when it does not.

--control KEY=VALUE ... adds a third leg: fp32 again, differing from the reference only by those overrides (an
equally valid kernel choice, e.g. model.norm_impl=torch). The same check between control and reference is the noise
floor that the candidate's deviation is read against. --ref KEY=VALUE ... applies to the reference and control legs
only (e.g. train.compile=False); plain KEY=VALUE overrides apply to every leg. Legs whose random streams would differ
(seeds, batches; with dropout on, a compiled graph or the fused GroupNorm in one leg but not another) are refused:
they would not be paired.
--parallel runs the legs as concurrent `python -m ffcv_ddpm.train` processes (on a GPU, one leg's compilation
overlaps another's compute); without it they run one after another in this process. With several GPUs visible the
parallel legs are spread over them (leg i on the i-th of --gpus, round robin; each leg sees only its GPU), so two
commands with --gpus 0,1 and --gpus 2,3 run two studies (scale-shift and fused) at once on four GPUs. On one GPU
the legs share it: its time is sliced between the processes, so each leg runs at about the GPU's rate divided by
the legs that are still running (benchmarks/NOTES.md, item 12). --time-limit SECONDS stops the legs (SIGTERM: each
trainer checkpoints and exits) when the time is up and compares them on the intervals all of them logged.

Writes numerics-<precision>.json (the curves from the runs' stats.jsonl, the checks, environment, config), .md and
.png under benchmarks/results/<card>/ (or --out).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import (DATA_HELP, DEFAULT_DATA, REPO, BenchError, check_data, commit_text, ensure_dataset,
                               md_table, pyplot, results_out, save_figure, write_json, write_text)
from ffcv_ddpm import stopping
from ffcv_ddpm.checks import Parser, above, at_least, in_range, int_list, option
from ffcv_ddpm.config import RunConfig, load_config
from ffcv_ddpm.data import dataset_info
from ffcv_ddpm.env import compile_cache, environment
from ffcv_ddpm.step import TrainingError, resolve_device
from ffcv_ddpm.train import read_stats, train

LOG_TAIL_LINES = 40  # of a failed leg's log, printed before the error line
PROGRESS_EVERY_S = 60  # a line with every parallel leg's step, so that a long run shows how far it is


class LegFailed(Exception):
    """One leg's training run failed; the message names the leg."""


@dataclass
class Leg:
    name: str              # reference | candidate | control: its run folder and log file under the temp dir
    precision: str         # train.precision of this leg
    overrides: list[str]   # beyond the common ones: --ref for the reference, --ref then --control for the control
    cfg: RunConfig | None = None  # the whole config, built from the common + own overrides (Leg.build)
    gpu: str | None = None  # --parallel on several GPUs: the CUDA_VISIBLE_DEVICES entry this leg's process sees

    def trainer_overrides(self, common: list[str], tmp: Path) -> list[str]:
        """Everything that makes this leg's config from the preset: the same list in-process and in a subprocess."""
        return [*common, *self.overrides, f"train.precision={self.precision}",
                f"train.out_dir={tmp / self.name}", f"train.desc={self.name}"]

    def build(self, preset: str, common: list[str], beton: Path, tmp: Path) -> None:
        self.cfg = load_config(preset, self.trainer_overrides(common, tmp))
        self.cfg.data.path = str(beton)

    def describe(self, reference: "Leg | None" = None) -> str:
        """Its precision and overrides; a leg whose config equals the reference's (overrides that restate a default)
        says so, since a control that changes nothing measures run-to-run drift, not a kernel choice."""
        same = reference is not None and self is not reference and _arithmetic(self.cfg) == _arithmetic(reference.cfg)
        return f"{self.precision}" + (" (TF32 off)" if self.precision == "fp32" else "") + \
            (f" + `{' '.join(self.overrides)}`" if self.overrides else "") + \
            (" (the same configuration as the reference: an identical control)" if same else "")


def _arithmetic(cfg: RunConfig | None) -> dict | None:
    """A leg's config without what only names its run (folder, description)."""
    if cfg is None:
        return None
    d = cfg.to_dict()
    d["train"] = {k: v for k, v in d["train"].items() if k not in ("out_dir", "desc")}
    return d


# Fields whose difference gives two legs different batches, timesteps or noise: such legs are not paired.
PAIRED_FIELDS = ("train.seed", "train.noise_seed", "train.steps", "train.log_every", "data.seed", "data.batch_size", "data.loader",
                 "data.order", "data.flip", "data.drop_last")
COMPILED_DROPOUT = "dropout in a compiled graph (train.compile on a GPU)"
FUSED_DROPOUT = "dropout seeds drawn by model.norm_impl=fused"
HOW_TO_PAIR = {COMPILED_DROPOUT: "compile every leg or none (e.g. no train.compile=False in --ref)",
               FUSED_DROPOUT: "use model.norm_impl=fused in every leg or in none"}


def random_stream(cfg: RunConfig) -> dict:
    """What decides the random numbers a leg draws, beyond its seed. With dropout on, a compiled graph draws its masks
    from seeds of its own (inductor) and the fused GroupNorm draws a seed per call: either changes the masks and,
    through the generator's state, every later timestep and noise draw."""
    import torch

    on_gpu = cfg.train.device.startswith("cuda") or (cfg.train.device == "auto" and torch.cuda.is_available())
    dropout = cfg.model.dropout > 0
    stream = {f: getattr(getattr(cfg, f.split(".")[0]), f.split(".")[1]) for f in PAIRED_FIELDS}
    stream[COMPILED_DROPOUT] = dropout and cfg.train.compile and on_gpu
    stream[FUSED_DROPOUT] = dropout and cfg.model.norm_impl == "fused"
    return stream


def check_paired(legs: list[Leg]) -> None:
    ref = random_stream(legs[0].cfg)
    for leg in legs[1:]:
        for key, value in random_stream(leg.cfg).items():
            if value != ref[key]:
                fix = (f"{HOW_TO_PAIR[key]}, or set model.dropout=0 for every leg" if key in HOW_TO_PAIR
                       else f"give every leg the same {key}")
                raise ValueError(f"the {leg.name} leg is not paired with the reference: {key} is {value} there and "
                                 f"{ref[key]} in the reference, so their batches, noise or dropout masks differ step "
                                 f"for step; {fix}")


def run_sequential(legs: list[Leg]) -> None:
    """Each leg's training in this process, under the command's signal handling: a signal checkpoints the leg that
    is training (the trainer's rule) and then stops the command."""
    stop = stopping.current()
    for leg in legs:
        stopping.doing(f"the {leg.name} leg")
        try:
            train(leg.cfg, stop=stop)
        except (TrainingError, ValueError, FileNotFoundError) as e:
            raise LegFailed(f"the {leg.name} leg ({leg.describe()}) failed: {e}") from e
        finally:
            if stop is not None:
                stop.phase = "start-up"  # between the legs a signal stops the command at the next safe point
        stopping.check()


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (indices or UUIDs) a child can be given."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]  # counting creates no context on any GPU


def place_legs(legs: list[Leg], visible: list[str], chosen: list[int] | None) -> None:
    """Leg i on GPU chosen[i % len(chosen)] (indices into `visible`; default all of them). One GPU: the legs share it
    and no leg's view is narrowed (its train.device still applies)."""
    chosen = list(range(len(visible))) if chosen is None else chosen
    bad = [i for i in chosen if i >= len(visible)]
    if bad:
        raise ValueError(f"--gpus {','.join(map(str, chosen))}: this process sees {len(visible)} GPU(s) (indices "
                         f"0..{len(visible) - 1}); {', '.join(map(str, bad))} is not one of them")
    if len(visible) < 2 and len(chosen) < 2:
        return
    for i, leg in enumerate(legs):
        leg.gpu = visible[chosen[i % len(chosen)]]


def _last_step(leg_dir: Path) -> int:
    """The last logged step of a running leg (0 before its first stats line)."""
    for stats in leg_dir.glob("*/stats.jsonl"):
        lines = stats.read_text().splitlines()
        return json.loads(lines[-1])["step"] if lines else 0
    return 0


def run_parallel(legs: list[Leg], preset: str, common: list[str], beton: Path, tmp: Path,
                 time_limit: float | None = None) -> float | None:
    """Each leg a `python -m ffcv_ddpm.train` process (on its GPU, Leg.gpu), output to <tmp>/<leg>.log; the first
    failure stops the rest. After `time_limit` seconds every leg still running gets SIGTERM (its trainer writes a
    checkpoint and exits); returns the seconds at which that happened, or None when all finished."""
    procs = {}
    stopped_at = None
    try:
        for leg in legs:
            cmd = [sys.executable, "-m", "ffcv_ddpm.train", "--preset", preset, "--data", str(beton.resolve()),
                   *leg.trainer_overrides(common, tmp)]
            env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": leg.gpu} if leg.gpu is not None else {})}
            with open(tmp / f"{leg.name}.log", "w") as log:  # the child keeps its own handle
                procs[leg.name] = stopping.start(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
        where = "" if legs[0].gpu is None else " on GPUs " + ", ".join(f"{leg.name}: {leg.gpu}" for leg in legs)
        print(f"numerics: {', '.join(procs)} running in parallel{where} (logs in {tmp})", flush=True)
        stopping.doing(f"the legs ({', '.join(procs)})")
        t0, running, shown = time.perf_counter(), set(procs), 0.0
        while running:
            time.sleep(0.5)
            stopping.check()  # a signal: the legs are stopped on the way out (below, and by the command)
            now = time.perf_counter() - t0
            if time_limit is not None and stopped_at is None and now > time_limit:
                stopped_at = now
                print(f"numerics: --time-limit {time_limit:.0f} s reached; stopping {', '.join(sorted(running))} "
                      "(SIGTERM: each writes a checkpoint and exits)", flush=True)
                for name in running:
                    procs[name].send_signal(signal.SIGTERM)
            if now - shown >= PROGRESS_EVERY_S:
                shown = now
                print(f"numerics: {now:.0f} s: " + ", ".join(f"{leg.name} step {_last_step(tmp / leg.name)}"
                                                             for leg in legs), flush=True)
            for leg in [leg for leg in legs if leg.name in running]:
                rc = procs[leg.name].poll()
                if rc is None:
                    continue
                running.discard(leg.name)
                if rc != 0 and stopped_at is None:
                    lines = (tmp / f"{leg.name}.log").read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
                    print(f"---- the last {len(lines)} lines of the {leg.name} leg's log ----", *lines,
                          "----", sep="\n", file=sys.stderr)
                    raise LegFailed(f"the {leg.name} leg ({leg.describe()}) failed with exit status {rc}; "
                                    "the end of its log is above")
                how = "stopped" if stopped_at is not None else "finished"
                print(f"numerics: the {leg.name} leg {how} after {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        stopping.end(list(procs.values()))  # a failure or a signal: the other legs would only burn the device
    return stopped_at


def read_run(leg_dir: Path, cfg: RunConfig) -> dict:
    """A leg's stats.jsonl lines and the config it ran with, as its run folder has them. A leg stopped before its
    first stats line left no folder (the trainer removes it): no lines, and the config it was given."""
    runs = [p for p in leg_dir.iterdir() if p.is_dir()] if leg_dir.is_dir() else []  # one run per leg folder
    if not runs:
        return {"config": cfg.to_dict(), "stats": []}
    (run_dir,) = runs
    return {"config": json.loads((run_dir / "config.json").read_text()),
            "stats": read_stats(run_dir)}


def common_intervals(stats: dict[str, list[dict]], log_every: int) -> dict[str, list[dict]]:
    """Each leg's full log intervals (a leg stopped mid-interval logs a partial one last: dropped), cut to the number
    that every leg reached, so the curves are compared step for step."""
    full = {leg: [r for r in lines if r["step"] % log_every == 0] for leg, lines in stats.items()}
    n = min(len(lines) for lines in full.values())
    return {leg: lines[:n] for leg, lines in full.items()}


def leg_timing(stats: list[dict], gpu: str | None) -> dict:
    """How a leg's time went, from its stats lines (wall_s counts from the start of its training loop): seconds to
    its first line (the compiling first step and the rest of the first interval), to its last, the steps it reached,
    and its median step time after the first interval."""
    if not stats:
        return {"gpu": gpu, "steps": 0, "first_line_s": None, "last_line_s": None, "median_step_ms": None}
    later = [r["iter_ms_median"] for r in stats[1:]] or [stats[0]["iter_ms_median"]]
    return {"gpu": gpu, "steps": stats[-1]["step"], "first_line_s": stats[0]["wall_s"],
            "last_line_s": stats[-1]["wall_s"], "median_step_ms": float(np.median(later))}


def check(reference: list[dict], candidate: list[dict], tol: float, skip: float, smooth: int) -> dict:
    """Paired comparison of two loss curves logged at the same steps."""
    steps = [s["step"] for s in reference]
    if steps != [s["step"] for s in candidate]:
        raise ValueError("the two runs logged different steps; give both the same train.log_every and steps")
    ratio = np.array([c["loss"] / r["loss"] - 1 for r, c in zip(reference, candidate)])
    w = max(1, min(smooth, len(ratio)))
    smoothed = np.convolve(ratio, np.ones(w) / w, mode="valid")  # smoothed[i] averages intervals i .. i+w-1
    first = next((i for i, s in enumerate(steps) if s > skip * steps[-1]), len(steps) - 1)
    start = min(first, len(smoothed) - 1)  # the first moving average that starts at or after `first`
    checked = smoothed[start:]
    worst = int(np.argmax(np.abs(checked)))
    tail = max(1, len(ratio) // 10)
    return {
        "tol": tol, "skip": skip, "smooth_intervals": w, "checked_from_step": steps[first],
        "ratio_minus_1": ratio.tolist(), "smoothed": smoothed.tolist(),
        "max_abs_smoothed": float(np.abs(checked).max()),
        "at_step": steps[start + worst + w - 1],
        "mean_ratio_minus_1": float(ratio[first:].mean()) if first < len(ratio) else float(ratio[-1]),
        "last_10pct_loss": {"reference": float(np.mean([r["loss"] for r in reference[-tail:]])),
                            "candidate": float(np.mean([c["loss"] for c in candidate[-tail:]]))},
        "ok": bool(np.abs(checked).max() <= tol),
    }


def pct(x: float) -> str:
    return f"{100 * x:.3g}%"  # three significant digits: a noise floor can be far below 0.01%


def compare(curves: dict[str, list[dict]], args: argparse.Namespace) -> dict:
    """The candidate's and the control's checks against the reference, and the noise floor: the candidate's deviation
    against the control's (the same statistic), their ratio, and which is larger."""
    checks = {leg: check(curves["reference"], curves[leg], args.tol, args.skip, args.smooth)
              for leg in ("candidate", "control") if leg in curves}
    floor = None
    if "control" in checks:
        cand, ctl = checks["candidate"]["max_abs_smoothed"], checks["control"]["max_abs_smoothed"]
        floor = {"candidate": cand, "control": ctl, "ratio": cand / ctl if ctl > 0 else None, "exceeds": cand > ctl}
    return {"check": checks["candidate"], "control_check": checks.get("control"), "noise_floor": floor,
            "verdict": verdict(checks["candidate"], checks.get("control"), args.tol, args.noise_factor)}


def verdict(candidate: dict, control: dict | None, tol: float, factor: float) -> dict:
    """Pass or fail, against the larger of the fixed tolerance and `factor` x the control's deviation. Two fp32 runs of
    the same configuration (an identical control) drift 9.5% apart by step 2,000 on an H100 (NOTES item 16): a fixed
    5% bound there tests that drift, not the precision. So with a control leg the candidate may stray as far as
    `factor` times what fp32 strays from fp32 (1.5, as bench-ddp's loss check bounds DDP's curve by the spread of two
    one-GPU runs); 0 keeps the fixed tolerance alone."""
    floor = factor * control["max_abs_smoothed"] if control is not None and factor > 0 else 0.0
    bound, by = (floor, "noise floor") if floor > tol else (tol, "tolerance")
    return {"bound": bound, "by": by, "noise_factor": factor if control is not None else None,
            "ok": bool(candidate["max_abs_smoothed"] <= bound)}


def render(result: dict, out: Path) -> None:
    c, ref, cand, ctl = result["check"], result["reference"], result["candidate"], result["control"]
    env = result["environment"]
    verdict = "within" if c["ok"] else "OUTSIDE"
    lines = [f"# Numerics: {result['preset']}, {cand['precision']} vs {ref['precision']} "
             f"on {result['device']}", "",
             f"- commit {commit_text(env, 40)}, torch {env.get('torch')}, {env.get('date_utc')}; "
             f"command: `{result['command']}`",
             f"- data: {result['dataset']}; batch {result['batch_size']}, {result['steps']} steps, "
             f"loss logged every {result['log_every']} steps (mean over the interval), seed {result['seed']}",
             (f"- compared from finished run folders (--from-runs) on the {result['steps']} steps all of them "
              f"logged ({result['planned_steps']} planned): {', '.join(r['run_dir'] for r in (ref, cand, ctl) if r)}"
              if "run_dir" in ref else
              f"- overrides for every leg: `{' '.join(result['common_overrides']) or 'none'}`; legs run "
              f"{'in parallel processes' if result['parallel'] else 'one after another'}"
              + (f"; stopped by --time-limit after {result['stopped_at_s']:.0f} s: compared on the {result['steps']} "
                 f"steps every leg logged ({result['planned_steps']} planned)" if result.get("stopped_at_s") else "")),
             f"- reference: {ref['description']}; candidate: {cand['description']}"
             + (f"; control: {ctl['description']}" if ctl else ""), "",
             f"**{verdict} tolerance**: the moving average over {c['smooth_intervals']} intervals of "
             f"(candidate / reference - 1) reaches at most {c['max_abs_smoothed']:.2%} in magnitude (at step "
             f"{c['at_step']}) from step {c['checked_from_step']} on; tolerance +-{c['tol']:.1%}. Mean ratio - 1 "
             f"over those steps: {c['mean_ratio_minus_1']:+.2%}. Mean loss over the last 10% of intervals: "
             f"{c['last_10pct_loss']['reference']:.5f} ({ref['precision']}), "
             f"{c['last_10pct_loss']['candidate']:.5f} ({cand['precision']}).", ""]
    nf = result["noise_floor"]
    if nf:
        k = result["control_check"]
        ratio = (f"ratio {nf['ratio']:,.1f}x" if nf["ratio"] is not None else
                 "the floor is zero (the control's curve equals the reference's: its overrides changed no arithmetic)")
        lines += [f"**Noise floor**: the same statistic for the control against the reference reaches "
                  f"{pct(k['max_abs_smoothed'])} (at step {k['at_step']}; mean ratio - 1 "
                  f"{k['mean_ratio_minus_1']:+.2%}). Candidate deviation {pct(nf['candidate'])}, control deviation "
                  f"(noise floor) {pct(nf['control'])}, {ratio}: the candidate's deviation "
                  f"{'EXCEEDS' if nf['exceeds'] else 'does not exceed'} the noise floor. One control run: the floor "
                  "is one draw of the fp32-vs-fp32 deviation, not a bound.", ""]
        if nf["control"] > c["tol"]:
            lines += [f"**The control is outside the tolerance too** ({pct(nf['control'])} > {c['tol']:.1%}): two fp32 "
                      "runs that differ only by the control's overrides (or by nothing: run-to-run non-determinism) "
                      "stray that far apart, so the fixed tolerance cannot tell what the candidate's precision does "
                      "from how far any two runs drift (benchmarks/NOTES.md, item 16).", ""]
    v = result.get("verdict")  # files written before the verdict existed have none
    if v:
        bound = (f"{v['noise_factor']:g} x the control's {pct(nf['control'])}" if v["by"] == "noise floor" else
                 f"the tolerance {c['tol']:.1%}" + (f" (above {v['noise_factor']:g} x the control's "
                                                    f"{pct(nf['control'])})" if nf and v["noise_factor"] else ""))
        lines += [f"**Verdict: {'pass' if v['ok'] else 'FAIL'}**: the candidate's {pct(c['max_abs_smoothed'])} against "
                  f"a bound of {pct(v['bound'])}, {bound}.", ""]
    timing = result.get("leg_timing")
    if timing:
        lines += ["Where each leg's time went (its stats.jsonl; seconds counted from the start of its training loop, "
                  "so the first line includes the compiling first step):", ""]
        lines += md_table(["leg", "GPU", "steps reached", "first log line s", "last log line s",
                           "median step ms (after the first interval)"],
                          [[leg, t["gpu"] or "-", str(t["steps"]),
                            *(f"{t[k]:.0f}" if t[k] is not None else "-" for k in ("first_line_s", "last_line_s")),
                            f"{t['median_step_ms']:.1f}" if t["median_step_ms"] is not None else "-"]
                           for leg, t in timing.items()]) + [""]
    write_text(out.with_suffix(".md"), "\n".join(lines))

    plt = pyplot()
    steps = [s["step"] for s in ref["stats"]]
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    colors = {"reference": "C0", "candidate": "C1", "control": "C2"}  # one color per leg in both panels
    for name, leg in [("reference", ref), ("candidate", cand)] + ([("control", ctl)] if ctl else []):
        ax.plot(steps, [s["loss"] for s in leg["stats"]], label=f"{name}: {leg['description'].replace('`', '')}",
                lw=1, color=colors[name])
    ax.set_yscale("log")
    ax.set_ylabel("training loss (interval mean)")
    ax.legend(fontsize=8)
    ax.set_title(f"{result['preset']}: {cand['precision']} vs {ref['precision']}, batch {result['batch_size']}")
    bx.plot(steps, 100 * np.array(c["ratio_minus_1"]), lw=0.6, color="0.6", label="candidate, per interval")
    w = c["smooth_intervals"]
    bx.plot(steps[w - 1:], 100 * np.array(c["smoothed"]), lw=1.2, color=colors["candidate"],
            label=f"candidate, moving average ({w})")
    if ctl:
        bx.plot(steps[w - 1:], 100 * np.array(result["control_check"]["smoothed"]), lw=1.2, color=colors["control"],
                label=f"control (noise floor), moving average ({w})")
    for sign in (1, -1):
        bx.axhline(sign * 100 * c["tol"], color="r", ls=":", lw=1)
    bx.axvline(c["checked_from_step"], color="k", ls=":", lw=0.8)
    bx.set_ylabel("leg / reference - 1 (%)")
    bx.set_xlabel("step")
    bx.legend(fontsize=8)
    fig.tight_layout()
    save_figure(fig, out.with_suffix(".png"), 120)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    compile_cache()  # the legs (in this process or started by it) keep their compiled graphs for the next run
    p = Parser(prog="python -m benchmarks.speed.numerics", doc=__doc__, overrides=True,
               epilog="The overrides (anywhere but right after --ref or --control) go to every leg; data.batch_size "
                      "is the preset's (128) unless given.")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help=DATA_HELP)
    p.add_argument("--preset", default="ddpm-cifar10")
    p.add_argument("--precision", choices=("bf16", "fp16"), default="bf16", help="the candidate precision")
    p.add_argument("--steps", type=option(int, at_least(1)), default=2000, help="training steps per leg (train.steps)")
    p.add_argument("--log-every", type=option(int, at_least(1)), default=20,
                   help="steps per logged loss (its mean over the interval)")
    p.add_argument("--tol", type=option(float, at_least(0)), default=0.05,
                   help="allowed |smoothed candidate / reference - 1|")
    p.add_argument("--noise-factor", type=option(float, at_least(0)), default=1.5,
                   help="with --control: the candidate passes within this many times the control's deviation when "
                        "that is above --tol (0: --tol alone)")
    p.add_argument("--skip", type=option(float, in_range(0, 1, high_open=True)), default=0.05,
                   help="share of the steps before the check starts")
    p.add_argument("--smooth", type=option(int, at_least(1)), default=5, help="intervals in the moving average")
    p.add_argument("--control", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="add a control leg: fp32 with the --ref overrides plus these (e.g. model.norm_impl=torch)")
    p.add_argument("--ref", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                   help="overrides for the reference and control legs only (e.g. train.compile=False)")
    p.add_argument("--parallel", action="store_true", help="run the legs as concurrent trainer processes")
    p.add_argument("--gpus", type=int_list(at_least(0)),
                   help="with --parallel: indices of the visible GPUs to spread the legs over, round robin "
                        "(default: all visible; one GPU: the legs share it)")
    p.add_argument("--time-limit", type=option(float, above(0)),
                   help="with --parallel: stop every leg after this many seconds and compare the intervals all of "
                        "them logged")
    p.add_argument("--from-runs", nargs="+", type=Path, metavar="RUN_DIR",
                   help="compare finished runs instead of training: REFERENCE CANDIDATE [CONTROL] run folders "
                        "(config.json + stats.jsonl), on their common logged steps")
    p.add_argument("--out", type=Path, help="results folder (default benchmarks/results/<card>)")
    args, args.overrides = p.parse_with_overrides(argv)
    p.check_paths(outputs=[("--out", args.out)])  # --from-runs: from_runs checks each folder, before any work
    # SIGTERM/SIGINT stop the legs' processes too (ffcv_ddpm.stopping): one line, exit 128 + signal.
    return stopping.run_command("numerics", lambda stop: compare_legs(args, argv),
                                errors=(BenchError, TrainingError, LegFailed, ValueError, FileNotFoundError))


def compare_legs(args: argparse.Namespace, argv: list[str]) -> int:
    command = "python -m benchmarks.speed.numerics " + " ".join(argv)
    result = from_runs(args, command) if args.from_runs else measure(args, command)
    stopping.done()  # measured: the report is written whatever comes
    # --from-runs: the card is the runs' (measure checked its folder before training); BenchError: one line
    out = results_out(args.out, result["device"]) / f"numerics-{result['candidate']['precision']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    for leg, text in result.pop("leg_logs", {}).items():
        out.with_name(f"{out.stem}-{leg}.log").write_text(text)
    write_json(out, result, indent=2)  # atomic: a cut-off run leaves no half-written JSON
    render(result, out)
    c, nf, v = result["check"], result["noise_floor"], result["verdict"]
    floor = ""
    if nf:
        floor = (f"; noise floor (control vs fp32) {pct(nf['control'])}, "
                 + (f"candidate {nf['ratio']:,.1f}x it" if nf["ratio"] is not None else "zero") + ": "
                 + ("exceeds" if nf["exceeds"] else "does not exceed") + " the noise floor"
                 + ("; the control is outside the tolerance too: the check cannot separate precision from drift"
                    if nf["control"] > args.tol else ""))
    print(f"numerics: {result['candidate']['precision']} vs fp32: max |smoothed ratio - 1| {c['max_abs_smoothed']:.2%} "
          f"(tolerance {args.tol:.1%}) -> {'ok' if c['ok'] else 'OUTSIDE TOLERANCE'}{floor}; wrote {out}, "
          f"{out.with_suffix('.md').name}, {out.with_suffix('.png').name}")
    print(f"numerics: verdict {'pass' if v['ok'] else 'FAIL'}: {c['max_abs_smoothed']:.2%} against a bound of "
          f"{v['bound']:.2%} (the {v['by']})")
    return 0 if v["ok"] else 1


def measure(args: argparse.Namespace, command: str) -> dict:
    """Run the legs (checked to be paired first) and compare their curves: the result that the JSON holds."""
    if args.steps < 2 * args.log_every:
        raise ValueError(f"--steps {args.steps} gives fewer than two logged intervals of {args.log_every}")
    if (args.gpus is not None or args.time_limit is not None) and not args.parallel:
        raise ValueError("--gpus and --time-limit place and stop the legs' processes: add --parallel")
    for item in [*args.overrides, *args.ref, *args.control]:
        if item.split("=", 1)[0].lstrip("-").replace("-", "_") in ("precision", "train.precision"):
            raise ValueError(f"override {item!r}: each leg's precision is set here (--precision for the "
                             "candidate; the reference and control are fp32)")
    common = [f"train.steps={args.steps}", f"train.log_every={args.log_every}",
              f"train.ckpt_every={args.steps}", "train.sample_every=0", "train.progress=False", *args.overrides]
    legs = [Leg("reference", "fp32", args.ref), Leg("candidate", args.precision, [])]
    if args.control:
        legs.append(Leg("control", "fp32", [*args.ref, *args.control]))
    cfg = load_config(args.preset, common)
    check_data(args.data)  # before the device: a typo is refused before CUDA starts (or fails, in a forked process)
    device = resolve_device(cfg.train.device)
    import torch

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    results_out(args.out, name or "CPU")  # where main writes the report: checked before the legs train
    beton, built = ensure_dataset(args.data, num_synthetic=50_000)  # only once the config is known to be good
    with tempfile.TemporaryDirectory(prefix="numerics-") as tmp:  # the runs' checkpoints are not kept
        tmp = Path(tmp)
        for leg in legs:
            leg.build(args.preset, common, beton, tmp)
        check_paired(legs)
        stopped_at, logs = None, {}
        if args.parallel:
            if device.type == "cuda":
                place_legs(legs, visible_gpus(), args.gpus)
            stopped_at = run_parallel(legs, args.preset, common, beton, tmp, args.time_limit)
            # Kept beside the report: a leg's warnings (an op without a deterministic kernel names itself) are there.
            logs = {leg.name: (tmp / f"{leg.name}.log").read_text(errors="replace") for leg in legs}
        else:
            run_sequential(legs)
        runs = {leg.name: read_run(tmp / leg.name, leg.cfg) for leg in legs}
    timing = {leg.name: leg_timing(runs[leg.name]["stats"], leg.gpu) for leg in legs}
    for leg, t in timing.items():
        print(f"numerics: {leg}: {t['steps']} steps" + (f" on GPU {t['gpu']}" if t["gpu"] is not None else "")
              + (f"; first log line at {t['first_line_s']:.0f} s of its loop, last at {t['last_line_s']:.0f} s, "
                 f"median step {t['median_step_ms']:.1f} ms" if t["steps"] else ""), flush=True)
    curves = common_intervals({leg: run["stats"] for leg, run in runs.items()}, args.log_every)
    steps = curves["reference"][-1]["step"] if len(curves["reference"]) else 0
    if len(curves["reference"]) < 2:
        raise ValueError(f"--time-limit {args.time_limit} s stopped the legs with fewer than two logged intervals "
                         "common to all of them: raise --time-limit, or lower --log-every")
    for leg in runs:
        runs[leg]["stats"] = curves[leg]
    return {
        "preset": args.preset, "device": name or "CPU", "batch_size": cfg.data.batch_size,
        "steps": steps, "log_every": args.log_every, "seed": cfg.train.seed, "command": command,
        "environment": environment(), "config": cfg.to_dict(), "common_overrides": args.overrides,
        "parallel": args.parallel, "planned_steps": args.steps if steps < args.steps else None,
        "time_limit": args.time_limit, "stopped_at_s": stopped_at, "leg_timing": timing,
        "dataset": f"{beton}" + (" (SYNTHETIC)" if built or dataset_info(beton)["synthetic"] else ""),
        "control": None,
        **{leg.name: {"precision": leg.precision, "overrides": leg.overrides, "description": leg.describe(legs[0]),
                      **runs[leg.name]} for leg in legs},
        **compare(curves, args),
        "leg_logs": logs,  # written beside the report by main, not into its JSON
    }


def from_runs(args: argparse.Namespace, command: str) -> dict:
    """The comparison of runs made elsewhere (e.g. three trainer processes on a GPU machine), on the logged steps that
    all of them reached: a run stopped early (SIGTERM) counts up to its last full interval."""
    if len(args.from_runs) not in (2, 3):
        raise ValueError("--from-runs takes REFERENCE CANDIDATE [CONTROL] run folders")
    legs, runs, envs = [], {}, {}
    for name, run_dir in zip(("reference", "candidate", "control"), args.from_runs):
        files = {f: run_dir / f for f in ("config.json", "stats.jsonl", "environment.json")}
        missing = [str(p) for p in files.values() if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"--from-runs: {run_dir} is not a finished run folder (missing {', '.join(missing)})")
        cfg = RunConfig.from_dict(json.loads(files["config.json"].read_text()))
        envs[name] = json.loads(files["environment.json"].read_text())
        if cfg.train.device == "auto":  # where it ran, not where it is analysed, decides the random stream
            cfg.train.device = "cuda" if envs[name].get("cuda_available") else "cpu"
        legs.append(Leg(name, cfg.train.precision, [], cfg))
        runs[name] = {"config": cfg.to_dict(), "run_dir": str(run_dir),
                      "stats": read_stats(run_dir)}
    if [leg.precision for leg in legs[::2]] != ["fp32"] * len(legs[::2]):
        raise ValueError("--from-runs: the reference and control runs must be train.precision=fp32")
    check_paired(legs)  # the same train.log_every in every run, among the rest
    curves = common_intervals({name: r["stats"] for name, r in runs.items()}, legs[0].cfg.train.log_every)
    if len(curves["reference"]) < 2:
        raise ValueError("--from-runs: the runs share fewer than two logged intervals")
    cfg = legs[1].cfg
    env = envs["candidate"]
    return {
        "preset": cfg.preset, "device": (env.get("gpus") or [{}])[0].get("name", "CPU"),
        "batch_size": cfg.data.batch_size, "steps": curves["candidate"][-1]["step"], "planned_steps": cfg.train.steps,
        "log_every": cfg.train.log_every, "seed": cfg.train.seed, "command": command,
        "environment": env, "analysed_with": environment(), "config": cfg.to_dict(), "common_overrides": [],
        "parallel": None, "dataset": f"{cfg.data.path} (as the runs recorded it)", "control": None,
        "leg_timing": {leg.name: leg_timing(runs[leg.name]["stats"], None) for leg in legs},
        **{leg.name: {"precision": leg.precision, "overrides": [], "description": leg.describe(legs[0]),
                      **{**runs[leg.name], "stats": curves[leg.name]}} for leg in legs},
        **compare(curves, args),
    }


if __name__ == "__main__":
    sys.exit(main())
